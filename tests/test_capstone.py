# Run: flock /tmp/heavy.lock .venv/bin/python -m pytest tests/test_capstone.py
"""labsupport.capstone: the Bible as bytes, the loader, the layout, and the composed
(dp, tp, pp, cp) trainer's parity with one process, by the launcher at 1 to 16 ranks.

Parity, fp32, the same global batch: the step-0 loss within 1e-6 (relative) of
one process (``models.GPT`` itself, ``trainer.reference``), every rank's
gradient of every parameter at step 0 within GRAD_TOL of the parameter's
largest entry (``compare.grad_differences``), and the loss curve within 1e-4;
in float64 the same differences shrink to rounding (<= 1e-12), so what is
left in fp32 is the order of the sums. Then the parity procedure names the
broken gradient synchronisations. Layouts with degrees 3 and 4 (where no two
groups have one size by accident) hold the same parity, and each rank's share of
the FLOPs (``flops.rank_flops``, the your-turn's answer) is what torch's FLOP
counter counts on its stage. The suite's strict point-to-point mode (root
conftest) holds every message to NCCL's rules.
"""
import math
import sys

import cloudpickle
import pytest
import torch

import labsupport as ls
from labsupport import models
from labsupport.capstone import compare, data, model, trainer
from labsupport.capstone import layout as lay

cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS = 4
GRAD_TOL = 1e-5       # fp32: measured <= 2.2e-6 at every layout below (key biases)
LAYOUTS = [(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2),
           (1, 2, 1, 2), (2, 2, 2, 1), (2, 2, 2, 2)]     # sorted by world size


@pytest.fixture(scope="module")
def reference():
    return {dtype: trainer.reference(STEPS, record_grads=(0,), dtype=dtype)
            for dtype in (torch.float32, torch.float64)}


def _run(layout, **kw):
    return ls.run(trainer.train, layout, STEPS, record_grads=(0,),
                  world_size=math.prod(layout), backend="gloo", **kw)


# --- data -------------------------------------------------------------------------
def test_corpus_is_the_king_james_bible_as_utf8_bytes():
    text = data.corpus()
    assert text.dtype == torch.uint8 and len(text) == 4_185_991
    assert data.decode(text[:58]) == ("In the beginning God created the heaven and the "
                                      "earth. And")
    assert len(set(bytes(text.tolist()).decode("utf-8"))) == 68   # distinct characters
    train_bytes, val_bytes = data.split(text)
    assert len(train_bytes) + len(val_bytes) == len(text)
    assert 0.049 < len(val_bytes) / len(text) < 0.051 and train_bytes[-1] == ord("\n")
    assert data.split(text)[1].equal(val_bytes)                   # fixed


def test_loader_shards_by_dp_rows_and_cp_columns_and_resumes_on_another_dp():
    train_bytes = data.split(data.corpus())[0]
    whole = data.Loader(train_bytes, 8, 16, seed=3)
    batches = [whole.next() for _ in range(4)]
    again = data.Loader(train_bytes, 8, 16, seed=3)
    assert all(a.equal(b) for x, y in zip(batches, [again.next() for _ in range(4)])
               for a, b in zip(x, y))
    ids, targets = batches[0]
    assert ids[:, 1:].equal(targets[:, :-1])                      # next bytes
    # dp = 2, cp = 2: each rank its rows and its contiguous columns
    parts = {(d, c): data.Loader(train_bytes, 8, 16, 3, 2, d, 2, c).next()
             for d in range(2) for c in range(2)}
    rebuilt = torch.cat([torch.cat([parts[d, c][0] for c in range(2)], 1)
                         for d in range(2)])
    assert rebuilt.equal(ids)
    # the position is the number of global batches: resume at dp = 4 after 3 at dp = 2
    two = data.Loader(train_bytes, 8, 16, 3, 2, 1)
    for _ in range(3):
        two.next()
    four = [data.Loader(train_bytes, 8, 16, 3, 4, d) for d in range(4)]
    for loader in four:
        loader.load_state_dict(two.state_dict())
    assert torch.cat([loader.next()[0] for loader in four]).equal(batches[3][0])
    with pytest.raises(ValueError, match="same global batch"):
        data.Loader(train_bytes, 4, 16, 3).load_state_dict(two.state_dict())


# --- layout -----------------------------------------------------------------------
def test_ranks_are_placed_as_picotrons_view_dp_pp_cp_tp():
    layout = lay.Layout(dp=2, tp=2, pp=2, cp=3)
    grid = torch.arange(layout.world_size).view(2, 2, 3, 2)   # view(dp, pp, cp, tp)
    for r in range(layout.world_size):
        c = layout.coords(r)
        assert grid[c.dp, c.pp, c.cp, c.tp] == r and layout.rank(c) == r
    groups = lay.layout_groups(layout)
    assert groups["tp"][0] == [0, 1] and groups["cp"][0] == [0, 2, 4]
    assert groups["pp"][0] == [0, 6] and groups["dp"][0] == [0, 12]
    assert groups["dp_cp"][0] == [0, 2, 4, 12, 14, 16]          # picotron's cp_dp_group
    for name, gs in groups.items():                               # each a partition
        assert sorted(r for g in gs for r in g) == list(range(layout.world_size)), name


def test_the_capstone_decoder_is_untied():
    cfg = model.config()
    gpt = models.GPT(cfg, seed=0)
    assert not cfg.tie_weights and gpt.lm_head.weight is not gpt.tok.weight
    with pytest.raises(ValueError, match="untied"):
        model.config(tie_weights=True)


# --- parity -----------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: "x".join(map(str, lay)))
def test_every_layout_trains_as_one_process(layout, reference):
    outs = _run(layout)
    assert len({tuple(o["losses"]) for o in outs}) == 1         # every rank reports it
    p = compare.parity(outs, reference[torch.float32])
    assert p["step0_rel"] <= 1e-6, p
    assert p["grad_rel"] <= GRAD_TOL, p
    assert p["curve_rel"] <= 1e-4, p
    held = {n for o in outs for n in o["grads"][0]}
    ref = reference[torch.float32]
    assert held == set(ref["grads"][0])                        # every parameter checked
    assert ref["losses"][-1] < ref["losses"][0]



# Degrees 3 and 4, where no two groups have one size by accident: tp = 4, pp = 3 with
# uneven blocks (1, 2, 1), cp = 4, dp = 3, tp = 3 beside cp = 2; a decoder they divide.
SIZES_3_4 = dict(batch=12, seq_len=24,
                 model=dict(hidden=24, heads=12, layers=4, vocab_size=264))
LAYOUTS_3_4 = [(3, 1, 1, 1), (1, 1, 3, 1), (1, 4, 1, 1), (1, 1, 1, 4), (1, 3, 1, 2)]


@pytest.fixture(scope="module")
def reference_3_4():
    return trainer.reference(STEPS, record_grads=(0,), **SIZES_3_4)


@pytest.mark.parametrize("layout", LAYOUTS_3_4, ids=lambda lay: "x".join(map(str, lay)))
def test_layouts_with_degrees_3_and_4_train_as_one_process(layout, reference_3_4):
    outs = _run(layout, **SIZES_3_4)
    p = compare.parity(outs, reference_3_4)
    assert p["step0_rel"] <= 1e-6 and p["grad_rel"] <= GRAD_TOL, p
    assert p["curve_rel"] <= 1e-4, p
    assert {n for o in outs for n in o["grads"][0]} == set(reference_3_4["grads"][0])
    if layout[2] == 3:                                         # the blocks, uneven
        held = {o["coords"][1]: {n.split(".")[1] for n in o["grads"][0]
                                 if n.startswith("blocks.")} for o in outs}
        assert held == {0: {"0"}, 1: {"1", "2"}, 2: {"3"}}, held

def test_float64_leaves_only_rounding(reference):
    outs = _run((2, 2, 2, 2), dtype=torch.float64)
    p = compare.parity(outs, reference[torch.float64])
    assert max(p.values()) <= 1e-12, p


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_the_sharded_weights_after_training_are_one_process_weights(optimizer):
    outs = ls.run(trainer.train, (2, 2, 2, 1), STEPS, return_params=True,
                  optimizer=optimizer, world_size=8, backend="gloo")
    want = trainer.reference(STEPS, optimizer=optimizer)["model"].state_dict()
    got = compare.full_params(outs)
    assert got.keys() == want.keys()
    for name, p in got.items():
        if optimizer == "adamw" and name.endswith("attn.k.bias"):
            # Its exact gradient is zero (softmax ignores a constant added to a
            # row of scores), what fp32 leaves is noise, and Adam divides a
            # gradient by its own size: each layout's noise moves it its own way,
            # by at most lr per step, without changing any output.
            assert (p - want[name]).abs().max() <= STEPS * 3e-3
            continue
        torch.testing.assert_close(p, want[name], rtol=1e-5, atol=1e-6, msg=name)
    assert all(o["tokens_per_s"] > 0 for o in outs)


def test_invalid_layouts_are_refused():
    cfg = model.config(seq_len=32)
    with pytest.raises(ValueError, match="cp=3"):
        model.validate(cfg, lay.Layout(cp=3), 32, True)
    with pytest.raises(ValueError, match="seq_len=8"):          # 32 / cp=4 over tp=16
        model.validate(cfg, lay.Layout(tp=16, cp=4), 32, True)
    with pytest.raises(ValueError, match="pipeline stages"):
        model.validate(cfg, lay.Layout(pp=3), 32, True)


# --- the parity procedure -------------------------------------------------------------
def test_compare_finds_equal_layouts_equal():
    report = compare.compare((1, 1, 1, 1), (2, 2, 2, 1), steps=2)
    assert report.equal, str(report)


def test_compare_names_the_missing_tp_reduction_of_sequence_parallel_grads():
    report = compare.compare((1, 1, 1, 1), (1, 2, 2, 1), steps=2,
                             sync_b=compare.sync_without_sp_reduce)
    assert report.step == 0 and report.parameter == "pos.weight", str(report)
    assert report.ranks == [0, 1]                                # stage 0's tp ranks
    assert "all-reduce over tp is missing" in report.reduction, str(report)


def test_compare_names_the_missing_division_by_cp():
    report = compare.compare((1, 1, 1, 1), (1, 1, 1, 2), steps=2,
                             sync_b=compare.sync_dp_not_cp)
    assert report.step == 0 and report.parameter == "tok.weight", str(report)
    assert report.factor == pytest.approx(2, rel=1e-4)
    assert report.reduction.startswith("x2 = |cp|"), str(report)


def test_parity_table_rows():
    rows = compare.parity_table([(1, 1, 1, 1), (1, 1, 2, 1)], steps=2)
    assert [r["layout"] for r in rows] == ["1x1x1x1", "1x1x2x1"]
    for r in rows:
        assert r["step0_rel"] <= 1e-6 and r["grad_rel"] <= GRAD_TOL
        assert r["curve_rel"] <= 1e-4


def test_flops_per_token_both_conventions():
    from labsupport.capstone import flops
    cfg = model.config(vocab_size=256, seq_len=64, hidden=48, heads=4, layers=3)
    n = cfg.layers * 12 * cfg.hidden ** 2 + cfg.vocab_size * cfg.hidden   # matmul weights
    full = 6 * n + 12 * cfg.layers * cfg.hidden * 64
    assert flops.per_token(cfg, 64) == pytest.approx(full)
    assert flops.per_token(cfg, 64, causal=True) == pytest.approx(full - 6 * 3 * 48 * 64)
    assert flops.mfu(1000.0, full, 1000.0 * full) == pytest.approx(1.0)


def _counted_forward_flops(layout, sizes, seq_len):
    """On every rank: FLOPs of its Stage's forward on one sequence, counted by
    torch.utils.flop_counter (matmuls only; the ring's blocks as they run)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from labsupport.capstone import model, trainer
    cfg = model.run_config(seq_len, sizes)
    stage, groups, coords = trainer.build(layout, cfg)
    c = seq_len // layout[3]
    if coords.pp == 0:
        x = torch.randint(0, cfg.vocab_size, (1, c))
    else:                                      # the stream under SP: c/tp positions
        x = torch.randn(1, c // layout[1], cfg.hidden)
    with FlopCounterMode(display=False) as counter:
        stage(x)
    return dict(pp=coords.pp, cp=coords.cp, flops=counter.get_total_flops())


@pytest.mark.parametrize("layout", [(1, 1, 1, 1), (1, 2, 3, 1), (1, 1, 2, 4), (1, 3, 1, 2)],
                         ids=lambda lay: "x".join(map(str, lay)))
def test_rank_flops_is_the_work_each_rank_counts(layout):
    from labsupport.capstone import flops
    sizes, seq = dict(hidden=24, heads=6, layers=4, vocab_size=264), 48
    cfg = model.run_config(seq, sizes)
    outs = ls.run(_counted_forward_flops, layout, sizes, seq,
                  world_size=math.prod(layout), backend="gloo")
    for o in outs:
        want = flops.rank_flops(cfg, seq, lay.Layout(*layout), o["pp"], o["cp"])
        assert 3 * o["flops"] == pytest.approx(want, rel=1e-12), (o, want)
    # over the ranks of one replica, at cp = 1: the whole model's count
    if layout[3] == 1:
        total = sum(o["flops"] for o in outs) * 3 / seq
        assert total == pytest.approx(flops.per_token(cfg, seq), rel=1e-12)


def test_cpu_theoretical_peak_reads_cpuinfo(tmp_path):
    from labsupport.capstone import flops
    f = tmp_path / "cpuinfo"
    f.write_text("model name\t: Some CPU\ncpu MHz\t\t: 2000.000\n"
                 "flags\t\t: fpu sse avx2 fma\n")
    p = flops.cpu_theoretical_peak(str(f))
    cores = p["cores"]
    assert (p["isa"], p["ghz"]) == ("avx2", 2.0)
    assert p["low"] == pytest.approx(cores * 2e9 * 8 * 2) and p["high"] == 2 * p["low"]


def test_compare_names_a_weight_updated_twice():
    # Gradients equal at step 0, the update of stage 0's first weight doubled:
    # tok.weight on the ranks of stage 0 whose embedding rows step 0 uses (tp
    # rank 1 holds the rows of bytes 128-255, of which its batch has none:
    # their gradient is zero, their update zero, doubled or not).
    ids = data.Loader(data.split(data.corpus())[0], 8, 32).next()[0]
    assert int(ids.max()) < 128
    report = compare.compare((1, 1, 1, 1), (2, 2, 2, 1), steps=2,
                             optimizer_b=compare.adamw_one_weight_twice)
    assert report.step == 0 and report.what == "update", str(report)
    assert report.parameter == "tok.weight" and report.ranks == [0, 4], str(report)
    assert report.factor == pytest.approx(2, rel=1e-3)
    assert report.reduction.startswith("updated twice (x2 the one-process update)")
    assert "its update x2" in str(report)


# Each broken variant on a layout where its group matters, and the words that name it
# with its group. The last three are told apart by looking at each group's ranks
# (their sum, their mean), not a factor: cp left out at 2x2x1x2, where dp, tp and
# cp are all of size 2; no dp all-reduce at dp = 3; the shards summed at tp = 4.
NAMED = {"LayerNorm grads not reduced over tp under SP":
         ((1, 2, 2, 1), {}, "the sum over the tp group is the reference: the all-reduce "
                            "over tp is missing"),
         "loss averaged over dp but not cp": ((1, 1, 1, 2), {}, "x2 = |cp|"),
         "a weight updated twice": ((1, 1, 2, 1), {}, "updated twice"),
         "cp ranks left out of the gradient average":
         ((2, 2, 1, 2), {}, "the mean over the cp group is the reference: the average "
                            "over cp is missing (cp left out of the gradient all-reduce"),
         "no dp all-reduce at all":
         ((3, 1, 1, 2), dict(batch=12), "the mean over the dp group is the reference: "
                                        "the average over dp is missing"),
         "a tp-sharded gradient all-reduced over tp":
         ((1, 4, 1, 1), {}, "the sum of the reference's tp shards: a tp-sharded gradient "
                            "all-reduced over tp")}


def test_every_broken_variant_is_named_and_a_correct_one_is_not():
    assert set(NAMED) == set(compare.BROKEN) and len(NAMED) >= 6
    for name, (layout, kw, words) in NAMED.items():
        broken = compare.BROKEN[name]
        report = compare.compare((1, 1, 1, 1), layout, steps=1, sync_b=broken.get("sync"),
                                 optimizer_b=broken.get("optimizer"), **kw)
        assert report.step == 0 and words in (report.reduction or ""), (name, str(report))
        assert "not a group-size factor" not in str(report), (name, str(report))
    # At tp = 2 the rows of bytes 128-255 (tp rank 1's shard) have a zero gradient
    # at step 0 (ASCII only): summed over tp they receive rank 0's, with no factor.
    report = compare.compare((1, 1, 1, 1), (1, 2, 1, 1), steps=1,
                             sync_b=compare.sync_every_grad_over_tp)
    assert report.ranks == [1] and "nonzero where the reference's is zero" in str(report)
    assert "tp-sharded gradient all-reduced over tp" in report.reduction, str(report)
    # SGD's update is the gradient times lr: doubled too, and a correct run is equal
    assert compare.compare((1, 1, 1, 1), (1, 1, 2, 1), steps=2, optimizer="sgd").equal


# --- evaluation, the step's breakdown, the your-turn checks ---------------------------
def test_bits_per_byte_and_sampling():
    from labsupport.capstone import evaluate
    val = data.split(data.corpus())[1]
    cfg = model.config(seq_len=32)
    gpt = models.GPT(cfg, seed=0)
    untrained = evaluate.bits_per_byte(gpt, val, 4, 32, 2)
    assert 7.5 < untrained < 8.5               # near log2(256): it knows nothing yet
    trained = trainer.reference(20, lr=1e-2)["model"]
    assert evaluate.bits_per_byte(trained, val, 4, 32, 2) < untrained - 1
    a = evaluate.sample(gpt, "And God said", 40, seed=3)
    assert a == evaluate.sample(gpt, "And God said", 40, seed=3)      # fixed seed
    assert a.startswith("And God said") and a != evaluate.sample(gpt, "And God said",
                                                                 40, seed=4)
    assert len(a.encode("utf-8", errors="surrogatepass")) >= 12
    assert gpt.training                                                 # left as found
    with pytest.raises(ValueError, match="prompt"):
        evaluate.sample(gpt, "", 3)


def test_the_step_breakdown_adds_up_and_sees_each_dimension():
    from labsupport.capstone import breakdown
    outs = ls.run(trainer.train, (1, 2, 2, 2), 2, record_timeline=True, world_size=8,
                  backend="gloo")
    for o in outs:
        parts = breakdown.step_parts(o)
        window = o["timeline"]["end"] - o["timeline"]["start"]
        assert sum(parts.values()) == pytest.approx(window, rel=1e-9)
        assert min(parts["tp"], parts["cp ring"], parts["compute"]) > 0, parts
    assert breakdown.mean_parts(outs)["pp wait"] > 0
    one = ls.run(trainer.train, (1, 1, 1, 1), 2, record_timeline=True, world_size=1)
    parts = breakdown.step_parts(one[0])
    assert parts["tp"] == parts["cp ring"] == parts["pp wait"] == 0
    assert parts["compute"] > 0
    with pytest.raises(ValueError, match="record_timeline"):
        breakdown.step_parts(dict(one[0], timeline=None))


def test_the_your_turn_checks_pass_a_right_answer_and_name_each_slip():
    from labsupport.capstone import checks

    def right(layers, hidden, seq, vocab, layout, pp_rank, cp_rank):
        from labsupport.capstone.model import stage_blocks
        c = seq // layout.cp
        blocks = len(stage_blocks(layers, layout.pp, pp_rank))
        head = hidden * vocab if pp_rank == layout.pp - 1 else 0
        return 6 * (c * (blocks * 12 * hidden ** 2 + head)
                    + blocks * 2 * hidden * c * c * (cp_rank + 1)) / layout.tp
    checks.check_rank_flops(right)
    with pytest.raises(AssertionError, match="returned 0, not"):   # a stub's answer
        checks.check_rank_flops(lambda *a: 0)

    def full_ring(layers, hidden, seq, vocab, layout, pp_rank, cp_rank):
        return right(layers, hidden, seq, vocab, layout, pp_rank, layout.cp - 1)

    def head_everywhere(layers, hidden, seq, vocab, layout, pp_rank, cp_rank):
        head = 6 * (seq // layout.cp) * hidden * vocab / layout.tp
        return (right(layers, hidden, seq, vocab, layout, pp_rank, cp_rank)
                + head * (pp_rank != layout.pp - 1))

    def even_blocks(layers, hidden, seq, vocab, layout, pp_rank, cp_rank):
        per = right(layers, hidden, seq, vocab, layout._replace(pp=1), 0, cp_rank)
        head = 6 * (seq // layout.cp) * hidden * vocab / layout.tp
        last = pp_rank == layout.pp - 1
        return (per - head) / layout.pp + head * last
    slips = {"divide by tp": lambda *a: right(*a) * a[4].tp,
             "the forward": lambda *a: right(*a) / 3,
             r"i \+ 1 of them, not all cp": full_ring,
             "last stage only": head_everywhere,
             "not layers / pp": even_blocks,
             "x1.5": lambda *a: right(*a) * 1.5}
    for words, fn in slips.items():
        with pytest.raises(AssertionError, match=words):
            checks.check_rank_flops(fn)

    def repair(stage, groups, layout):
        from labsupport.tensor_parallel.gpt import allreduce_sequence_parallel_grads
        allreduce_sequence_parallel_grads(stage)
        for p in stage.parameters():
            p.grad /= layout.dp
    checks.check_repair(repair)

    def half_repair(stage, groups, layout):
        for p in stage.parameters():
            p.grad /= layout.dp
    with pytest.raises(AssertionError, match="all-reduce over tp is missing"):
        checks.check_repair(half_repair)


# --- gradient-norm clipping across the mesh -----------------------------------------
# A decoder every degree 3 divides (vocabulary, heads, positions under cp and SP,
# blocks, rows per replica), in float64 so that only rounding is left.
CLIP = dict(batch=12, seq_len=36, model=dict(vocab_size=258, hidden=48, heads=6, layers=3),
            dtype=torch.float64)
MAX_NORM = 0.5        # the norms of these steps are 0.98 to 1.2: every step clips
CLIP_STEPS = 3


@pytest.fixture(scope="module")
def clipped_reference():
    return trainer.reference(CLIP_STEPS, record_grads=tuple(range(CLIP_STEPS)),
                             clip_norm=MAX_NORM, **CLIP)


def test_clipping_is_off_by_default():
    assert trainer.TrainConfig().clip_norm is None
    assert trainer.reference(1)["grad_norms"] == []


@pytest.mark.parametrize("layout", [(3, 1, 1, 1), (1, 3, 1, 1), (1, 1, 3, 1), (1, 1, 1, 3),
                                    (2, 2, 2, 1)], ids=lambda lay: "x".join(map(str, lay)))
def test_clipping_across_the_mesh_is_one_process_clipping(layout, clipped_reference):
    ref = clipped_reference
    assert min(ref["grad_norms"]) > MAX_NORM * 1.5, ref["grad_norms"]   # it clips
    outs = ls.run(trainer.train, layout, CLIP_STEPS, record_grads=tuple(range(CLIP_STEPS)),
                  clip_norm=MAX_NORM, world_size=math.prod(layout), backend="gloo", **CLIP)
    for o in outs:                      # every rank clips by the one global norm
        rel = max(abs(a - b) / b for a, b in zip(o["grad_norms"], ref["grad_norms"]))
        assert rel <= 1e-12, (o["rank"], o["grad_norms"], ref["grad_norms"])
    p = compare.parity(outs, ref)       # the clipped gradients of every step, the curve
    assert max(p.values()) <= 1e-12, p


def _norms_on_rank(layout, **fields):
    """On each rank, after one step's sync: the global gradient norm, right and in
    each of ``clip.WRONG``'s ways."""
    from labsupport.capstone import clip
    seen = {}

    def sync(stage, groups, layout):
        trainer.sync_gradients(stage, groups, layout)
        seen["right"] = clip.grad_norm(stage, groups).item()
        for name, kw in clip.WRONG.items():
            seen[name] = clip.grad_norm(stage, groups, **kw).item()

    out = trainer.train(layout, 1, sync=sync, optimizer="sgd", lr=0.0, **fields)
    return dict(norms=seen, coords=out["coords"], shards=out["shards"])


@pytest.mark.parametrize("layout", [(3, 2, 1, 1), (1, 2, 2, 2)],
                         ids=lambda lay: "x".join(map(str, lay)))
def test_the_wrong_clipping_norms_are_off_by_their_factors(layout):
    from labsupport.capstone import clip
    dp, tp, pp, cp = layout
    ref = trainer.reference(1, record_grads=(0,), **CLIP)["grads"][0]
    whole = math.sqrt(sum(g.square().sum().item() for g in ref.values()))
    outs = ls.run(_norms_on_rank, layout, world_size=math.prod(layout), backend="gloo",
                  **CLIP)
    replicated = {n for o in outs for n, shard in o["shards"].items() if shard is None}
    rep = sum(ref[n].square().sum().item() for n in replicated)
    assert {"tok.weight", "lm_head.weight"}.isdisjoint(replicated) and rep > 0
    over_dp, tp_times, per_stage = clip.WRONG
    stages = {}
    for o in outs:
        n = o["norms"]
        assert n["right"] == pytest.approx(whole, rel=1e-12)       # one process's norm
        assert n[over_dp] == pytest.approx(whole * math.sqrt(dp * cp), rel=1e-12)
        assert n[tp_times] ** 2 == pytest.approx(whole ** 2 + (tp - 1) * rep, rel=1e-12)
        stages[o["coords"][1]] = n[per_stage]
    assert len(stages) == pp                                       # one norm per stage
    assert sum(x ** 2 for x in stages.values()) == pytest.approx(whole ** 2, rel=1e-12)
    if pp > 1:
        assert max(stages.values()) < whole * (1 - 1e-3)


def _tied_norms_on_rank(layout):
    """Assignment 9's tied decoder on this rank, one step synced (the tied weight
    summed over its embedding group): the global norm, and counting every copy."""
    import torch.distributed as dist

    from labsupport.capstone import clip
    from labsupport.grading import grad_sync_4d as g
    layout = lay.Layout(*layout)
    cfg = g.train_config(g.layers_for(layout))
    stage, groups, coords = trainer.build(layout, cfg.gpt_config(), stage_class=g.TiedStage,
                                          groups_of=g.tied_groups)

    def sync(stage, groups, layout):
        trainer.sync_gradients(stage, groups, layout)
        tied = stage.shared_embedding_or_output_weight()
        if layout.pp > 1 and tied is not None:
            dist.all_reduce(tied.grad, group=groups["embedding"])

    trainer.step(stage, torch.optim.SGD(stage.parameters(), lr=0.0),
                 cfg.loader(layout, coords).next(), layout, groups, coords,
                 cfg.micro_batches, sync=sync)
    return (clip.grad_norm(stage, groups).item(),
            clip.grad_norm(stage, groups, replicas_once=False).item())


def test_a_tied_weight_on_two_stages_is_counted_once():
    from labsupport.grading import grad_sync_4d as g
    layout = (1, 2, 2, 1)
    ref = trainer.reference(1, g.train_config(g.layers_for(layout)),
                            record_grads=(0,))["grads"][0]
    whole = math.sqrt(sum(x.square().sum().item() for x in ref.values()))
    outs = ls.run(_tied_norms_on_rank, layout, world_size=4, backend="gloo")
    tied = ref[g.TIED].square().sum().item()
    for right, every_copy in outs:
        assert right == pytest.approx(whole, rel=1e-5)
        assert every_copy ** 2 > whole ** 2 + tied * 0.99      # the tied copy, twice
    with pytest.raises(ValueError, match="does not clip"):
        from labsupport.capstone import native
        native.train((1, 1, 1, 1), 1, clip_norm=1.0)
