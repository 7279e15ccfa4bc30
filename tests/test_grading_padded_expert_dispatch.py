# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_grading_padded_expert_dispatch.py   (add -m "not slow": the checks alone)
"""Assignment 7 (the capacity-padded expert-parallel dispatch): its checks, then nbgrader.

Layer 1 (unit): labsupport.grading.padded_expert_dispatch's checks pass the
padded dispatch and fail each plausible wrong one with the message that
tells the student what to fix (chapter 9's variable splits and an all-gather
are right but send the wrong bytes; a dropping rule by gate; detached gates;
a deadlock ends at the deadline; an untouched stub). Layer 4 (slow):
`nbgrader generate_assignment`, `autograde` and `export` on the assignment
with five submissions whose scores per test cell are known.
"""
import inspect
import time

import pytest

import grading_padded_dispatch_cases as cases
import labsupport.grading.padded_expert_dispatch as gp
from nbgrader_run import assert_cell_scores, assert_exported_totals, autograde

ASSIGNMENT = "padded_expert_dispatch"
SHORT = 3.0   # s, deadline of the unit test that deadlocks on purpose


def fails(check, fn, **kwargs) -> str:
    with pytest.raises(AssertionError) as info:
        check(fn, **kwargs)
    return str(info.value)


# -- layer 1: the checks ----------------------------------------------------------------

def test_the_padded_dispatch_passes_every_check():
    for check in (gp.check_forward, gp.check_drops, gp.check_backward, gp.check_padded_traffic):
        check(cases.padded)


def test_chapter_9s_variable_splits_are_right_but_not_padded():
    gp.check_drops(cases.variable_splits, world_sizes=(2,))
    text = fails(gp.check_padded_traffic, cases.variable_splits)
    assert text.startswith("variable_splits on 2 ranks, rank 0: forward and backward sent ")
    assert "the padded dispatch sends 65,536" in text
    assert "you sent only the routed rows (variable split sizes" in text


def test_gathering_every_token_is_right_but_sends_too_much():
    gp.check_backward(cases.gather_all, world_sizes=(2,))
    text = fails(gp.check_padded_traffic, cases.gather_all)
    assert "x too many: sending every token to every rank" in text


def test_a_dropping_rule_by_gate_fails_the_drops_only():
    gp.check_forward(cases.drop_by_prob, world_sizes=(2,))
    text = fails(gp.check_drops, cases.drop_by_prob, world_sizes=(2,))
    assert "the first in token order" not in text and "whatever their gates" in text


def test_detached_gates_leave_the_router_without_a_gradient():
    gp.check_forward(cases.detached_gates, world_sizes=(2,))
    text = fails(gp.check_backward, cases.detached_gates, world_sizes=(2,))
    assert "router.weight.grad is None after backward" in text
    assert "without detaching it" in text


def test_a_deadlock_ends_at_the_deadline_then_the_next_check_passes():
    t0 = time.monotonic()
    text = fails(gp.check_forward, cases.deadlock, world_sizes=(2,), timeout=SHORT)
    assert time.monotonic() - t0 < SHORT + 10
    assert "deadlock did not finish within 3 s on 2 ranks" in text
    gp.check_forward(cases.padded, world_sizes=(2,))


def test_an_unwritten_solution_says_where_to_write():
    text = fails(gp.check_forward, cases.not_written, world_sizes=(2,))
    assert text.startswith("not_written failed on 2 ranks")
    assert text.endswith("Write your solution in place of `raise NotImplementedError()`.")


def test_something_else_than_a_function_is_refused():
    with pytest.raises(TypeError, match="pass your function"):
        gp.check_forward("padded_moe")


# -- layer 4: nbgrader on assignment 7 ------------------------------------------------

def pasted(fn) -> str:
    """The case's source under the assignment's function name."""
    source = inspect.getsource(fn)
    return source.replace(f"def {fn.__name__}(", "def padded_moe(", 1)


SOLUTION = "padded_moe"  # grade_id of the solution cell
EARLY_RETURN = ("    ### BEGIN SOLUTION\n    if dist.get_rank() != 0:      # only rank 0 "
                "dispatches\n        return torch.zeros_like(x)\n")
SUBMISSIONS = {"reference": {}, "untouched": None,
               "variable_splits": {SOLUTION: pasted(cases.variable_splits)},
               "drop_by_prob": {SOLUTION: pasted(cases.drop_by_prob)},
               "deadlock": {SOLUTION: lambda src: src.replace("    ### BEGIN SOLUTION\n",
                                                              EARLY_RETURN, 1)}}
CELLS = {"test_forward": 3, "test_drops": 2, "test_backward": 3, "test_padded_traffic": 2}
FAILED = {  # submission -> the test cells that score zero, and what their message says
    "reference": {},
    "untouched": dict.fromkeys(CELLS, "in place of `raise NotImplementedError()`"),
    "variable_splits": {"test_padded_traffic": "you sent only the routed rows"},
    "drop_by_prob": {"test_drops": "whatever their gates"},
    "deadlock": dict.fromkeys(CELLS, "did not finish within 4 s"),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    return autograde(ASSIGNMENT, SUBMISSIONS, tmp_path_factory.mktemp("course"), timeout=500)


@pytest.mark.slow
def test_the_student_version_has_a_stub_and_no_solution(graded):
    release = graded["release"].read_text()
    assert "### BEGIN SOLUTION" not in release and "index_copy" not in release
    assert release.count("raise NotImplementedError()") == 1


@pytest.mark.slow
def test_exported_grades_are_the_expected_totals(graded):
    assert_exported_totals(graded, CELLS, FAILED, {
        "reference": 10, "untouched": 0, "variable_splits": 8, "drop_by_prob": 8,
        "deadlock": 0})


@pytest.mark.slow
@pytest.mark.parametrize("student", SUBMISSIONS)
def test_each_test_cell_scores_as_expected_with_a_helpful_message(graded, student):
    errs = assert_cell_scores(graded, student, CELLS, FAILED)
    assert (errs["try-padded"] != "") == (student in ("untouched", "deadlock"))
