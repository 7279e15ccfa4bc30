# Run: .venv/bin/python -m pytest tests/test_workers.py   (~10 s: two small runs of pytest)
"""`make test` runs the suite on two workers without building a shared fixture twice.

tests/conftest.py makes a file one unit of work (its module- and class-scoped
fixtures, such as a round trip's autograde, are built on one worker only) and
each chapter's execution its own unit, with the slow units first. These tests
run a small suite with that conftest and the Makefile's options.
"""
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ROUND_TRIP = '''
import os, pytest

class TestNbgrader:
    @pytest.fixture(scope="class")
    def graded(self):
        with open(os.environ["BUILDS"], "a") as f:
            f.write(os.environ.get("PYTEST_XDIST_WORKER", "-") + "\\n")
        return 1

    @pytest.mark.parametrize("student", ["reference", "untouched", "deadlock", "world"])
    def test_cell_scores(self, graded, student):
        pass

    def test_totals(self, graded):
        pass
'''

NOTEBOOKS = '''
import os, pytest

@pytest.mark.parametrize("path", ["00_a", "01_b", "02_c", "03_d"])
def test_chapter_matches_its_stored_outputs(path):
    with open(os.environ["RAN"], "a") as f:
        f.write(f"{path} {os.environ.get('PYTEST_XDIST_WORKER', '-')}\\n")
'''


def make_options() -> list[str]:
    """TEST_WORKERS of the Makefile, as `make test` passes them to pytest."""
    text = (ROOT / "Makefile").read_text()
    line = re.search(r"^TEST_WORKERS \?= (.*)$", text, re.M)
    assert line, "the Makefile sets TEST_WORKERS"
    assert "$(TEST_WORKERS)" in text.split("\ntest:")[1].split("\n\n")[0]
    return line.group(1).split()


def run(tmp_path, options):
    suite = tmp_path / "tests"
    suite.mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", suite / "conftest.py")
    (suite / "test_grading_x.py").write_text(ROUND_TRIP)
    (suite / "test_notebooks.py").write_text(NOTEBOOKS)
    (suite / "test_plain.py").write_text("def test_one(): pass\ndef test_two(): pass\n")
    env = {"BUILDS": str(tmp_path / "builds"), "RAN": str(tmp_path / "ran"),
           "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *options, str(suite)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return (tmp_path / "builds").read_text().split(), (tmp_path / "ran").read_text().split("\n")


def test_a_class_fixture_is_built_once_and_chapters_spread_over_both_workers(tmp_path):
    builds, ran = run(tmp_path, make_options())
    assert len(builds) == 1, f"the round trip's fixture was built {len(builds)} times: {builds}"
    workers = {line.split()[1] for line in ran if line}
    assert workers == {"gw0", "gw1"}, f"the chapters ran on {workers} only"


def test_without_xdist_a_file_keeps_its_order_and_chapters_go_first(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", str(ROOT / "tests" / "test_workers.py"),
                           str(ROOT / "tests" / "test_notebooks.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    first_own = next(i for i, line in enumerate(ids) if "test_workers.py" in line)
    chapters = [i for i, line in enumerate(ids) if "stored_outputs[" in line]
    assert chapters and max(chapters) < first_own, "a chapter's execution is not first"
    own = [line.split("::")[1] for line in ids if "test_workers.py" in line]
    assert own == ["test_a_class_fixture_is_built_once_and_chapters_spread_over_both_workers",
                   "test_without_xdist_a_file_keeps_its_order_and_chapters_go_first"]
