"""Checks of assignment 3: the zero-bubble pipeline schedule ZB-H1 (Qi et al., arXiv 2401.10241).

    from labsupport.grading import zero_bubble_pipeline as gz
    gz.check_backward_split(backward_input, backward_weight)  # B, W: single-process grads
    gz.check_schedule_order(train_step_zb_h1)   # ideal machine (F = B = W = 1): 3m + p - 1
    gz.check_idle_fraction(train_step_zb_h1)    # its order as it ran, in units: idle
                                                # well below 1F1B's
    gz.check_memory(train_step_zb_h1)           # micro-batches held per rank <= 1F1B's peak
    gz.check_schedule_grads(train_step_zb_h1, backward_input, backward_weight)

Each check that runs ranks goes through ``labsupport.grading.run`` (a
deadline; a deadlock is explained); the schedule-level checks play the
schedule on an ideal machine in the kernel (``labsupport.pipeline.sim``
with the backward split into B and W). The yardstick is ZB-H1's length
there, 3m + p - 1 units for m >= p (the paper's (p-1)(F+B-W) bubble), not
a reference schedule: none ships with the course. The idle fraction is the
schedule's as it ran on the ranks: the harness records each rank's calls in
order and the messages each waited for, and ``logical_events`` plays that
record in units, so no clock (and no load) enters a grade. Every failure is
an AssertionError that says what to change. The harness (F, B and W on
chapter 5's messages) is ``labsupport.pipeline.zero_bubble``.
"""
import torch
import torch.nn.functional as F

from labsupport import models, timeline
from labsupport.checking import collective_checks
from labsupport.checking.diagnosis import name_of
from labsupport.launch.session import current
from labsupport.pipeline import pipeline
from labsupport.pipeline import sim as pipeline_sim
from labsupport.pipeline import zero_bubble as zb

CASES = ((2, 4), (4, 8))  # (p, m) of the checks
SHARE = 0.5  # of ZB-H1's saving over 1F1B that the recorded order must show
# Units of the logical clock: F = B = W, as Qi et al. count them in their
# handcrafted schedules (arXiv 2401.10241, Sec. 2); 1F1B's backward is B + W.
COST = {"F": 1, "B": 1, "W": 1}


def zb_h1_units(p, m) -> int:
    """ZB-H1's step on the ideal machine, F = B = W = 1 unit: 3m compute + p - 1 bubble."""
    if m < p:
        raise ValueError(f"the checks use m >= p micro-batches (got p={p}, m={m}): "
                         "there ZB-H1 takes 3m + p - 1 units")
    return 3 * m + p - 1


def orders(schedule, p, m) -> list[list[tuple]]:
    """Each rank's calls; AssertionError unless each F, B, W of its stage runs once."""
    try:
        return pipeline_sim.orders(schedule, p, m, split=True)
    except ValueError as bad:
        if not isinstance(bad, pipeline_sim.IncompleteSchedule):
            raise
        dropped = [op for op in bad.missing if op[0] == "W"]
        raise AssertionError(
            f"{name_of(schedule)}: on p={p} ranks with m={m}, rank {bad.rank} must call F, B and "
            f"W of its stage {bad.rank} once for each micro-batch 0..{m - 1}: missing "
            f"{_ops(sorted(bad.missing, key=lambda op: (op[2], op[0])))}, repeated or "
            f"foreign {_ops(bad.extra)}."
            + (" A W that never runs is a weight gradient never computed: every B needs "
               "its W, later." if dropped else "")) from None


def ideal_events(schedule, p, m) -> list[dict]:
    """The schedule on an ideal machine: F = B = W = 1 time unit, free messages."""
    orders(schedule, p, m)  # complete, or say what is missing
    try:
        return pipeline_sim.ideal_events(schedule, p, m, t_f=1.0, t_b=1.0, t_w=1.0, split=True)
    except RuntimeError as stuck:
        if not hasattr(stuck, "stuck"):  # not pipeline_sim's deadlock
            raise
        raise AssertionError(_deadlock(name_of(schedule), p, m, stuck)) from None


def _deadlock(name, p, m, stuck) -> str:
    early = [f"rank {r} calls W of micro-batch {op[2]} before its B"
             for r, op in stuck.stuck.items()
             if op[0] == "W" and ("B", op[1], op[2]) in stuck.ops[r][stuck.ops[r].index(op):]]
    return (f"{name} deadlocks on p={p} ranks with m={m}: every rank waits for a "
            "call no rank will make (" + ", ".join(f"rank {r} at {_ops([op])}"
                                                   for r, op in stuck.stuck.items()) + ")."
            + (" " + "; ".join(early) + ": W needs the dL/dz that B computes." if early else ""))


def check_schedule_order(schedule, cases=CASES):
    """On the ideal machine the schedule is as short as ZB-H1: 3m + p - 1 units."""
    for p, m in cases:
        events = ideal_events(schedule, p, m)
        span = max(e["end"] for e in events)
        target = zb_h1_units(p, m)
        if span > target:
            raise AssertionError(
                f"{name_of(schedule)} takes {span:g} time units on p={p} ranks with m={m} on an "
                f"ideal machine (F = B = W = 1 unit, free messages); ZB-H1 takes {target:g} "
                f"and 1F1B {3 * (m + p - 1)}." + _late_b(events))


def _late_b(events) -> str:
    """Where a W ran while a B was ready: B is on the critical path, W is not."""
    for e in sorted(events, key=lambda e: e["start"]):
        if e["name"] != "W":
            continue
        r = e["rank"]
        later = [b for b in events if b["rank"] == r and b["name"] == "B"
                 and b["start"] > e["start"]]
        if later and _ready(events, min(later, key=lambda b: b["start"]), e["start"]):
            b = min(later, key=lambda b: b["start"])
            return (f" Rank {r} ran W of micro-batch {e['mb']} at t={e['start']:g} while B of "
                    f"micro-batch {b['mb']} could start; that B ran only at t={b['start']:g}. "
                    "B is on the critical path (rank "
                    f"{r - 1 if r else 'r-1'} waits for its dL/dx), W is on nobody's: run W "
                    "when the rank would otherwise wait, not before a B that is ready.")
    return (" Compare your order with ZB-H1's: rank r runs 1F1B's warm-up, then F and B, "
            "and starts its W's r steps late, so they fill the cool-down.")


def _ready(events, b, t) -> bool:
    ends = {(e["name"], e["stage"], e["mb"]): e["end"] for e in events}
    needs = pipeline_sim.needs(("B", b["stage"], b["mb"]), max(e["rank"] for e in events) + 1)
    return all(ends[d] <= t for d in needs)


def check_backward_split(input_grad, weight_grad, cases=CASES, *, timeout=None):
    """B and W in 1F1B order (B then W at once) give single-process loss and gradients."""
    for p, m in cases:
        name = f"{name_of(input_grad)} and {name_of(weight_grad)}"
        out = _run(name, zb.train_step_1f1b_split, (input_grad, weight_grad), p, m,
                   timeout)
        _assert_same(out, p, m, name)


def check_schedule_grads(schedule, input_grad=None, weight_grad=None, cases=CASES, *,
                         timeout=None):
    """The schedule, on the ranks, gives single-process loss and gradients (with the
    student's B and W when given, else with autograd's)."""
    fns = None if input_grad is None else (input_grad, weight_grad)
    for p, m in cases:
        out = _run(name_of(schedule), schedule, fns, p, m, timeout)
        _assert_same(out, p, m, name_of(schedule))


def check_memory(schedule, cases=CASES, *, timeout=None):
    """No rank holds more micro-batches (from F to W) than 1F1B's first rank: min(p, m)."""
    for p, m in cases:
        ideal_events(schedule, p, m)  # complete, no deadlock: else say so, without a run
        out = _run(name_of(schedule), schedule, None, p, m, timeout)
        peaks = [o["peak"] for o in out]
        if max(peaks) > min(p, m):
            raise AssertionError(
                f"{name_of(schedule)} held up to {peaks} micro-batches per rank "
                f"(ranks 0..{p - 1}) on p={p} ranks with m={m}: from its F until its W, a "
                f"micro-batch's activations stay alive. 1F1B holds at most min(p, m) = "
                f"{min(p, m)} (on rank 0); ZB-H1 holds as many on every rank and no more: "
                "start each rank's W's only as late as that bound allows.")


def check_idle_fraction(schedule, cases=CASES, *, share=SHARE,
                        timeout=None) -> list[dict]:
    """The idle fraction of the schedule as it ran shows at least ``share`` of
    ZB-H1's saving over 1F1B, in units of the logical clock.

    The schedule runs once on the ranks (autograd's B and W), which record
    each rank's calls in the order they ran and the messages each waited
    for (``record``); ``idle_fraction`` plays that record with F = B = W =
    1 unit and compares it with 1F1B and ZB-H1 on the same clock. No clock
    is read: an order that ran right scores the same on any machine under
    any load. Returns the numbers.
    """
    rows = []
    for p, m in cases:
        ideal_events(schedule, p, m)  # complete, no deadlock: else say so, without a run
        ops, waits = record(schedule, p, m, timeout=timeout)
        rows.append(idle_fraction(name_of(schedule), ops, waits, m, share=share))
    return rows


def idle_fraction(name, ops, waits, m, *, share=SHARE) -> dict:
    """The idle fraction of per-rank orders ``ops`` with ``waits`` (a run's
    ``record``) in units (``COST``), against its limit: 1F1B's on the same
    clock (chapter 5's ``pipeline.train_step_1f1b``, backward B + W = 2
    units: (p-1)/(m+p-1)) minus ``share`` of its distance to ZB-H1's,
    (p-1)/(3m+p-1). AssertionError above the limit; else the numbers."""
    p = len(ops)
    events = logical_events(ops, waits, name=name, m=m)
    ours = timeline.bubble(events)["fraction"]
    ref, ideal = one_f_one_b_idle(p, m), (p - 1) / zb_h1_units(p, m)
    limit = ref - share * (ref - ideal)
    if ours > limit:
        raise AssertionError(
            f"{name} left the ranks idle {ours:.1%} of the step on p={p} ranks with m={m} "
            "(each rank's calls in the order they ran, and the messages each waited "
            f"for, timed with F = B = W = 1 unit); 1F1B on the same clock {ref:.1%}, "
            f"ZB-H1 {ideal:.1%}. The check wants at most {limit:.1%}: at least "
            f"{share:.0%} of ZB-H1's saving." + _late_b(events))
    return dict(p=p, m=m, recorded=ours, one_f_one_b=ref, zb_h1_ideal=ideal, limit=limit)


def one_f_one_b_idle(p, m) -> float:
    """1F1B's idle fraction in units (F = 1, backward = B + W = 2): (p-1)/(m+p-1)."""
    events = pipeline_sim.ideal_events(pipeline.train_step_1f1b, p, m,
                                       t_f=COST["F"], t_b=COST["B"] + COST["W"])
    return timeline.bubble(events)["fraction"]


def record(schedule, p, m, *, timeout=None) -> tuple[list[list[tuple]], dict]:
    """One run of ``schedule`` on p ranks (autograd's B and W), as recorded:
    (each rank's calls in the order they ran, {call: the calls whose messages
    it received}); a message names the call whose result it carries."""
    out = _run(name_of(schedule), schedule, None, p, m, timeout)
    made = {key: op for o in out for key, op in o["made"].items()}
    waits = {op: [made[key] for key in keys]
             for o in out for op, keys in o["received"].items()}
    return [list(o["ran"]) for o in out], waits


def logical_events(ops, waits, *, name="the schedule", m=None) -> list[dict]:
    """The calls of ``ops`` (per rank, in order) played in units (``COST``): each
    after the calls in ``waits[call]`` (its messages) and its own stage's F
    before its B, B before its W. A deadlock is an AssertionError that says so."""
    p = len(ops)
    local = {op: [d for d in pipeline_sim.needs(op, p) if d[1] == op[1]]  # own stage
             for r in ops for op in r}
    deps = {op: list(waits.get(op, ())) + local[op] for op in local}
    try:
        return pipeline_sim.play(ops, {op: COST[op[0]] for op in local}, deps)
    except RuntimeError as stuck:
        if not hasattr(stuck, "stuck"):  # not pipeline_sim's deadlock
            raise
        m = m if m is not None else 1 + max(op[2] for op in local)
        raise AssertionError(_deadlock(name, p, m, stuck)) from None


# -- running, comparing ---------------------------------------------------------------

def _run(name, schedule, fns, p, m, timeout) -> list[dict]:
    try:
        calls = collective_checks.run(zb.Step(name, schedule, fns, m), world_size=p,
                            timeout=timeout)
        return [c["value"] for c in calls]
    except AssertionError as failure:
        if current() is not None:
            current().restart()  # posted receives of the failed step: gone
        problem = str(failure)
    if "did not finish" in problem:
        try:
            ideal_events(schedule, p, m)
        except AssertionError as why:
            problem += f"\nOn an ideal machine: {why}"
    raise AssertionError(problem)


def reference(m):
    """Single-process training on the whole batch: (loss, {name: gradient})."""
    model = models.DeepMLP(**zb.MODEL_KW)
    x, y = zb.data(m)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss.detach(), {n: q.grad for n, q in model.named_parameters()}


def _assert_same(out, p, m, what):
    loss, grads = reference(m)
    wrong = []
    for rank, o in enumerate(out):
        for name, grad in o["grads"].items():
            try:
                torch.testing.assert_close(grad, grads[name])
            except AssertionError:
                err = (grad - grads[name]).abs().max().item()
                zero = " (all zero)" if not grad.any() else ""
                wrong.append(f"{name} on rank {rank}: max error {err:.3g}{zero}, "
                             f"largest |grad| {grads[name].abs().max().item():.3g}")
    if wrong:
        raise AssertionError(
            f"after {what} on p={p} ranks with m={m}, {len(wrong)} of {len(grads)} gradients "
            "differ from single-process training on the whole batch: " + "; ".join(wrong[:3])
            + ". Each W adds dL/dW = dz^T h and dL/db = dz summed over the micro-batch into "
            ".grad (+=, the m micro-batches add up)." + _missing_w(out, m))
    torch.testing.assert_close(out[-1]["loss"], loss, msg=lambda text: f"the loss: {text}")


def _missing_w(out, m) -> str:
    missing = [f"rank {r}: {_ops(sorted(set(('W', r, i) for i in range(m)) - set(o['ran'])))}"
               for r, o in enumerate(out)
               if set(("W", r, i) for i in range(m)) - set(o["ran"])]
    return (" W never ran for " + "; ".join(missing) + ".") if missing else ""


def _ops(ops) -> str:
    return "[" + ", ".join(f"{k}(stage {s}, micro-batch {i})" for k, s, i in ops) + "]"
