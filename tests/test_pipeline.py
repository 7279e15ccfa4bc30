"""Pipeline schedules (labsupport.pipeline.pipeline): parity through the launcher, the
ideal-machine player, the bubble measurement, and the notebook's copy of the lesson code.

Run: .venv/bin/python -m pytest tests/test_pipeline.py
"""

import pytest
import torch
import torch.nn.functional as F

import labsupport as ls
from labsupport import models, timeline
from labsupport.pipeline import bubbles, pipeline
from labsupport.pipeline import explorer as pipeline_explorer
from labsupport.pipeline import sim as pipeline_sim
from nbtools import assert_lesson_copy

MODEL_KW = dict(d_in=8, width=16, depth=17, d_out=4, seed=0)  # 16 hidden blocks
SCHEDULES = {"naive": pipeline.train_step_naive, "afab": pipeline.train_step_afab,
             "1f1b": pipeline.train_step_1f1b, "interleaved": pipeline.train_step_interleaved}
CASES = [("naive", 1, 1), ("afab", 4, 1), ("afab", 8, 1), ("1f1b", 2, 1), ("1f1b", 8, 1),
         ("interleaved", 4, 2), ("interleaved", 8, 2), ("interleaved", 8, 4)]


def reference(x, y):
    model = models.DeepMLP(**MODEL_KW)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss.detach(), {n: q.grad for n, q in model.named_parameters()}


@pytest.fixture(scope="module")
def data():
    x, y = models.toy_regression(n_samples=16, d_in=8, d_out=4, seed=1)
    return x, y, *reference(x, y)


@pytest.fixture(scope="module", params=[2, 4], ids=["p2", "p4"])
def cluster(request):
    cluster = ls.start(world_size=request.param)
    yield cluster
    ls.shutdown()


def merged_grads(out, names):
    got = [n for rank in out for n in rank["grads"]]
    assert sorted(got) == sorted(names), "every parameter's gradient on exactly one rank"
    return {n: g for rank in out for n, g in rank["grads"].items()}


# --- parity through the launcher ----------------------------------------------------

@pytest.mark.parametrize("name,m,v", CASES, ids=[f"{n}-m{m}-v{v}" for n, m, v in CASES])
def test_schedule_gives_single_process_loss_gradients_and_stash(cluster, data, name, m, v):
    x, y, ref_loss, ref_grads = data
    p = cluster.world_size
    out = cluster.run(pipeline.run_step, SCHEDULES[name], x, y, m, v, MODEL_KW)
    for key, grad in merged_grads(out, ref_grads).items():
        torch.testing.assert_close(grad, ref_grads[key])
    torch.testing.assert_close(out[-1]["loss"], ref_loss)
    assert all(rank["loss"] is None for rank in out[:-1])
    assert [r["peak"] for r in out] == [pipeline_sim.stash_formula(name, p, m, v, r)
                                        for r in range(p)]
    # one activation and one gradient per stage boundary and micro-batch
    assert sum(r["messages"] for r in out) == 2 * m * (p * v - 1)
    events = timeline.merge([r["events"] for r in out])
    assert sum(e["lane"] == "compute" for e in events) == 2 * p * v * m


@pytest.mark.parametrize("schedule_name,ours,v", [
    ("ScheduleGPipe", "afab", 1), ("Schedule1F1B", "1f1b", 1),
    ("ScheduleInterleaved1F1B", "interleaved", 2)])
def test_pytorch_pipelining_gives_the_same_gradients(cluster, data, schedule_name, ours, v):
    x, y, ref_loss, ref_grads = data
    m = 2 * cluster.world_size
    theirs = cluster.run(pipeline.run_step_torch, schedule_name, x, y, m, v, MODEL_KW)
    mine = cluster.run(pipeline.run_step, SCHEDULES[ours], x, y, m, v, MODEL_KW)
    t, o = merged_grads(theirs, ref_grads), merged_grads(mine, ref_grads)
    for key in ref_grads:
        torch.testing.assert_close(t[key], o[key])
        torch.testing.assert_close(t[key], ref_grads[key])
    torch.testing.assert_close(theirs[-1]["loss"], ref_loss)


def test_bad_sizes_are_refused_with_a_clear_error(cluster, data):
    x, y, *_ = data
    with pytest.raises(ls.RankError, match="that m divides"):
        cluster.run(pipeline.run_step, pipeline.train_step_afab, x, y, 3, 1, MODEL_KW)
    with pytest.raises(ls.RankError, match="needs p | m"):
        m = cluster.world_size // 2
        cluster.run(pipeline.run_step, pipeline.train_step_interleaved, x, y, m, 2, MODEL_KW)
    with pytest.raises(ValueError, match="cannot split 16 hidden blocks into 3"):
        pipeline.split_stages(models.DeepMLP(**MODEL_KW), 3)


def test_split_stages_are_equal_and_compose_to_the_model():
    model = models.DeepMLP(**MODEL_KW)
    x = torch.randn(3, 8)
    for n in (1, 2, 4, 8, 16):
        stages = pipeline.split_stages(model, n)
        hidden = [sum(isinstance(b, torch.nn.Sequential) and b[0].in_features == 16
                      for b in s) for s in stages]
        assert hidden == [16 // n] * n
        out = x
        for stage in stages:
            out = stage(out)
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)


# --- the ideal-machine player --------------------------------------------------------

@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_ideal_bubbles_equal_the_formulas(p):
    for m in (1, 2, 3, 5, 8, 16):
        for name in ("afab", "1f1b"):
            b = timeline.bubble(pipeline_sim.ideal_events(SCHEDULES[name], p, m, t_b=2.5))
            f = pipeline_sim.bubble_formula(p, m)
            assert b["fraction"] == pytest.approx(f["fraction"])
            assert b["ratio"] == pytest.approx(f["ratio"])
    for m in (p, 2 * p, 4 * p):
        for v in (1, 2, 3, 4):
            b = timeline.bubble(pipeline_sim.ideal_events(pipeline.train_step_interleaved,
                                                          p, m, v))
            assert b["fraction"] == pytest.approx(pipeline_sim.bubble_formula(p, m, v)["fraction"])


@pytest.mark.parametrize("name,v", [("afab", 1), ("1f1b", 1), ("interleaved", 2),
                                    ("interleaved", 3)])
def test_stash_formula_matches_the_orders(name, v):
    for p in (2, 4):
        for m in (p, 2 * p, 3 * p):
            for rank, ops in enumerate(pipeline_sim.orders(SCHEDULES[name], p, m, v)):
                live = peak = 0
                for kind, _, _ in ops:
                    live += 1 if kind == "F" else -1
                    peak = max(peak, live)
                assert peak == pipeline_sim.stash_formula(name, p, m, v, rank)


def test_player_finds_deadlocks_and_incomplete_schedules():
    def mixed_up(pp):  # rank 0 without warm-up, rank 1 GPipe: a cycle
        for i in range(pp.m):
            pp.forward(pp.rank, i)
            if pp.rank == 0:
                pp.backward(pp.rank, i)
        if pp.rank != 0:
            for i in range(pp.m):
                pp.backward(pp.rank, i)

    with pytest.raises(RuntimeError, match=r"deadlock: .*rank 0 at \('B', 0, 0\)"):
        pipeline_sim.ideal_events(mixed_up, 2, 2)

    def forgets_a_backward(pp):
        pp.forward(pp.rank, 0)

    with pytest.raises(ValueError, match=r"missing \[\('B', 0, 0\)\]"):
        pipeline_sim.orders(forgets_a_backward, 2, 1)
    with pytest.raises(ValueError, match="needs p | m"):
        pipeline_sim.orders(pipeline.train_step_interleaved, 4, 2, 2)
    with pytest.raises(ValueError, match="unknown schedule"):
        pipeline_sim.stash_formula("zb-v", 2, 2)
    with pytest.raises(ValueError, match="at least 1"):
        pipeline_sim.bubble_formula(2, 0)


def test_replay_with_given_durations_and_the_charts():
    durations = {op: 1.0 for ops in pipeline_sim.orders(pipeline.train_step_afab, 2, 2)
                 for op in ops}
    durations["F", 1, 0] = 3.0  # a slow last stage delays rank 1's whole pipeline
    events = pipeline_sim.ideal_events(pipeline.train_step_afab, 2, 2, durations=durations)
    assert max(e["end"] for e in events) == pytest.approx(1 + 3 + 1 + 1 + 1 + 1)
    fig = timeline.gantt(events, "two ranks", legend=pipeline_sim.KINDS,
                         label=pipeline_sim.micro_batch, scale=1)
    assert [t.name for t in fig.data] == ["forward", "backward"]
    assert list(fig.data[0].text) == ["0", "1", "0", "1"]  # micro-batches, rank 0 then 1
    assert list(fig.layout.yaxis.categoryarray) == ["rank 0", "rank 1"]


def test_explorer_views_are_consistent():
    fig = pipeline_explorer.explorer({"GPipe": (pipeline.train_step_afab, 1),
                                 "interleaved": (pipeline.train_step_interleaved, 2)},
                                ps=(2, 4), ms=(1, 2, 4))
    buttons = fig.layout.updatemenus[0].buttons
    assert [b.label for b in buttons] == ["GPipe, p=2", "GPipe, p=4", "interleaved, p=2",
                                          "interleaved, p=4"]
    slider = buttons[2].args[1]["sliders"][0]
    assert [s["label"] for s in slider["steps"]] == ["2", "4"]  # p | m only
    for step in slider["steps"]:
        assert sum(step["args"][0]["visible"]) == 2  # forwards and backwards of one view
    assert sum(t.visible for t in fig.data) == 2
    assert fig.layout.title.text == "GPipe, p=2, m=1"
    assert fig.layout.title.subtitle.text.startswith("bubble: 50% of the wall time")


# --- measuring bubbles ---------------------------------------------------------------

def test_measure_gives_a_row_with_the_formula_and_a_table(cluster):
    p = cluster.world_size
    row = bubbles.measure(cluster, pipeline.train_step_1f1b, 4, model_kw=dict(width=32),
                          rows=4, runs=2)
    assert row["formula"] == pytest.approx((p - 1) / (4 + p - 1))
    assert row["peaks"] == [min(p - r, 4) for r in range(p)]
    assert 0 < row["measured"] < 1 and 0 < row["replay"] < 1 and row["t_b"] > 0
    assert sum(e["name"] == "F" for e in row["events"]) == 4 * p
    f = row["formula"]
    assert bubbles.within(dict(row, measured=1.09 * f))
    assert not bubbles.within(dict(row, measured=1.11 * f))
    assert len(bubbles.table([row]).data[0].cells.values[0]) == 1
    header = list(bubbles.table([row]).data[0].header.values)
    cells = [c[0] for c in bubbles.table([row]).data[0].cells.values]
    ratio = cells[header.index("idle/compute: formula")]
    assert float(ratio) == pytest.approx((p - 1) / 4, abs=1e-3)  # (p-1)/(v·m)
    assert float(cells[header.index("idle/compute: formula") + 1]) == pytest.approx(
        row["measured_ratio"], abs=1e-3)
    shown = pipeline_explorer.explorer({"1F1B": (pipeline.train_step_1f1b, 1)}, ps=(p,), ms=(2, 4),
                                  measured=[row])
    titles = [s["args"][1]["title.subtitle.text"] for s in shown.layout.sliders[0].steps]
    assert "measured" not in titles[0]  # m=2 was not run
    assert (f"measured in this run: {row['measured']:.0%} and {row['measured_ratio']:.0%}"
            in titles[1])
    assert len(bubbles.versus_m([row]).data) == 2
    assert "recorded, then ideal" in bubbles.gantt_pair(row).layout.title.text
    with pytest.raises(ValueError, match="runs >= 1"):
        bubbles.measure(cluster, pipeline.train_step_1f1b, 4, runs=0)


# -- the notebook's copy of the lesson is the package's ---------------------------

def test_the_notebook_copy_is_the_package_code():
    assert_lesson_copy(pipeline)
