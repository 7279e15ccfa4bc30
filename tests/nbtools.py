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
    nb.cells = [c for c in nb.cells
                if "papermill-error-cell-tag" not in c.metadata.get("tags", [])]
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
#
# The one marking: in a labsupport module, the lesson sits between
#     # --- lesson: notebooks/NN_chapter.ipynb (the notebook's copy must match) ---
#     # --- end of lesson ---
# (a module may have several such blocks). The notebook's copy of each name is
# the notebook's own last top-level definition of it, which is what the name
# holds once the notebook has run: a your-turn stub followed by its solution
# compares the solution.

LESSON_BLOCK = re.compile(r"^# --- lesson: (notebooks/\S+\.ipynb)[^\n]*---\n(.*?)"
                          r"^# --- end of lesson ---$", re.S | re.M)


def package_lessons(module) -> dict:
    """{notebook path: {name: source}} of the module's lesson blocks."""
    out = {}
    for notebook, body in LESSON_BLOCK.findall(Path(module.__file__).read_text()):
        found = out.setdefault(notebook, {})
        for name, source in definitions(body).items():
            assert name not in found, f"{module.__name__}: {name} is in two lesson blocks"
            found[name] = source
    assert out, f"{module.__file__} has no '# --- lesson: notebooks/...' block"
    return out


def notebook_definitions(notebook: Path) -> dict:
    """{name: source} of the last top-level def, class or single-name assignment of
    each name in the notebook's code cells (IPython magics and shell lines skipped)."""
    found = {}
    for cell in nbformat.read(notebook, as_version=4).cells:
        if cell.cell_type != "code" or cell.source.startswith("%%"):
            continue
        source = "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                           for line in cell.source.splitlines())
        found.update(definitions(source, strict=False))
    return found


def lesson_differences(module, root: Path = ROOT) -> list[str]:
    """What differs between the module's lesson and the notebook it names ([] if nothing)."""
    problems = []
    for notebook, package in package_lessons(module).items():
        if not (root / notebook).exists():
            problems.append(f"{module.__name__}'s lesson names {notebook}, which does not exist")
            continue
        in_notebook = notebook_definitions(root / notebook)
        for name, source in package.items():
            if name not in in_notebook:
                problems.append(f"{notebook} does not define {name}")
            elif in_notebook[name] != source:
                problems.append(f"{name} differs between {notebook} and {module.__file__}")
    return problems


def assert_lesson_copy(module):
    """The notebook's copy of every lesson name of ``module`` is the package's, character
    for character: edit both together (or copy the changed one over)."""
    problems = lesson_differences(module)
    assert not problems, "\n".join(problems)


def definitions(source, strict=True) -> dict:
    """{name: its full source lines} of each top-level def, class (decorators
    included) or assignment to one name; with ``strict``, anything else is an
    error (a lesson block holds nothing else)."""
    lines = source.splitlines()
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            name = node.name
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        elif (isinstance(node, (ast.Assign, ast.AnnAssign))
              and isinstance(target := (node.targets[0] if isinstance(node, ast.Assign)
                                        else node.target), ast.Name)
              and not (isinstance(node, ast.Assign) and len(node.targets) > 1)):
            name, first = target.id, node.lineno
        elif strict:
            raise AssertionError(f"line {node.lineno}: a lesson holds defs, classes and "
                                 f"assignments only, not {type(node).__name__}")
        else:
            continue
        assert not strict or name not in found, f"{name} is defined twice"
        found.pop(name, None)  # the last definition, at its place in the order
        found[name] = "\n".join(lines[first - 1:node.end_lineno])
    return found
