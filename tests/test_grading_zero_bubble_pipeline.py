# Run: .venv/bin/python -m pytest \
#   tests/test_grading_zero_bubble_pipeline.py   (~1 min; -m "not slow": ~15 s)
"""Assignment 3 (the zero-bubble schedule ZB-H1): its checks, then the real nbgrader pipeline.

Layer 1 (unit): ``labsupport.grading.zero_bubble_pipeline`` on the
reference (read from the source notebook: ``sources.reference``) and on
each plausible wrong B, W and schedule, with the message each gets; the
ideal machine against the paper's numbers; the idle fraction of given
orders (ZB-H1, 1F1B, W at once, wrong dependencies) played in units, and
what the ranks record. Layer 4 (slow): `nbgrader
generate_assignment`, `autograde` and `export` on five submissions whose
scores, per test cell and in the exported CSV, are known.
"""
import inspect
import time

import pytest

import grading_zero_bubble_pipeline_cases as fns
import sources
from failing import fails, stopped_as_a_stall
from labsupport import timeline
from labsupport.grading import zero_bubble_pipeline as gz
from labsupport.pipeline import pipeline
from labsupport.pipeline import sim as pipeline_sim
from nbgrader_run import TimedRoundTrip, autograded, cell_seconds

ASSIGNMENT = "zero_bubble_pipeline"
ref = sources.reference(ASSIGNMENT)
SHORT = 3.0  # s, deadline of the unit tests that deadlock on purpose



# -- layer 1: the ideal machine and the checks ------------------------------------------

@pytest.mark.parametrize("p, m", [(2, 4), (4, 4), (4, 8), (3, 6), (8, 16), (4, 5)])
def test_zb_h1_takes_3m_plus_p_minus_1_units_and_holds_min_p_m(p, m):
    """Qi et al.: bubble (p-1)(F+B-W) = p-1 units when F = B = W = 1 (m >= p)."""
    events = gz.ideal_events(ref.train_step_zb_h1, p, m)
    assert max(e["end"] for e in events) == 3 * m + p - 1 == gz.zb_h1_units(p, m)
    assert timeline.bubble(events)["fraction"] == pytest.approx((p - 1) / (3 * m + p - 1))
    for rank, ops in enumerate(gz.orders(ref.train_step_zb_h1, p, m)):
        held = [sum((k == "F") - (k == "W") for k, _, _ in ops[:j + 1]) for j in range(len(ops))]
        assert max(held) == min(p, m), rank


def test_the_reference_passes_every_check():
    gz.check_backward_split(ref.backward_input, ref.backward_weight)
    gz.check_schedule_order(ref.train_step_zb_h1, cases=gz.CASES + ((4, 5), (8, 16)))
    gz.check_memory(ref.train_step_zb_h1)
    gz.check_schedule_grads(ref.train_step_zb_h1)
    gz.check_schedule_grads(ref.train_step_zb_h1, ref.backward_input, ref.backward_weight)


def test_fewer_micro_batches_than_stages_are_refused():
    with pytest.raises(ValueError, match="m >= p"):
        gz.check_schedule_order(ref.train_step_zb_h1, cases=((4, 2),))


# -- the idle fraction: recorded orders played in units (F = B = W = 1) ---------------

def messages(ops, fused=False) -> dict:
    """The messages each call of a pipeline waits for, written out: F(s, i) the
    output of F(s-1, i), B(s, i) the dL/dx of B(s+1, i) (of W(s+1, i) when the
    backward is fused: the harness sends dL/dx after both halves)."""
    p, after_b = len(ops), "W" if fused else "B"
    return {(k, s, i): [("F", s - 1, i)] if k == "F" and s > 0
            else [(after_b, s + 1, i)] if k == "B" and s < p - 1 else []
            for rank in ops for k, s, i in rank}


def order(schedule, p, m):
    return pipeline_sim.orders(schedule, p, m, split=True)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 5), (8, 16), (3, 7)])
def test_the_zb_h1_order_idles_p_minus_1_units_of_3m_plus_p_minus_1(p, m):
    ops = order(ref.train_step_zb_h1, p, m)
    events = gz.logical_events(ops, messages(ops))
    assert max(e["end"] for e in events) == 3 * m + p - 1
    row = gz.idle_fraction("train_step_zb_h1", ops, messages(ops), m)
    assert row["recorded"] == pytest.approx((p - 1) / (3 * m + p - 1))
    assert row["one_f_one_b"] == pytest.approx((p - 1) / (m + p - 1))
    assert row["limit"] == pytest.approx((row["one_f_one_b"] + row["recorded"]) / 2)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8)])
def test_1f1b_as_the_harness_records_it_idles_its_formula_and_fails(p, m):
    """pp.backward: B, W, then dL/dx sent; the previous stage waits for both halves."""
    ops = order(pipeline.train_step_1f1b, p, m)
    events = gz.logical_events(ops, messages(ops, fused=True))
    assert timeline.bubble(events)["fraction"] == pytest.approx((p - 1) / (m + p - 1))
    text = fails(gz.idle_fraction, "train_step_1f1b", ops, messages(ops, fused=True), m)
    assert f"idle {(p - 1) / (m + p - 1):.1%} of the step on p={p} ranks" in text


@pytest.mark.parametrize("p, m, idle", [(2, 4, 2 / 14), (4, 8, 0.2)])
def test_w_at_once_idles_more_than_the_limit(p, m, idle):
    ops = order(fns.train_step_w_at_once, p, m)
    assert timeline.bubble(gz.logical_events(ops, messages(ops)))["fraction"] == \
        pytest.approx(idle)
    text = fails(gz.idle_fraction, "train_step_w_at_once", ops, messages(ops), m)
    assert text.startswith(f"train_step_w_at_once left the ranks idle {idle:.1%} of "
                           f"the step on p={p} ranks with m={m}")
    assert "at least 50% of ZB-H1's saving" in text


def test_the_recorded_messages_are_what_is_played():
    """The right order, but rank 0's first B recorded waiting for the dL/dx of
    micro-batch 1: that B, and all after it, start later."""
    ops, m = order(ref.train_step_zb_h1, 2, 4), 4
    waits = messages(ops)
    waits["B", 0, 0] = [("B", 1, 1)]
    events = gz.logical_events(ops, waits)
    assert max(e["end"] for e in events) == 15
    assert "left the ranks idle 20.0% of the step" in fails(
        gz.idle_fraction, "late", ops, waits, m)


def test_orders_whose_dependencies_cannot_hold_deadlock_with_the_reason():
    ops, m = order(fns.train_step_w_before_b, 2, 4), 4
    text = fails(gz.idle_fraction, "train_step_w_before_b", ops, messages(ops), m)
    assert text.startswith("train_step_w_before_b deadlocks on p=2 ranks with m=4")
    assert "rank 0 calls W of micro-batch 0 before its B" in text
    ops = order(ref.train_step_zb_h1, 2, 4)
    waits = messages(ops)
    waits["F", 1, 0] = [("B", 0, 0)]  # rank 0's B waits for rank 1's: a cycle
    text = fails(gz.idle_fraction, "cycle", ops, waits, m)
    assert ("rank 0 at [B(stage 0, micro-batch 0)], "
            "rank 1 at [F(stage 1, micro-batch 0)]") in text


@pytest.mark.parametrize("schedule, fused", [("zb_h1", False), ("1f1b", True)])
def test_the_ranks_record_the_order_and_the_messages_as_they_ran(schedule, fused):
    fn = ref.train_step_zb_h1 if schedule == "zb_h1" else pipeline.train_step_1f1b
    ops, waits = gz.record(fn, 4, 8)
    assert ops == order(fn, 4, 8)
    assert waits == messages(ops, fused)


def test_the_idle_fraction_of_zb_h1_is_the_ideal_one_and_w_at_once_is_not_enough():
    rows = gz.check_idle_fraction(ref.train_step_zb_h1)
    assert [(r["p"], r["m"]) for r in rows] == list(gz.CASES)
    for r in rows:
        p, m = r["p"], r["m"]
        assert r["recorded"] == pytest.approx((p - 1) / (3 * m + p - 1))
        assert r["one_f_one_b"] == pytest.approx((p - 1) / (m + p - 1))
    text = fails(gz.check_idle_fraction, fns.train_step_w_at_once)
    assert text.startswith("train_step_w_at_once left the ranks idle 14.3% of the step "
                           "on p=2 ranks with m=4")
    assert "at least 50% of ZB-H1's saving" in text


def test_w_right_after_b_loses_the_order_saying_why():
    gz.check_schedule_grads(fns.train_step_w_at_once)
    gz.check_memory(fns.train_step_w_at_once)
    text = fails(gz.check_schedule_order, fns.train_step_w_at_once)
    assert text.startswith("train_step_w_at_once takes 14 time units on p=2 ranks with m=4 on "
                           "an ideal machine (F = B = W = 1 unit, free messages); ZB-H1 "
                           "takes 13 and 1F1B 15.")


def test_a_dropped_w_is_named_by_every_check():
    text = fails(gz.check_schedule_order, fns.train_step_w_dropped)
    assert "rank 1 must call F, B and W of its stage 1 once" in text
    assert "missing [W(stage 1, micro-batch 3)]" in text
    assert "A W that never runs is a weight gradient never computed" in text
    for check in (gz.check_memory, gz.check_idle_fraction):
        assert "missing [W(stage 1, micro-batch 3)]" in fails(check, fns.train_step_w_dropped)
    text = fails(gz.check_schedule_grads, fns.train_step_w_dropped)
    assert "differ from single-process training" in text
    assert "W never ran for rank 1: [W(stage 1, micro-batch 3)]" in text


def test_all_w_at_the_end_holds_too_much():
    text = fails(gz.check_memory, fns.train_step_w_at_end)
    assert text.startswith("train_step_w_at_end held up to [4, 4] micro-batches per rank "
                           "(ranks 0..1) on p=2 ranks with m=4")
    assert "1F1B holds at most min(p, m) = 2" in text


def test_w_before_its_b_is_explained_without_running():
    text = fails(gz.check_schedule_order, fns.train_step_w_before_b)
    assert "rank 0 calls W of micro-batch 0 before its B; rank 1 calls W of micro-batch 0 " \
           "before its B: W needs the dL/dz that B computes" in text


def test_a_deadlock_ends_at_the_deadline_with_the_ideal_machines_diagnosis():
    text = fails(gz.check_schedule_order, fns.train_step_mixed_up)
    assert text.startswith("train_step_mixed_up deadlocks on p=2 ranks with m=4")
    t0 = time.monotonic()
    text = fails(gz.check_schedule_grads, fns.train_step_mixed_up, timeout=SHORT)
    assert stopped_as_a_stall(text, time.monotonic() - t0, SHORT)
    assert text.startswith("train_step_mixed_up did not finish within 3 s on 2 ranks")
    assert "waited" in text and "dist.irecv" in text
    assert "On an ideal machine: train_step_mixed_up deadlocks" in text
    gz.check_schedule_grads(ref.train_step_zb_h1)  # the next check runs on fresh ranks


@pytest.mark.parametrize("weight_grad, message", [
    (fns.backward_weight_assigned, "differ from single-process training"),
    (fns.backward_weight_transposed, "differ from single-process training"),
    (fns.backward_weight_noop, "backward_weight_noop left every .grad of stage 0 unchanged"),
])
def test_a_wrong_w_fails_the_split_check(weight_grad, message):
    text = fails(gz.check_backward_split, ref.backward_input, weight_grad)
    assert message in text
    assert 'File "labsupport/' not in text


def test_a_b_without_the_layer_gradients_says_what_to_return():
    text = fails(gz.check_backward_split, fns.backward_input_no_dzs, ref.backward_weight)
    assert "backward_input_no_dzs must return (dx, dzs)" in text
    assert "one dL/dz per Linear layer" in text


# -- layer 4: nbgrader on assignment 3 ------------------------------------------------

def solution(fn, name=None) -> str:
    source = inspect.getsource(fn).strip()
    return source if name is None else source.replace(f"def {fn.__name__}(", f"def {name}(", 1)


SCHEDULE = "train_step_zb_h1"
SUBMISSIONS = {
    "reference": {},
    "untouched": None,
    "w_at_once": {SCHEDULE: solution(fns.train_step_w_at_once, SCHEDULE)},
    "w_dropped": {SCHEDULE: solution(fns.train_step_w_dropped, SCHEDULE)},
    "deadlock": {SCHEDULE: solution(fns.train_step_mixed_up, SCHEDULE)},
}
CELLS = {"test_backward_split": 3, "test_schedule_order": 2, "test_idle_fraction": 2,
         "test_memory": 1, "test_schedule_grads": 2}
SCHEDULE_CELLS = ("test_schedule_order", "test_idle_fraction", "test_memory",
                  "test_schedule_grads")
FAILED = {  # submission -> the test cells that score zero, and what their message says
    "reference": {},
    "untouched": {name: "NotImplementedError" for name in CELLS},
    "w_at_once": {"test_schedule_order": "ZB-H1 takes 13 and 1F1B 15",
                  "test_idle_fraction": "at least 50% of ZB-H1's saving"},
    "w_dropped": {**dict.fromkeys(SCHEDULE_CELLS, "missing [W(stage 1, micro-batch 3)]"),
                  "test_schedule_grads": "W never ran for rank 1"},
    "deadlock": {**dict.fromkeys(SCHEDULE_CELLS, "deadlocks on p=2 ranks with m=4"),
                 "test_schedule_grads": "did not finish within 4 s on 2 ranks"},
}


class TestNbgrader(TimedRoundTrip):
    assignment, submissions, cells, failed = ASSIGNMENT, SUBMISSIONS, CELLS, FAILED
    totals = {"reference": 10, "untouched": 0, "w_at_once": 6, "w_dropped": 3,
              "deadlock": 3}
    stubs, hidden = 3, ("(8, 16)",)
    try_cell, try_fails = "try-schedule", ("untouched", "w_dropped", "deadlock")
    deadlocked, max_autograde_s = ("test-schedule-grads",), 300
    # The deadlock waits for its deadlines beside the others (autograde's `beside`):
    # its idle fraction is the recorded schedule played in logical
    # units (pipeline.sim.play); no check reads a clock or the allocator.
    beside = ("deadlock",)

    @pytest.mark.slow
    def test_a_deadlock_ends_each_cell_at_the_deadline(self, graded):
        super().test_a_deadlock_ends_each_cell_at_the_deadline(graded)
        seconds = cell_seconds(autograded(graded, "deadlock"))
        # found on the ideal machine, not waited for
        assert seconds["test-schedule-order"] < 5
