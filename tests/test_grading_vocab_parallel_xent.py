# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest \
#   tests/test_grading_vocab_parallel_xent.py
# (add -m "not slow" for the checks alone, ~10 s)
"""Graded assignment 2 (vocab-parallel cross-entropy): its grader's checks, then nbgrader.

Layer 1 (unit): each check of labsupport.grading.vocab_parallel_xent passes the
reference (the source notebook's, ``sources.reference``) and fails each plausible
wrong answer with the message that says what to fix; a deadlock ends at the
deadline. Layer 4 (slow): `nbgrader generate_assignment`, `autograde` and
`export` on the assignment in a temporary course directory, with six
submissions whose scores, per test cell and in the exported CSV, are known.
"""
import inspect
import time

import pytest

import grading_vocab_parallel_xent_cases as cases
import labsupport.grading.vocab_parallel_xent as gx
import sources
from failing import fails, stopped_as_a_stall
from nbgrader_run import RoundTrip

ASSIGNMENT = "vocab_parallel_xent"
REFERENCE = sources.reference(ASSIGNMENT).VocabParallelCrossEntropy
SHORT = 3.0   # s, deadline of the unit test that deadlocks on purpose



# -- layer 1: the checks ----------------------------------------------------------------

def test_the_reference_passes_every_check():
    gx.check_forward(REFERENCE)
    gx.check_forward(REFERENCE, scale=1e4)
    gx.check_backward(REFERENCE)
    gx.check_no_gather(REFERENCE)


def test_no_max_subtraction_fails_on_large_logits_only():
    gx.check_forward(cases.NoMax, world_sizes=(2,))
    text = fails(gx.check_forward, cases.NoMax, world_sizes=(2,), scale=1e4)
    assert text.startswith("on 2 ranks, rank 0 (logits of size about 10000): the loss is ")
    assert "subtract each row's maximum over the WHOLE vocabulary" in text


def test_gathering_the_logits_is_right_but_fails_the_bytes_check():
    gx.check_backward(cases.Gathered, world_sizes=(4,))
    text = fails(gx.check_no_gather, cases.Gathered)
    assert text.startswith("on 4 ranks, rank 0 sent ")
    assert "its logits are 65,536 bytes (32 tokens x 512 entries)" in text
    assert "Gathering the logits moves O(b s V) bytes" in text


def test_a_wrong_target_gradient_says_who_subtracts_the_one():
    gx.check_forward(cases.WrongTarget, world_sizes=(2,))
    text = fails(gx.check_backward, cases.WrongTarget, world_sizes=(2,))
    assert "only the rank that owns the target subtracts the 1" in text


def test_ignoring_grad_output_is_named():
    text = fails(gx.check_backward, cases.NoGradOutput, world_sizes=(2,))
    assert text == "on 2 ranks, rank 0: logits.grad is 1/3 of the right one: multiply by " \
                   "the incoming gradient (grad_output) of the loss"


def test_a_deadlock_ends_at_the_deadline_then_the_next_check_passes():
    t0 = time.monotonic()
    text = fails(gx.check_forward, cases.Deadlock, world_sizes=(2,), timeout=SHORT)
    assert stopped_as_a_stall(text, time.monotonic() - t0, SHORT)
    assert "did not finish within 3 s on 2 ranks" in text
    gx.check_forward(REFERENCE, world_sizes=(2,))


def test_an_unwritten_solution_says_where_to_write():
    text = fails(gx.check_forward, cases.NotWritten, world_sizes=(2,))
    assert text.endswith("Write your solution in place of `raise NotImplementedError()`.")


def test_a_function_instead_of_the_class_is_refused():
    with pytest.raises(TypeError, match="pass the class"):
        gx.check_forward(lambda logits, targets, group: 0)


# -- layer 4: nbgrader on assignment 2 ------------------------------------------------

def pasted(cls) -> str:
    """The case's source under the assignment's class name."""
    source = inspect.getsource(cls)
    first = source.splitlines()[0]
    return source.replace(first, "class VocabParallelCrossEntropy(torch.autograd.Function):", 1)


XENT = "vocab_parallel_xent"  # grade_id of the solution cell
SUBMISSIONS = {"reference": {}, "untouched": None,
               "no_max": {XENT: pasted(cases.NoMax)},
               "gathered": {XENT: pasted(cases.Gathered)},
               "wrong_target": {XENT: pasted(cases.WrongTarget)},
               "deadlock": {XENT: pasted(cases.Deadlock)}}
CELLS = {"test_forward": 3, "test_forward_large_logits": 2, "test_backward": 3,
         "test_no_gather": 2}
FAILED = {  # submission -> the test cells that score zero, and what their message says
    "reference": {},
    "untouched": {name: "in place of `raise NotImplementedError()`" for name in CELLS},
    "no_max": {"test_forward_large_logits": "subtract each row's maximum"},
    "gathered": {"test_no_gather": "Gathering the logits moves O(b s V) bytes"},
    "wrong_target": {"test_backward": "only the rank that owns the target subtracts the 1"},
    "deadlock": {name: "did not finish within 4 s" for name in CELLS},
}


class TestNbgrader(RoundTrip):
    assignment, submissions, cells, failed = ASSIGNMENT, SUBMISSIONS, CELLS, FAILED
    totals = {"reference": 10, "untouched": 0, "no_max": 8, "gathered": 8,
              "wrong_target": 7, "deadlock": 0}
    stubs, hidden = 2, ("ReduceOp.MAX, group=group",)
    # The deadlock waits for its deadlines beside the others (autograde's `beside`):
    # these checks count bytes and compare values;
    # none reads a clock or the allocator.
    beside = ("deadlock",)
