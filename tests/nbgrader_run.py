"""Run nbgrader on one assignment's submissions, for the graders' slow tests.

    graded = autograde("rabenseifner_allreduce", {"reference": {}, "untouched": None, ...})
    scores(graded, "reference")      # {test cell: points}
    errors(graded, "untouched")      # {cell id: the error text nbgrader recorded}

A submission is a dict {grade_id of a solution cell: its source, or a
function that edits the reference's source}; cells it does not name keep the
reference's source; ``None`` is the untouched student version. Imports only what nbgrader needs; the ranks never import it.
"""
import csv
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import nbformat

import sources
from sources import source_path

ROOT = Path(__file__).resolve().parent.parent
DEADLINE = 4  # s, LABSUPPORT_GRADING_TIMEOUT of the autograde runs
MIN_LINES = 5  # a solution region this long must not reach the release (test_no_answers too)


def nbgrader(*args, course: Path, timeout=300, env=None):
    """One nbgrader command, run from the repository root so that it reads nbgrader_config.py."""
    cmd = [sys.executable, "-m", "nbgrader", *args, f"--CourseDirectory.root={course}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, \
        f"nbgrader {' '.join(args)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-5000:]}"
    return proc


def _submission(release: Path, source_nb, cells):
    nb = nbformat.read(release, as_version=4)
    if cells is None:
        return nb
    reference = {c.metadata["nbgrader"]["grade_id"]: c.source for c in source_nb.cells}
    for c in nb.cells:
        gid = c.metadata.get("nbgrader", {}).get("grade_id")
        if c.metadata.get("nbgrader", {}).get("solution"):
            c.source = sources.edited(reference[gid], cells.get(gid))
    return nb


def autograde(assignment: str, submissions: dict, course: Path, timeout=600) -> dict:
    """generate_assignment, one notebook per submission, autograde, export."""
    source = source_path(assignment)
    shutil.copytree(source.parent, course / "source" / assignment)
    # nbgrader runs `alembic` from PATH; the graded runs get a short deadline.
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               LABSUPPORT_GRADING_TIMEOUT=str(DEADLINE), PYTHONPATH=str(ROOT))
    nbgrader("generate_assignment", assignment, "--force", course=course, env=env)
    release = course / "release" / assignment / source.name
    source_nb = nbformat.read(source, as_version=4)
    for student, cells in submissions.items():
        folder = course / "submitted" / student / assignment
        folder.mkdir(parents=True)
        nbformat.write(_submission(release, source_nb, cells), folder / source.name)
    t0 = time.monotonic()
    nbgrader("autograde", assignment, "--force", course=course, env=env, timeout=timeout)
    seconds = time.monotonic() - t0
    print(f"nbgrader autograde of {len(submissions)} submissions took {seconds:.1f} s")
    nbgrader("export", f"--to={course / 'grades.csv'}", course=course, env=env)
    return dict(assignment=assignment, course=course, env=env, release=release,
                autograde_s=seconds, name=source.name)


def scores(graded: dict, student: str, cells) -> dict:
    from nbgrader.api import Gradebook
    os.environ["PATH"] = graded["env"]["PATH"]  # Gradebook runs `alembic` too
    a = graded["assignment"]
    with Gradebook(f"sqlite:///{graded['course'] / 'gradebook.db'}") as gb:
        return {name: gb.find_grade(name, a, a, student).score for name in cells}


def autograded(graded: dict, student: str):
    a = graded["assignment"]
    return nbformat.read(graded["course"] / "autograded" / student / a / graded["name"], 4)


def errors(graded: dict, student: str) -> dict:
    """{cell id: the error text of that cell, '' when it ran}."""
    return {c.id: "\n".join("\n".join(o.traceback) for o in c.outputs
                            if o.output_type == "error")
            for c in autograded(graded, student).cells if c.cell_type == "code"}


def cell_seconds(nb) -> dict:
    """{cell id: seconds it ran}, from the timestamps nbclient records in cell metadata."""
    seconds = {}
    for c in nb.cells:
        stamps = c.metadata.get("execution", {})
        if "iopub.execute_input" in stamps and "shell.execute_reply" in stamps:
            start, end = (datetime.fromisoformat(stamps[key].replace("Z", "+00:00"))
                          for key in ("iopub.execute_input", "shell.execute_reply"))
            seconds[c.id] = (end - start).total_seconds()
    return seconds


# -- what every assignment's grading test checks ------------------------------------------

def assert_release_only(graded: dict) -> str:
    """release/<assignment>/ holds the student notebook only, with no solution region of
    the source (names renamed or not) and no hidden test; returns the notebook's text."""
    folder = graded["release"].parent
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert files == [graded["name"]], f"release/{graded['assignment']}/ holds {files}"
    text = graded["release"].read_text()
    assert "### BEGIN SOLUTION" not in text and "HIDDEN TESTS" not in text
    code = "\n".join(c.source for c in nbformat.read(graded["release"], as_version=4).cells
                     if c.cell_type == "code")
    leaked = [gid for gid, region in sources.solution_regions(source_path(graded["assignment"]))
              if sources.code_lines(region) >= MIN_LINES and sources.copied(region, code)]
    assert not leaked, f"the release notebook holds the solution of {leaked}"
    return text


def assert_exported_totals(graded: dict, cells: dict, failed: dict, expected: dict):
    """grades.csv (`nbgrader export`) gives each submission the points of the cells it
    passed (``failed[student]`` names those it fails), which are ``expected``, out of all
    the cells' points."""
    with open(graded["course"] / "grades.csv", newline="") as f:
        rows = {row["student_id"]: row for row in csv.DictReader(f)}
    totals = {s: sum(p for c, p in cells.items() if c not in failed[s]) for s in failed}
    assert totals == expected, "the table of failed cells and the expected totals disagree"
    exported = {s: float(rows[s]["score"]) for s in failed}
    assert exported == expected, f"exported {exported}, expected {expected}"
    assert {float(rows[s]["max_score"]) for s in failed} == {sum(cells.values())}


def assert_cell_scores(graded: dict, student: str, cells: dict, failed: dict) -> dict:
    """Each graded cell scores 0 where ``failed[student]`` names it, and its error then
    contains the message named there; full points elsewhere. Returns the cells' errors."""
    got = scores(graded, student, cells)
    want = {name: 0 if name in failed[student] else points for name, points in cells.items()}
    assert got == want, f"{student}: scored {got}, expected {want}"
    errs = errors(graded, student)
    for name, message in failed[student].items():
        text = errs[name.replace("_", "-")]
        assert message in text, f"{name}:\n{text}"
    return errs
