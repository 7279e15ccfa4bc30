# Run: .venv/bin/python -m pytest tests/test_grades_under_load.py   (~2 min; loads every core)
"""Grades are the same under load: graded three times while every core is busy.

A class hub is a loaded machine by definition. Here ``busy`` keeps as many
processes spinning as the machine has cores, and each round grades the
verdicts of ``grades_under_load.py`` (assignment 3's idle fraction,
assignments 4 and 5's memory: each reference and a wrong answer per check)
twice at once: in this process and in a second one beside it. Every round
and both processes must give the same verdicts (numbers and messages), and
the same as the values book/instructors.md states.

Under the same load, with a second grading kept running beside them
(``beside_grading``), the deadline (sized from the work:
``launch.limits.grading_deadline``, ``launch.progress``) still tells a
deadlock from a slow answer: a deadlocked answer ends within a bound with its
diagnosis; a right answer made slow (``Slow``: its last rank computes for
longer than the deadline, in its own CPU time, so a flat deadline of that
many seconds would have stopped it on any machine) gets every point, with
the same idle fraction as the reference; and the reference passes within
the grader's default deadline, ``checking.diagnosis.TIMEOUT``.
"""
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import grades_under_load
import grading_zero_bubble_pipeline_cases as a3_cases
from labsupport.grading import zero_bubble_pipeline as g3
from labsupport.launch.limits import GRADING_CEILING_FACTOR

pytestmark = pytest.mark.slow
ROUNDS = 3
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def busy():
    """As many spinning processes as cores, for the module's tests; all stopped after."""
    n = os.cpu_count() or 1
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(n)]
    try:
        yield n
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def grade_beside():
    """The same grading in a second process (its own ranks), started now."""
    return subprocess.Popen([sys.executable, str(HERE / "grades_under_load.py")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=HERE.parent)


@pytest.fixture(scope="module")
def beside_grading():
    """A second grading (grades_under_load.py, its own ranks) running beside the tests
    that use it: each starts once the one before has finished, the first is
    grading before the first such test starts, and the last is waited for after
    them. Every one must succeed, with the verdicts the book states."""
    finished, stop, grading = [], threading.Event(), threading.Event()

    def keep_grading():
        while not stop.is_set():
            p = grade_beside()
            for line in p.stderr:          # its imports done, it starts grading
                if line.startswith("grading"):
                    break
            grading.set()
            out, err = p.communicate()
            finished.append((p.returncode, out, err))

    thread = threading.Thread(target=keep_grading, daemon=True)
    thread.start()
    assert grading.wait(timeout=300), "the grading beside never started"
    yield finished
    stop.set()
    thread.join(timeout=600)
    assert finished
    for returncode, out, err in finished:
        assert returncode == 0, err[-3000:]
        assert_the_stated_verdicts(json.loads(out.splitlines()[-1]))


def assert_the_stated_verdicts(first: dict):
    """The grades book/instructors.md states."""
    idle = first["a3 reference idle"]["passed"]
    assert [row["recorded"] for row in idle] == pytest.approx([1 / 13, 3 / 27], abs=1e-12)
    assert first["a3 W at once idle"]["failed"].startswith(
        "train_step_w_at_once left the ranks idle 14.3% of the step")
    assert "passed" in first["a5 reference memory"]
    assert "passed" in first["a5 all_reduce memory"]      # it keeps its memory points
    assert "Each bucket's full buffer must go" in first["a5 keep_buffers memory"]["failed"]
    assert "passed" in first["a4 reference memory"]
    assert "840 B made during the steps are still held by your code" in \
        first["a4 keep_full_grads memory"]["failed"]


def test_every_round_and_the_grading_beside_it_give_the_same_verdicts(busy):
    rounds = []
    for _ in range(ROUNDS):
        beside = grade_beside()
        here = grades_under_load.verdicts()
        out, err = beside.communicate(timeout=600)
        assert beside.returncode == 0, err[-3000:]
        rounds += [here, json.loads(out.splitlines()[-1])]
    first = rounds[0]
    for i, other in enumerate(rounds[1:], 1):
        assert other == first, f"run {i} of {len(rounds)} differs: " + json.dumps(
            {k: (first[k], other.get(k)) for k in first if other.get(k) != first[k]})
    assert_the_stated_verdicts(first)   # ... and they are the grades instructors.md states


def test_a_deadlock_still_ends_at_its_deadline_with_its_diagnosis_under_load(
        busy, beside_grading):
    deadline = 3.0
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as info:
        g3.check_schedule_grads(a3_cases.train_step_mixed_up, timeout=deadline)
    # the deadline fired (not the test's own timeout): before the last-resort
    # ceiling; that it fired for the stall is asserted below, from its message
    assert time.monotonic() - t0 < GRADING_CEILING_FACTOR * deadline
    text = str(info.value)
    assert text.startswith("train_step_mixed_up did not finish within 3 s on 2 ranks")
    assert "On an ideal machine: train_step_mixed_up deadlocks" in text
    # stopped as a deadlock, for its ranks' waiting, not for the time the run took
    assert "(Stopped after 3 s in which every rank still running waited, using no " \
        "CPU time" in text


def test_a_slow_but_right_answer_under_load_gets_its_points(busy, beside_grading):
    """The reference schedule, its last rank computing 1.5 CPU seconds first (20 times
    the reference's work per run, 0.08 s): longer than the 1 s deadline given here
    on any machine, so a flat 1 s deadline would have called it a deadlock. Here
    it is graded like the reference: its gradients pass, its idle fraction
    (logical time) is the reference's. (Its CPU time stays under the 3 s budget,
    3 times the deadline, on any load: a starved rank accrues none.)"""
    import sources
    ref = sources.reference("zero_bubble_pipeline")
    slow = a3_cases.Slow(ref.train_step_zb_h1, seconds=1.5)
    g3.check_schedule_grads(slow, timeout=1.0)
    rows = g3.check_idle_fraction(slow, timeout=1.0)
    assert [row["recorded"] for row in rows] == \
        pytest.approx([1 / 13, 3 / 27], abs=1e-12)


def test_the_reference_under_load_is_not_called_a_deadlock(busy, beside_grading):
    """The grader's default deadline (the one nbgrader's cells run with) holds the
    reference's checks that run ranks the longest while every core is busy: they pass."""
    import sources
    ref = sources.reference("zero_bubble_pipeline")
    g3.check_schedule_grads(ref.train_step_zb_h1)
    g3.check_schedule_grads(ref.train_step_zb_h1, ref.backward_input, ref.backward_weight)
