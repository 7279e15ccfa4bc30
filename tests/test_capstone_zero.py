# Run: flock /tmp/heavy.lock .venv/bin/python -m pytest tests/test_capstone_zero.py
"""labsupport.capstone.zero and .footprint: ZeRO-1/2 over dp x cp inside the composed
trainer, clipping on its shards, and the memory per rank measured beside the formulas.

Parity in float64 (only rounding left) at layouts with a degree of 3 and with
dp·cp = 4, tp and pp: the weights after three AdamW steps and every loss equal
one process's (``trainer.reference``), and with ``clip_norm`` every rank's norm
before clipping equals ``clip_grad_norm_``'s. Then the bytes each rank holds,
counted from its tensors, against chapter 0's formulas: ZeRO divides the
optimizer state (ZeRO-1) and the gradients (ZeRO-2) by dp·cp.
"""
import math
import sys

import cloudpickle
import pytest
import torch

import labsupport as ls
from labsupport.capstone import compare, footprint, trainer
from labsupport.capstone import layout as lay
from labsupport.capstone import zero as capzero

cloudpickle.register_pickle_by_value(sys.modules[__name__])

# A decoder every degree 3 divides (tests/test_capstone.py's clipping sizes), float64
SIZES = dict(batch=12, seq_len=36, model=dict(vocab_size=258, hidden=48, heads=6, layers=3))
F64 = dict(SIZES, dtype=torch.float64)
STEPS = 3
MAX_NORM = 0.5          # below every step's norm (0.98 to 1.2): every step clips


@pytest.fixture(scope="module")
def reference():
    return {clip: trainer.reference(STEPS, clip_norm=clip, **F64) for clip in (None, MAX_NORM)}


def _max_rel(got, want):
    return max(((got[n] - want[n]).abs().max() / want[n].abs().max()).item() for n in want)


@pytest.mark.parametrize("layout, zero, clip", [
    ((3, 2, 1, 1), 2, MAX_NORM),      # dp = 3 with tp: ZeRO-2, clipped on the shards
    ((2, 1, 2, 2), 1, MAX_NORM),      # dp·cp = 4 with pp (3 blocks on 2 stages)
    ((1, 1, 3, 2), 2, None),          # pp = 3 with cp
    ((3, 1, 2, 1), 1, None),          # dp = 3 with pp
    ((3, 2, 2, 1), 2, MAX_NORM),      # dp = 3 with tp and pp at once, clipped
], ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_zero_trains_as_one_process(layout, zero, clip, reference):
    ref = reference[clip]
    outs = ls.run(trainer.train, layout, STEPS, zero=zero, clip_norm=clip, return_params=True,
                  world_size=math.prod(layout), backend="gloo", **F64)
    rel = [abs(a - b) / b for a, b in zip(outs[0]["losses"], ref["losses"])]
    assert max(rel) <= 1e-12, rel
    got, want = compare.full_params(outs), ref["model"].state_dict()
    assert got.keys() == want.keys()
    assert _max_rel(got, want) <= 1e-10
    if clip is not None:                 # every rank clips by the one global norm
        assert min(ref["grad_norms"]) > MAX_NORM * 1.5
        for o in outs:
            norms = zip(o["grad_norms"], ref["grad_norms"])
            assert max(abs(a - b) / b for a, b in norms) <= 1e-12, o["grad_norms"]
    # the weights moved: a run that skipped the all-gather would still hold step 0's
    start = trainer.reference(1, lr=0.0, **F64)["model"].state_dict()
    assert _max_rel(got, start) > 1e-3


def _zero_norms(layout, zero):
    """One ZeRO step's norm on this rank: summed over dp x cp (right) and not."""
    import torch.distributed as dist
    seen = {}
    cfg = trainer.TrainConfig.of(None, zero=zero, **F64)
    stage, groups, coords = trainer.build(layout, cfg.gpt_config(), dtype=cfg.dtype)
    opt = capzero.ShardedOptimizer(stage, groups, cfg.make_optimizer, zero)

    def sync(stage, groups, layout):
        opt.sync(stage, groups, layout)
        seen["right"] = opt.grad_norm(groups).item()
        squares = (opt.shard.grad * opt.counted).square().sum()
        for name in ("tp", "pp"):                # forgetting that the shards are disjoint
            dist.all_reduce(squares, group=groups[name])
        seen["own shard only"] = squares.sqrt().item()

    with trainer._default_dtype(cfg.dtype):
        trainer.step(stage, opt, cfg.loader(lay.Layout(*layout), coords).next(),
                     lay.Layout(*layout), groups, coords, cfg.micro_batches, sync, cfg.dtype)
    return seen


def test_the_norm_of_zero_shards_is_summed_over_dp_cp():
    layout = (2, 2, 1, 2)
    whole = trainer.reference(1, clip_norm=1e9, **F64)["grad_norms"][0]
    outs = ls.run(_zero_norms, layout, 2, world_size=8, backend="gloo")
    for o in outs:
        assert o["right"] == pytest.approx(whole, rel=1e-12)
    own = [o["own shard only"] ** 2 for o in outs]
    assert max(own) < whole ** 2 * 0.9           # one shard of four holds part of it
    # the 4 disjoint shards of each dp x cp group add up to the whole, on each of tp = 2
    assert sum(own) == pytest.approx(2 * whole ** 2, rel=1e-12)


def test_zero_refuses_what_it_does_not_do_and_says_what_to_do():
    with pytest.raises(ValueError, match="use 0 .* 1 .* or 2"):
        capzero.check(3, False, (), False)
    with pytest.raises(ValueError, match="reduce-scatter: use zero=0"):
        capzero.check(1, True, (), False)
    with pytest.raises(ValueError, match="return_params=True"):
        capzero.check(2, False, (0,), False)
    capzero.check(0, True, (0,), True)            # plain dp: everything allowed
    with pytest.raises(ls.RankError, match="use zero=0 with checkpoint_every or resume"):
        ls.run(trainer.train, (1, 1, 1, 1), 1, zero=1, checkpoint_every=1,
               checkpoint_dir="unused", world_size=1, backend="gloo")
    assert trainer.TrainConfig().zero == 0


# --- memory per rank ----------------------------------------------------------------
def test_peak_saved_counts_what_autograd_holds_and_releases_it():
    lin = torch.nn.Linear(64, 64)
    saved = footprint.PeakSaved(exclude=lin.parameters())
    x = [torch.randn(8, 64, requires_grad=True) for _ in range(2)]
    with saved.hooks():
        y = [torch.nn.functional.gelu(lin(xi)).sum() for xi in x]   # two in flight
        held = saved.live
        y[0].backward()
        after_one = saved.live
        y[1].backward()
    one = 2 * 8 * 64 * 4            # the linear's input and GELU's input, fp32
    assert held == saved.peak == 2 * one and after_one == one and saved.live == 0


@pytest.mark.parametrize("layout", [(2, 2, 2, 2), (1, 3, 3, 1)],
                         ids=lambda x: "x".join(map(str, x)))
def test_memory_per_rank_is_the_formulas(layout):
    fields = dict(SIZES) if 3 in layout else {}
    rows = footprint.table(ls.run(footprint.measure, layout, world_size=math.prod(layout),
                                  backend="gloo", **fields), layout, **fields)
    layout = lay.Layout(*layout)
    cfg = trainer.TrainConfig.of(None, **fields)
    for r in rows:
        c = lay.Coords(*r["coords"])
        assert r["batch"] == (cfg.batch // layout.dp, cfg.seq_len // layout.cp)
        assert len(r["blocks"]) == len(footprint.stage_blocks(cfg.gpt_config().layers,
                                                              layout.pp, c.pp))
        assert r["params"] == 4 * footprint.stage_psi(cfg.gpt_config(), layout, c)
        for key in footprint.STATES:
            assert abs(r["ratio"][key] - 1) <= footprint.STATE_RTOL, (r["rank"], key, r)
        assert abs(r["ratio"]["activations"] - 1) <= footprint.ACTIVATION_RTOL, r
        total = sum(r[k] for k in footprint.KEYS) / sum(r["formula"].values())
        assert abs(total - 1) <= footprint.TOTAL_RTOL, (r["rank"], total)


def test_zero_divides_optimizer_state_and_gradients_by_dp_cp():
    layout = (3, 1, 2, 1)
    got = {z: ls.run(footprint.measure, layout, zero=z, world_size=6, backend="gloo",
                     **SIZES) for z in (0, 1, 2)}
    for z, rows in got.items():
        for r in footprint.table(rows, layout, zero=z, **SIZES):
            for key in footprint.STATES:
                assert abs(r["ratio"][key] - 1) <= footprint.STATE_RTOL, (z, key, r)
    for plain, one, two in zip(got[0], got[1], got[2]):
        assert plain["params"] <= one["params"] <= plain["params"] + 3 * 4   # padding
        assert one["optimizer"] == pytest.approx(plain["optimizer"] / 3, rel=0.01)
        assert one["grads"] == plain["grads"] + (one["params"] - plain["params"])
        assert two["grads"] == pytest.approx(plain["grads"] / 3, rel=0.01)
        assert two["optimizer"] == one["optimizer"]
