# Run: .venv/bin/python -m pytest tests/test_grading_zero_bubble_pipeline.py   (~3 min; -m "not slow": ~1 min)
"""Assignment 3 (the zero-bubble schedule ZB-H1): its checks, then the real nbgrader pipeline.

Layer 1 (unit): ``labsupport.grading.zero_bubble_pipeline`` on the
reference (read from the source notebook: ``sources.reference``) and on
each plausible wrong B, W and schedule, with the message each gets; the
ideal machine against the paper's numbers. Layer 4 (slow): `nbgrader
generate_assignment`, `autograde` and `export` on five submissions whose
scores, per test cell and in the exported CSV, are known.
"""
import inspect
import time

import pytest

from labsupport import timeline
from labsupport.grading import zero_bubble_pipeline as gz
import grading_zero_bubble_pipeline_cases as fns
import sources
from nbgrader_run import TimedRoundTrip, autograded, cell_seconds

ASSIGNMENT = "zero_bubble_pipeline"
ref = sources.reference(ASSIGNMENT)
SHORT = 3.0  # s, deadline of the unit tests that deadlock on purpose


def fails(check, *args, **kwargs) -> str:
    with pytest.raises(AssertionError) as info:
        check(*args, **kwargs)
    return str(info.value)


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


def test_the_idle_fraction_of_zb_h1_is_below_1f1b_and_w_at_once_is_not_enough():
    rows = gz.check_idle_fraction(ref.train_step_zb_h1)
    for row in rows:  # measured under load on 2 shared cores: printed, not asserted
        print(f"p={row['p']} m={row['m']}: ZB-H1 {row['measured']:.3f}, 1F1B "
              f"{row['one_f_one_b']:.3f}, limit {row['limit']:.3f}, ideal "
              f"{row['zb_h1_ideal']:.3f}")
    text = fails(gz.check_idle_fraction, fns.train_step_w_at_once)
    assert text.startswith("train_step_w_at_once left the ranks idle ")
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
    assert time.monotonic() - t0 < SHORT + 15
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
    # One autograde after another (no `beside`): its idle fraction reads the clock.

    @pytest.mark.slow
    def test_a_deadlock_ends_each_cell_at_the_deadline(self, graded):
        super().test_a_deadlock_ends_each_cell_at_the_deadline(graded)
        seconds = cell_seconds(autograded(graded, "deadlock"))
        # found on the ideal machine, not waited for
        assert seconds["test-schedule-order"] < 5
