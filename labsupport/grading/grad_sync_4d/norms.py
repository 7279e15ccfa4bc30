"""What is wrong with a student's global gradient norm (assignment 9, part 3).

``norm_problem`` compares every rank's norm of every step with one process's
``clip_grad_norm_`` and, when step 0's differs, reads it as one of the classic
mistakes (``capstone.clip``'s list, with the tied weight): summed over dp x cp
too, the parameters replicated over tp counted tp times, the tied weight
counted twice, the squared norm, or a norm not summed over pp or tp (it then
differs between those ranks). The candidates are computed from the
one-process gradients and the layout; nothing here reads a clock.
"""
import math

from labsupport.capstone.layout import Layout
from labsupport.grading.grad_sync_4d.config import TIED
from labsupport.grading.grad_sync_4d.diagnose import losses_problem

NORM_RTOL = 1e-4      # a norm of fp32 sums in another order


def norm_problem(outs, ref, layout) -> str | None:
    """None if every rank's norm of every step is one process's (``ref["norms"]``,
    clip_grad_norm_'s) and the clipped run's losses are the clipped reference's."""
    layout = Layout(*layout)
    whole = ref["norms"][0]
    got = {o["rank"]: o["norms"][0] for o in outs}
    wrong = {r: v for r, v in got.items() if not _near(v, whole)}
    if wrong:
        return (f"at step 0 your norm is {_values(got)} where one process's "
                f"clip_grad_norm_ computes {whole:.6g} (the 2-norm of the whole model's "
                f"gradient, the tied weight once). {_norm_reading(got, whole, outs, ref, layout)}")
    for k, want in enumerate(ref["norms"]):
        off = [o["rank"] for o in outs if not _near(o["norms"][k], want)]
        if off:
            return (f"your norm is right at step 0 but at step {k} rank {off[0]} has "
                    f"{outs[off[0]]['norms'][k]:.6g} where one process has {want:.6g}: "
                    "compute it from the gradients of each step")
    return losses_problem(outs, ref)


def _near(v, want) -> bool:
    return abs(v - want) <= NORM_RTOL * abs(want)


def _values(got) -> str:
    values = sorted(set(f"{v:.6g}" for v in got.values()))
    if len(values) == 1:
        return values[0]
    return "different on different ranks (" + ", ".join(
        f"rank {r}: {v:.6g}" for r, v in sorted(got.items())[:6]) + ")"


def _norm_reading(got, whole, outs, ref, layout) -> str:
    """Which classic mistake the norms at step 0 are (capstone.clip's WRONG, tied)."""
    grads = ref["grads"]
    squares = {n: g.square().sum().item() for n, g in grads.items()}
    tp_split = {n for o in outs for n, s in o["shards"].items() if s is not None}
    replicated = sum(v for n, v in squares.items() if n not in tp_split)
    dp_cp, tp, pp = layout.dp * layout.cp, layout.tp, layout.pp
    readings = []
    if dp_cp > 1:
        readings.append((whole * math.sqrt(dp_cp), (
            f"sqrt(dp·cp) = sqrt({dp_cp}) times too large: summed over dp x cp too. "
            "After the sync every rank of a dp x cp group holds the same averaged "
            "gradient: sum the squares over tp and pp only")))
    if tp > 1:
        readings.append((math.sqrt(whole ** 2 + (tp - 1) * replicated), (
            f"the parameters replicated over tp counted tp = {tp} times: every tp rank "
            "holds the LayerNorms, the row-parallel biases and the position embedding "
            "whole; count them on one tp rank")))
    if pp > 1:
        readings.append((math.sqrt(whole ** 2 + squares[TIED]), (
            "the tied weight counted twice: its copies on the first and the last stage "
            "are one weight of the one-process model; count it on one stage")))
    if tp > 1 and pp > 1:
        readings.append((math.sqrt(whole ** 2 + (tp - 1) * replicated + squares[TIED]), (
            f"the tied weight counted twice and the parameters replicated over tp "
            f"counted tp = {tp} times: count each on one rank")))
    readings.append((whole ** 2, "the squared norm: take its square root"))
    if len({round(v, 4) for v in got.values()}) == 1:
        v = next(iter(got.values()))
        for value, text in readings:
            if _near(v, value):
                return f"It is {text}."
        return f"It is {v / whole:.4g} times the one-process norm."
    coords = {r: layout.coords(r) for r in got}
    for axis, group in (("pp", "groups['pp']"), ("tp", "groups['tp']")):
        by_rest = {}
        for r, v in got.items():
            key = tuple(x for a, x in zip(coords[r]._fields, coords[r]) if a != axis)
            by_rest.setdefault(key, set()).add(round(v, 4))
        if any(len(values) > 1 for values in by_rest.values()):
            return (f"It differs across the {axis} ranks: each holds different entries "
                    f"of the model's gradient, so the sum of squares must be summed over "
                    f"{group} before the square root, and every rank return the same norm.")
    return "Every rank must return the same norm, the whole model's."
