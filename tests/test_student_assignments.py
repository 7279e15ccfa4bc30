# Run: .venv/bin/python -m pytest tests/test_student_assignments.py
#   (~30 s: nbgrader per assignment)
"""make student-assignments gives a learner every assignment without its solution.

The script runs nbgrader's generate_assignment in a scratch course; each notebook
it writes must hold no solution region of its source (renamed or not: the
logic of test_no_answers), keep its visible checks, and leave the instructors'
course directory untouched.
"""
import subprocess
import sys

import nbformat
import pytest

import sources
from test_no_answers import looked_for

SCRIPT = sources.ROOT / "scripts" / "student_assignments.py"
COURSE = sources.ROOT / "notebooks" / "assignments"

pytestmark = pytest.mark.slow  # nbgrader once per assignment: scheduled early (conftest.py)


def course_state() -> set:
    return {str(p.relative_to(COURSE)) for p in COURSE.rglob("*") if "source" not in p.parts}


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("student")
    before = course_state()
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out)], cwd=sources.ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert course_state() == before, "the instructors' course directory changed"
    return out


@pytest.mark.parametrize("assignment", sources.assignments())
def test_the_student_version_has_no_solution_and_keeps_its_checks(student_dir, assignment):
    path = student_dir / assignment / f"{assignment}.ipynb"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    nb = nbformat.read(path, as_version=4)
    text = path.read_text()
    assert "### BEGIN SOLUTION" not in text and "### BEGIN HIDDEN TESTS" not in text
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "raise NotImplementedError" in code
    units = looked_for(sources.solution_regions(sources.source_path(assignment)))
    leaked = [what for what, codes in units if all(sources.copied(c, code) for c in codes)]
    assert not leaked, f"the student version holds the solution of {leaked}"
    visible = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")]
    assert visible, "no test cell left for the learner to run"


def test_an_edited_notebook_is_kept(student_dir):
    name = sources.assignments()[0]
    path = student_dir / name / f"{name}.ipynb"
    path.write_text(path.read_text().replace("NotImplementedError", "NotImplementedError  # mine"))
    proc = subprocess.run([sys.executable, str(SCRIPT), str(student_dir), name],
                          cwd=sources.ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "kept" in proc.stdout
    assert "# mine" in path.read_text()


def test_an_unknown_assignment_is_named():
    proc = subprocess.run([sys.executable, str(SCRIPT), "/tmp/unused", "no_such_thing"],
                          cwd=sources.ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "no such assignment: no_such_thing" in proc.stderr
