# Run: flock /tmp/heavy.lock .venv/bin/python -m pytest tests/test_capstone_native.py
"""labsupport.capstone.native: the capstone's training from PyTorch's own pieces
(DeviceMesh, FSDP2, DTensor TP + SP, pipelining's 1F1B) trains as the
hand-composed trainer and as one process, and torch's context_parallel still
does not run on a CPU (the claim native's docstring makes).

Parity: fp32, the same global batches, every step's loss within
``compare.LOSS_RTOL`` of ``trainer.reference`` (one process, ``models.GPT``)
and of ``trainer.train`` at the same layout; float64 leaves only rounding.
The layouts of one world size run in one launch, one after the other.
"""
import math
import sys

import cloudpickle
import pytest
import torch

import labsupport as ls
from labsupport import models
from labsupport.capstone import compare, model, native, trainer
from labsupport.capstone.compare import LOSS_RTOL

cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS = 3
GRAD_TOL = 1e-5       # as tests/test_capstone.py: of each parameter's largest entry
LAYOUTS = {2: [(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)],
           8: [(2, 2, 2, 1)]}


def _both(layouts, steps, **kw):
    """On every rank: {layout: (native's result, the hand trainer's)}."""
    return {layout: (native.train(layout, steps, record_grads=(0,), **kw),
                     trainer.train(layout, steps, **kw))
            for layout in layouts}


@pytest.fixture(scope="module")
def reference():
    return trainer.reference(STEPS, record_grads=(0,))


@pytest.fixture(scope="module")
def runs():
    out = {}
    for world, layouts in LAYOUTS.items():
        by_rank = ls.run(_both, layouts, STEPS, world_size=world, backend="gloo")
        for layout in layouts:
            out[layout] = [r[layout] for r in by_rank]
    return out


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("layout", [lay for group in LAYOUTS.values() for lay in group],
                         ids=lambda lay: "x".join(map(str, lay)))
def test_native_trains_as_the_hand_composed_trainer_and_one_process(layout, runs,
                                                                    reference):
    ref = reference["losses"]
    outs = runs[layout]
    nat = outs[0][0]["losses"]
    # gradients too: AdamW's step hardly changes if a gradient is off by a factor
    p = compare.parity([n for n, _ in outs], reference)
    assert p["grad_rel"] <= GRAD_TOL and p["step0_rel"] <= 1e-6, p
    assert {k for n, _ in outs for k in n["grads"][0]} == set(reference["grads"][0])
    assert len({tuple(n["losses"]) for n, _ in outs}) == 1      # every rank reports it
    assert len(nat) == STEPS and ref[-1] < ref[0]
    assert _rel(nat, ref) <= LOSS_RTOL, (nat, ref)
    assert _rel(nat, outs[0][1]["losses"]) <= LOSS_RTOL, (nat, outs[0][1]["losses"])
    assert all(n["tokens_per_s"] > 0 for n, _ in outs)
    # each dimension is torch's piece, not a no-op
    dp, tp, pp, cp = layout
    for n, _ in outs:
        p = n["parts"]
        assert p["schedule"] == "Schedule1F1B"
        assert (p["fsdp_units"] > 0) == (dp * cp > 1), p
        assert (p["tp_sharded"] > 0) == (tp > 1), p
        assert (p["ring_attentions"] > 0) == (cp > 1), p
    held = [n["parts"]["params"] for n, _ in outs
            if n["coords"][0] == n["coords"][2] == n["coords"][3] == 0]
    whole = models.GPT(model.config(seq_len=32))
    assert sum(held) == len(list(whole.parameters()))            # split by pp


def _variants(layout, steps):
    return (native.train(layout, steps, dtype=torch.float64),
            native.train(layout, steps, sequence_parallel=False, record_grads=(0,)))


def test_native_in_float64_leaves_only_rounding_and_runs_without_sp(reference):
    layout = (1, 2, 1, 2)                      # tp and cp together, in one launch
    outs = ls.run(_variants, layout, STEPS, world_size=math.prod(layout),
                  backend="gloo")
    ref = trainer.reference(STEPS, dtype=torch.float64)["losses"]
    assert _rel(outs[0][0]["losses"], ref) <= 1e-12
    p = compare.parity([o[1] for o in outs], reference)        # without SP, fp32
    assert p["grad_rel"] <= GRAD_TOL and p["curve_rel"] <= LOSS_RTOL, p


def test_torch_context_parallel_still_raises_on_cpu_as_the_docstring_says():
    errors = ls.run(native.context_parallel_error, world_size=2, backend="gloo")
    line = errors[0]
    assert line is not None, "context_parallel ran on CPU: use it and update native.py"
    assert line.startswith("NotImplementedError: Operator aten._scaled_dot_"), line
    assert line in " ".join(native.__doc__.split()), line


def test_step_time_ratio_reports_both_trainers_speeds():
    # what it measures depends on the machine: only its form is checked here
    r = native.step_time_ratio((2, 1, 1, 1), steps=2, repeats=1)
    assert r["layout"] == (2, 1, 1, 1) and len(r["runs"]["hand"]) == 1
    assert r["ratio"] == pytest.approx(r["native_tokens_per_s"]
                                      / r["hand_tokens_per_s"])
    assert r["hand_tokens_per_s"] > 0 and r["native_tokens_per_s"] > 0


def _calls_both(layout, steps):
    """On every rank: the collectives of the last step, hand ZeRO-2 and FSDP2."""
    hand = trainer.train(layout, steps, zero=2, record_timeline=True)
    nat = native.train(layout, steps, record_calls=True)
    return (native.collectives(hand["timeline"]["calls"]), native.collectives(nat["calls"]),
            hand["losses"], nat["losses"], nat["parts"]["fsdp_units"])


def test_hand_zero2_and_fsdp2_move_the_same_bytes_per_step():
    layout = (2, 1, 2, 1)           # dp and pp only: every collective goes through dist
    outs = ls.run(_calls_both, layout, 2, world_size=4, backend="gloo")
    for hand, nat, hand_losses, nat_losses, units in outs:
        assert _rel(nat_losses, hand_losses) <= LOSS_RTOL
        # one all-gather and one reduce-scatter of the stage a step on both sides:
        # one flat buffer by hand, one per FSDP2 unit (blocks and the rest)
        assert hand["all_gather_single"][0] == hand["reduce_scatter_single"][0] == 1
        assert nat["all_gather_single"][0] == nat["reduce_scatter_single"][0] == units
        for op in ("all_gather_single", "reduce_scatter_single"):
            assert nat[op][1] <= hand[op][1] <= nat[op][1] + 4 * 2 * units   # padding
        assert hand.get("all_reduce", (0, 0))[1] <= 4    # the loss's mean, no gradient
