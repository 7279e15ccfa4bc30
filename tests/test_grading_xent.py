# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_grading_xent.py
# (add -m "not slow" for the checks alone, ~10 s)
"""Graded assignment 2 (vocab-parallel cross-entropy): labsupport.grading.xent, then nbgrader.

Layer 1 (unit): each check passes the reference and fails each plausible
wrong answer with the message that says what to fix; a deadlock ends at the
deadline. Layer 4 (slow): `nbgrader generate_assignment`, `autograde` and
`export` on the assignment in a temporary course directory, with six
submissions whose scores, per test cell and in the exported CSV, are known.
"""
import csv
import inspect
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

import grading_xent_cases as cases
import labsupport.grading.xent as gx

ROOT = Path(__file__).resolve().parent.parent
ASSIGNMENT = "vocab_parallel_xent"
SOURCE = ROOT / "notebooks" / "assignments" / "source" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb"
DEADLINE = 4  # s, LABSUPPORT_GRADING_TIMEOUT of the autograde run below
SHORT = 3.0   # s, deadline of the unit test that deadlocks on purpose


def fails(check, cls, **kwargs) -> str:
    with pytest.raises(AssertionError) as info:
        check(cls, **kwargs)
    return str(info.value)


# -- layer 1: the checks ----------------------------------------------------------------

def test_the_reference_passes_every_check():
    gx.check_forward(cases.Reference)
    gx.check_forward(cases.Reference, scale=1e4)
    gx.check_backward(cases.Reference)
    gx.check_no_gather(cases.Reference)


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
    assert time.monotonic() - t0 < SHORT + 10
    assert "did not finish within 3 s on 2 ranks" in text
    gx.check_forward(cases.Reference, world_sizes=(2,))


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


SUBMISSIONS = {"reference": None, "untouched": "stub", "no_max": cases.NoMax,
               "gathered": cases.Gathered, "wrong_target": cases.WrongTarget,
               "deadlock": cases.Deadlock}
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


def nbgrader(*args, course: Path, timeout=300, env=None):
    """One nbgrader command, run from the repository root so that it reads nbgrader_config.py."""
    cmd = [sys.executable, "-m", "nbgrader", *args, f"--CourseDirectory.root={course}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, \
        f"nbgrader {' '.join(args)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-5000:]}"
    return proc


def submission(release: Path, source_nb, choice):
    nb = nbformat.read(release, as_version=4)
    reference = {c.metadata["nbgrader"]["grade_id"]: c.source for c in source_nb.cells}
    for c in nb.cells:
        if c.metadata.get("nbgrader", {}).get("grade_id") != "vocab_parallel_xent":
            continue
        if choice is None:
            c.source = reference["vocab_parallel_xent"]
        elif choice != "stub":
            c.source = pasted(choice)
    return nb


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    course = tmp_path_factory.mktemp("course")
    shutil.copytree(SOURCE.parent, course / "source" / ASSIGNMENT)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               LABSUPPORT_GRADING_TIMEOUT=str(DEADLINE),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    nbgrader("generate_assignment", ASSIGNMENT, "--force", course=course, env=env)
    release = course / "release" / ASSIGNMENT / SOURCE.name
    source_nb = nbformat.read(SOURCE, as_version=4)
    for student, choice in SUBMISSIONS.items():
        folder = course / "submitted" / student / ASSIGNMENT
        folder.mkdir(parents=True)
        nbformat.write(submission(release, source_nb, choice), folder / SOURCE.name)
    t0 = time.monotonic()
    nbgrader("autograde", ASSIGNMENT, "--force", course=course, env=env, timeout=600)
    print(f"nbgrader autograde of {len(SUBMISSIONS)} submissions took "
          f"{time.monotonic() - t0:.1f} s")
    nbgrader("export", f"--to={course / 'grades.csv'}", course=course, env=env)
    return dict(course=course, env=env, release=release)


@pytest.mark.slow
def test_the_student_version_has_stubs_and_no_solution(graded):
    release = graded["release"].read_text()
    assert "### BEGIN SOLUTION" not in release and "ReduceOp.MAX, group=group" not in release
    assert release.count("raise NotImplementedError()") == 2


@pytest.mark.slow
def test_exported_grades_are_the_expected_totals(graded):
    with open(graded["course"] / "grades.csv", newline="") as f:
        rows = {row["student_id"]: row for row in csv.DictReader(f)}
    expected = {s: sum(p for c, p in CELLS.items() if c not in FAILED[s]) for s in SUBMISSIONS}
    assert {s: float(rows[s]["score"]) for s in SUBMISSIONS} == expected
    assert expected == {"reference": 10, "untouched": 0, "no_max": 8, "gathered": 8,
                        "wrong_target": 7, "deadlock": 0}


@pytest.mark.slow
@pytest.mark.parametrize("student", SUBMISSIONS)
def test_each_test_cell_scores_as_expected_with_a_helpful_message(graded, student):
    from nbgrader.api import Gradebook
    os.environ["PATH"] = graded["env"]["PATH"]  # Gradebook runs `alembic` too
    with Gradebook(f"sqlite:///{graded['course'] / 'gradebook.db'}") as gb:
        scores = {name: gb.find_grade(name, ASSIGNMENT, ASSIGNMENT, student).score
                  for name in CELLS}
    assert scores == {name: 0 if name in FAILED[student] else points
                      for name, points in CELLS.items()}
    nb = nbformat.read(graded["course"] / "autograded" / student / ASSIGNMENT / SOURCE.name, 4)
    errors = {c.id: "\n".join("\n".join(o.traceback) for o in c.outputs
                              if o.output_type == "error")
              for c in nb.cells if c.cell_type == "code"}
    for name, message in FAILED[student].items():
        cell_id = name.replace("_", "-")
        assert message in errors[cell_id], f"{name}:\n{errors[cell_id]}"
