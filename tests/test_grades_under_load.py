# Run: .venv/bin/python -m pytest tests/test_grades_under_load.py   (~3 min; loads every core)
"""Grades are the same under load: graded three times while every core is busy.

A class hub is a loaded machine by definition. Here ``busy`` keeps as many
processes spinning as the machine has cores, and each round grades the
verdicts of ``grades_under_load.py`` (assignment 3's idle fraction,
assignments 4 and 5's memory: each reference and a wrong answer per check)
twice at once: in this process and in a second one beside it. Every round
and both processes must give the same verdicts (numbers and messages), and
the same as the values book/instructors.md states. Under the same load, a
deadlocked answer still ends at its deadline with its diagnosis, and the
reference is not called a deadlock (it passes within the grader's default
deadline, ``grading.diagnosis.TIMEOUT``, which only bounds a hang).
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import grading_zero_bubble_pipeline_cases as a3_cases
import grades_under_load
from labsupport.grading import zero_bubble_pipeline as g3

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
    # ... and they are the grades instructors.md states
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


def test_a_deadlock_still_ends_at_its_deadline_with_its_diagnosis_under_load(busy):
    deadline = 3.0
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as info:
        g3.check_schedule_grads(a3_cases.train_step_mixed_up, timeout=deadline)
    # the deadline fired (not the test's own timeout), within its grace under load
    assert time.monotonic() - t0 < deadline + 30
    text = str(info.value)
    assert text.startswith("train_step_mixed_up did not finish within 3 s on 2 ranks")
    assert "On an ideal machine: train_step_mixed_up deadlocks" in text


def test_the_reference_under_load_is_not_called_a_deadlock(busy):
    """The grader's default deadline (the one nbgrader's cells run with) holds the
    reference's checks that run ranks the longest while every core is busy: they pass."""
    import sources
    ref = sources.reference("zero_bubble_pipeline")
    g3.check_schedule_grads(ref.train_step_zb_h1)
    g3.check_schedule_grads(ref.train_step_zb_h1, ref.backward_input, ref.backward_weight)
