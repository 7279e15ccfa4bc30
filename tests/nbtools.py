"""Helpers for the notebook tests: papermill with small parameters, nbval in a child pytest.

Each chapter declares its small parameters in its notebook metadata:
    "metadata": {"labsupport": {"small_parameters": {"WORLD_SIZE": 2, ...}}}
"""
import ast
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import papermill

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
# make test-gpu adds the masks of GPU-only outputs (scripts/test_gpu.sh)
SANITIZE = Path(os.environ.get("LABSUPPORT_NBVAL_SANITIZE", ROOT / "tests" / "nbval_sanitize.cfg"))


def chapter_notebooks() -> list[Path]:
    """Every chapter notebook (assignments have their own grading tests)."""
    return sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))


def small_parameters(path: Path) -> dict:
    nb = nbformat.read(path, as_version=4)
    return nb.metadata.get("labsupport", {}).get("small_parameters", {})


def run_papermill(path: Path, out_dir: Path, parameters: dict):
    """Execute a copy of the notebook with parameters; return the executed notebook.

    Papermill raises for any error output, even in a cell tagged
    ``raises-exception`` (which nbclient, nbval and the book honour); so its
    error is caught here and the executed notebook is returned for the caller
    to check with ``error_outputs``, which does honour the tag.
    """
    out = out_dir / path.name
    try:
        papermill.execute_notebook(str(path), str(out), parameters=parameters,
                                   kernel_name="python3", cwd=str(path.parent), progress_bar=False)
    except papermill.PapermillExecutionError:
        pass
    nb = nbformat.read(out, as_version=4)
    nb.cells = [c for c in nb.cells if "papermill-error-cell-tag" not in c.metadata.get("tags", [])]
    return nb


def error_outputs(nb) -> list:
    """Errors of cells that are not tagged raises-exception."""
    return [o for c in nb.cells if c.cell_type == "code"
            and "raises-exception" not in c.metadata.get("tags", [])
            for o in c.get("outputs", []) if o.output_type == "error"]


def run_nbval(paths, junit: Path) -> int:
    """nbval in a child pytest, as a user would run it; returns its exit code."""
    cmd = [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"),
           "-p", "no:cacheprovider", "--nbval", "--nbval-current-env",
           "--nbval-sanitize-with", str(SANITIZE), f"--junitxml={junit}",
           "-o", "junit_family=xunit1",  # xunit1 records each case's file
           *map(str, paths)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    return proc.returncode


def failures_by_file(junit: Path) -> dict:
    """{notebook file name: [names of failed cells]} from a junit report."""
    failed = {}
    for case in ET.parse(junit).iter("testcase"):
        file = Path(case.get("file") or case.get("classname")).name
        bad = case.find("failure") is not None or case.find("error") is not None
        failed.setdefault(file, [])
        if bad:
            failed[file].append(case.get("name"))
    return failed


# -- the notebook's copy of the lesson is the package's ---------------------------

def package_lesson(module) -> str:
    """The module's source between `# --- lesson: ...` and `# --- end of lesson ---`."""
    source = Path(module.__file__).read_text()
    return re.search(r"# --- lesson:.*?\n(.*)# --- end of lesson ---", source, re.S).group(1)


def notebook_lesson(notebook: Path, tag: str) -> str:
    """The sources of the notebook's cells tagged `tag`, joined by blank lines."""
    nb = nbformat.read(notebook, as_version=4)
    cells = [c.source for c in nb.cells if tag in c.metadata.get("tags", [])]
    assert cells, f"no cell of {notebook.name} is tagged {tag!r}"
    return "\n\n".join(cells)


def definitions(source) -> dict:
    """{name: its full source lines} of each top-level def, class (decorators
    included) or assignment; anything else in a lesson is an error."""
    lines = source.splitlines()
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            name = node.name
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            name = (node.targets[0] if isinstance(node, ast.Assign) else node.target).id
            first = node.lineno
        else:
            raise AssertionError(f"line {node.lineno}: a lesson holds defs, classes and "
                                 f"assignments only, not {type(node).__name__}")
        assert name not in found, f"{name} is defined twice"
        found[name] = "\n".join(lines[first - 1:node.end_lineno])
    return found
