"""Unit tests of the shared models, toy data and timeline recorder.

Run: .venv/bin/python -m pytest tests/test_models_timeline.py
"""
import pytest
import torch

from labsupport import models, timeline


def test_models_are_identical_for_a_seed_and_leave_the_global_rng_alone():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b = models.DeepMLP(seed=7), models.DeepMLP(seed=7)
    assert torch.equal(torch.random.get_rng_state(), before)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    c = models.DeepMLP(seed=8)
    assert not torch.equal(next(a.parameters()), next(c.parameters()))


def test_stages_share_parameters_and_compose_to_the_model():
    model = models.DeepMLP(d_in=4, width=8, depth=5, d_out=2)
    x = torch.randn(3, 4)
    for p in (1, 2, 3, 6):
        stages = model.stages(p)
        assert len(stages) == p
        y = x
        for stage in stages:
            y = stage(y)
        torch.testing.assert_close(y, model(x), rtol=0, atol=0)
        assert sum(len(list(s.parameters())) for s in stages) == len(list(model.parameters()))
    with pytest.raises(ValueError, match="cannot split 6 blocks into 7 stages"):
        model.stages(7)


def test_decoder_is_causal_seeded_and_checks_its_sizes():
    cfg = models.GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=4, layers=2)
    model, same = models.GPT(cfg, seed=3), models.GPT(cfg, seed=3)
    ids, targets = models.toy_tokens(batch=2, seq_len=8, vocab_size=32, seed=1)
    logits = model(ids)
    assert logits.shape == (2, 8, 32)
    torch.testing.assert_close(same(ids), logits, rtol=0, atol=0)
    ids2 = ids.clone()
    ids2[:, -1] = (ids2[:, -1] + 1) % 32  # a change at the last position leaves earlier ones
    torch.testing.assert_close(model(ids2)[:, :-1], logits[:, :-1], rtol=0, atol=0)
    assert model.lm_head.weight is model.tok.weight  # tied: counted once
    n = sum(p.numel() for p in model.parameters())
    h, V, s, f = 16, 32, 8, 64
    per_block = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 2 * 2 * h
    assert n == V * h + s * h + 2 * per_block + 2 * h
    loss = model(ids, targets)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten()))
    with pytest.raises(ValueError, match="divisible by heads"):
        models.GPTConfig(hidden=10, heads=4)
    with pytest.raises(ValueError, match="longer than seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_toy_tokens_follow_their_rule():
    ids, targets = models.toy_tokens(batch=3, seq_len=6, vocab_size=10, seed=0)
    assert ids.shape == targets.shape == (3, 6) and ids.dtype == torch.int64
    torch.testing.assert_close(ids[:, 1:], targets[:, :-1])
    step = (ids[:, 1] - ids[:, 0]) % 10
    torch.testing.assert_close((ids[:, :-1] + step[:, None]) % 10, ids[:, 1:])


def test_toy_data_and_shards():
    x, y = models.toy_regression(n_samples=8, d_in=3, d_out=2, seed=1)
    x2, _ = models.toy_regression(n_samples=8, d_in=3, d_out=2, seed=1)
    assert x.shape == (8, 3) and y.shape == (8, 2) and torch.equal(x, x2)
    shards = [models.shard(x, r, 4) for r in range(4)]
    assert torch.equal(torch.cat(shards), x)
    with pytest.raises(ValueError, match="do not split evenly over 3 ranks"):
        models.shard(x, 0, 3)


def hand_made_gpipe(p=4, m=4, f=1.0, b=2.0):
    """The ideal GPipe schedule: forwards then backwards, one stage per rank."""
    events = []
    for r in range(p):
        tl = timeline.Timeline(rank=r)
        for i in range(m):
            tl.record("compute", "F", (r + i) * f, (r + i + 1) * f, mb=i)
        start_b = (m + p - 1) * f
        for i in range(m):
            begin = start_b + (p - 1 - r + i) * b
            tl.record("compute", "B", begin, begin + b, mb=i)
        events.append(tl.events)
    return timeline.merge(events)


def test_bubble_of_a_hand_made_gpipe_timeline_matches_the_formula():
    p, m = 4, 4
    result = timeline.bubble(hand_made_gpipe(p, m))
    assert result["fraction"] == pytest.approx((p - 1) / (m + p - 1))
    assert result["ratio"] == pytest.approx((p - 1) / m)
    assert result["window"] == pytest.approx((m + p - 1) * 3.0)


def test_overlapping_spans_count_once_and_bad_events_are_refused():
    tl = timeline.Timeline(rank=0)
    tl.record("compute", "a", 0.0, 2.0)
    tl.record("compute", "b", 1.0, 3.0)
    tl.record("comm", "c", 0.0, 10.0)
    assert timeline.busy_time(tl.events, 0) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="unknown lane"):
        tl.record("gpu", "x", 0, 1)
    with pytest.raises(ValueError, match="ends .* before it starts"):
        tl.record("compute", "x", 2, 1)
    with pytest.raises(ValueError, match="no events"):
        timeline.bubble([])


def test_spans_and_gantt_from_real_ranks():
    import labsupport as ls

    def record():
        import time

        import torch.distributed as dist
        tl = timeline.Timeline()
        dist.barrier()  # both ranks leave it together, whatever the machine's load
        time.sleep(0.05 * dist.get_rank())
        with tl.span("compute", "work", mb=dist.get_rank()):
            time.sleep(0.02)
        return tl.events

    events = timeline.merge(ls.run(record, world_size=2))
    assert [e["rank"] for e in events] == [0, 1] and min(e["start"] for e in events) == 0.0
    assert events[1]["start"] >= 0.025  # rank 1 started later, on the same clock
    fig = timeline.gantt(events, title="two ranks", label=lambda e: e["mb"])
    assert len(fig.data) == 1 and fig.layout.title.text == "two ranks"  # a trace per name
    assert list(fig.data[0].y) == ["rank 0", "rank 1"] and list(fig.data[0].text) == ["0", "1"]
    ls.shutdown()
