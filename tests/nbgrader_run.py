"""Run nbgrader on one assignment's submissions, for the graders' slow tests.

    graded = autograde("rabenseifner_allreduce", {"reference": {}, "untouched": None, ...})
    scores(graded, "reference")      # {test cell: points}
    errors(graded, "untouched")      # {cell id: the error text nbgrader recorded}

A submission is a dict {grade_id of a solution cell: its source, or a
function that edits the reference's source}; cells it does not name keep the
reference's source; ``None`` is the untouched student version. Imports only what
nbgrader needs; the ranks never import it.

``RoundTrip`` is the one home of what every assignment's round trip checks: a
grading test file says what differs (``class TestNbgrader(RoundTrip)`` with its
submissions, cells, failed cells, totals, stubs and hidden text).
"""
import csv
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import nbformat
import pytest

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


def autograde(assignment: str, submissions: dict, course: Path, timeout=600,
              beside=()) -> dict:
    """generate_assignment, one notebook per submission, autograde, export.

    The students named in ``beside`` are autograded in a copy of the course
    (made after generate_assignment, so the same release and gradebook), by a
    second `nbgrader autograde` running at the same time as the first: a
    deadlocking submission spends most of its run waiting for its deadlines
    while the CPU idles. Only for an assignment whose grade reads no clock and
    no allocator: the two calls load the machine as a class hub would."""
    source = source_path(assignment)
    shutil.copytree(source.parent, course / "source" / assignment)
    # nbgrader runs `alembic` from PATH; the graded runs get a short deadline.
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               LABSUPPORT_GRADING_TIMEOUT=str(DEADLINE), PYTHONPATH=str(ROOT))
    nbgrader("generate_assignment", assignment, "--force", course=course, env=env)
    release = course / "release" / assignment / source.name
    unknown = set(beside) - set(submissions)
    assert not unknown, f"beside names no submission: {sorted(unknown)}"
    groups = {course: [s for s in submissions if s not in beside]}
    if beside:
        second = course.with_name(course.name + "-beside")
        shutil.copytree(course, second)
        groups[second] = list(beside)
    source_nb = nbformat.read(source, as_version=4)
    courses = {}
    for folder_course, students in groups.items():
        for student in students:
            folder = folder_course / "submitted" / student / assignment
            folder.mkdir(parents=True)
            nbformat.write(_submission(release, source_nb, submissions[student]),
                           folder / source.name)
            courses[student] = folder_course

    def grade(folder_course):
        nbgrader("autograde", assignment, "--force", course=folder_course, env=env,
                 timeout=timeout)

    def export(folder_course):
        nbgrader("export", f"--to={folder_course / 'grades.csv'}", course=folder_course,
                 env=env)

    with ThreadPoolExecutor(len(groups)) as pool:
        t0 = time.monotonic()
        list(pool.map(grade, groups))  # list(): a failed call raises here
        seconds = time.monotonic() - t0
        list(pool.map(export, groups))
    split = " beside ".join(str(len(students)) for students in groups.values())
    print(f"nbgrader autograde of {len(submissions)} submissions ({split}) "
          f"took {seconds:.1f} s")
    return dict(assignment=assignment, course=course, courses=courses, env=env,
                release=release, autograde_s=seconds, name=source.name)


def scores(graded: dict, student: str, cells) -> dict:
    from nbgrader.api import Gradebook
    os.environ["PATH"] = graded["env"]["PATH"]  # Gradebook runs `alembic` too
    a = graded["assignment"]
    with Gradebook(f"sqlite:///{graded['courses'][student] / 'gradebook.db'}") as gb:
        return {name: gb.find_grade(name, a, a, student).score for name in cells}


def autograded(graded: dict, student: str):
    a = graded["assignment"]
    course = graded["courses"][student]
    return nbformat.read(course / "autograded" / student / a / graded["name"], 4)


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
    rows = {}
    for course in set(graded["courses"].values()):
        with open(course / "grades.csv", newline="") as f:
            rows.update((row["student_id"], row) for row in csv.DictReader(f))
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


# -- the round trip's tests, one home for every assignment ---------------------------

class RoundTrip:
    """nbgrader's generate_assignment, autograde and export on one assignment, once per
    test class, and what every assignment's round trip checks. A grading test file says
    what differs::

        class TestNbgrader(RoundTrip):
            assignment, submissions = ASSIGNMENT, SUBMISSIONS
            cells, failed = CELLS, FAILED
            totals = {"reference": 10, "untouched": 0, ...}
            stubs, hidden = 2, ("sizes=(10, 13)",)

    and may add tests of its own that take the ``graded`` fixture.
    """
    assignment: str
    submissions: dict  # student -> {grade_id: source or edit}, None: untouched
    cells: dict        # test cell grade_id -> its points
    failed: dict       # student -> {test cell that scores zero: what its message says}
    totals: dict       # student -> the exported score
    stubs: int         # `raise NotImplementedError()` left in the student version
    hidden: tuple = ()         # source text the student version must not hold
    try_cell: str | None = None  # the ungraded try-out cell's id, if checked
    try_fails: tuple = ()      # the students whose try-out cell errs
    deadlocked: tuple = ()     # TimedRoundTrip: the "deadlock" student's cells that end
    max_autograde_s: float | None = None  # at the deadline; a bound on the autograde
    timeout = 600              # s, of each nbgrader call
    beside = ()                # students autograded beside the others (autograde's)

    @pytest.fixture(scope="class")
    @classmethod
    def graded(cls, tmp_path_factory):
        course = tmp_path_factory.mktemp("course")
        return autograde(cls.assignment, cls.submissions, course, timeout=cls.timeout,
                         beside=cls.beside)

    def pytest_generate_tests(self, metafunc):
        if "student" in metafunc.fixturenames:
            metafunc.parametrize("student", list(self.submissions))

    @pytest.mark.slow
    def test_the_student_version_has_stubs_and_no_hidden_tests(self, graded):
        release = assert_release_only(graded)
        for text in self.hidden:
            assert text not in release, f"the student version holds {text!r}"
        assert release.count("raise NotImplementedError()") == self.stubs

    @pytest.mark.slow
    def test_exported_grades_are_the_expected_totals(self, graded):
        assert set(self.failed) == set(self.submissions) == set(self.totals)
        assert_exported_totals(graded, self.cells, self.failed, self.totals)

    @pytest.mark.slow
    def test_each_test_cell_scores_as_expected_with_a_helpful_message(self, graded,
                                                                      student):
        errs = assert_cell_scores(graded, student, self.cells, self.failed)
        if self.try_cell is not None:
            erred = errs[self.try_cell] != ""
            assert erred == (student in self.try_fails), (self.try_cell, erred)


class TimedRoundTrip(RoundTrip):
    """A round trip whose "deadlock" student is also timed: each of its cells named in
    ``deadlocked`` ends at the deadline (not at nbgrader's 600 s per cell), and the
    whole autograde within ``max_autograde_s`` when given."""

    @pytest.mark.slow
    def test_a_deadlock_ends_each_cell_at_the_deadline(self, graded):
        seconds = cell_seconds(autograded(graded, "deadlock"))
        for cell_id in self.deadlocked:  # nbgrader alone waits 600 s (nbgrader_config)
            took = seconds[cell_id]
            assert DEADLINE <= took < DEADLINE + 20, (cell_id, took)
        if self.max_autograde_s is not None:
            assert graded["autograde_s"] < self.max_autograde_s
