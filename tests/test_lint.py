# Run: .venv/bin/python -m pytest tests/test_lint.py   (~2 s)
"""The house rules a linter can keep: ruff, pinned in requirements.txt and configured in
pyproject.toml ([tool.ruff]: the rule set, the line length, and why each exception), over
the package, the tests, the scripts, the deployment and the chapters' code cells.

A failure prints ruff's own report; ``.venv/bin/ruff check --fix`` mends the safe ones
(import order, unused imports), the rest are for the author to fix.
"""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["labsupport", "tests", "scripts", "deploy", "notebooks"]


def ruff(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_the_installed_ruff_is_the_pinned_one():
    pinned = re.search(r"^ruff==(\S+)", (ROOT / "requirements.txt").read_text(), re.M)
    assert pinned, "requirements.txt pins no ruff"
    assert ruff("--version").stdout.split() == ["ruff", pinned.group(1)], "run make env"


def test_ruff_passes_over_the_code_and_the_chapters():
    proc = ruff("check", "--no-cache", *PATHS)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_finds_what_it_looks_for(tmp_path):
    """The project's configuration on a made-up file: each rule family can fail."""
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nimport os\n\n\n"
                   "def f(xs=[]):\n"
                   "    return [lambda: x for x in xs]\n\n\n"
                   f"y = '{'x' * 100}'\n")
    proc = ruff("check", "--no-cache", "--config", str(ROOT / "pyproject.toml"),
                "--output-format", "concise", str(bad), cwd=tmp_path)
    found = set(re.findall(r": ([A-Z]+\d+) ", proc.stdout))
    assert {"I001", "F401", "B006", "B023", "E501"} <= found, proc.stdout
