# Run: .venv/bin/python -m pytest tests/test_your_turn_cells.py   (~3 s)
"""Every chapter's your-turn is a stub to write, and its solution is shown in no other cell.

A code cell tagged ``your-turn`` holds only definitions, and each function it
defines (a class's methods too) does nothing but ``raise ls.NotWritten(...)``
after its docstring: ``labsupport.your_turn`` then says "not written yet"
where the check runs. The solution lives in a cell tagged ``solution``
(collapsed in the book and in JupyterLab: test_notebooks.py); the body of each
function it defines must be in no other code cell, your-turn cells included,
with names consistently renamed and comments, strings and layout ignored
(``sources.copied``, as tests/test_no_answers.py does for the graded
assignments). Bodies shorter than ``MIN_TOKENS`` tokens are too short to tell.
"""
import ast
import re

import nbformat
import pytest

import sources
from nbtools import chapter_notebooks

NOTEBOOKS = chapter_notebooks()
MIN_TOKENS = 8


def tagged(cell, tag) -> bool:
    return tag in cell.metadata.get("tags", [])


def _functions(tree):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _body(node) -> list:
    """The function's statements after its docstring."""
    first = node.body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
        and isinstance(first.value.value, str)
    return node.body[1:] if docstring else node.body


def _raises_not_written(statements) -> bool:
    if len(statements) != 1 or not isinstance(statements[0], ast.Raise):
        return False
    exc = statements[0].exc
    func = exc.func if isinstance(exc, ast.Call) else exc
    return isinstance(func, ast.Attribute) and func.attr == "NotWritten" \
        and isinstance(func.value, ast.Name) and func.value.id == "ls"


def stub_problems(code: str) -> list[str]:
    """What makes ``code`` more than a your-turn stub ([] when it is one)."""
    tree = ast.parse(code)
    problems = [f"line {n.lineno} is not a definition" for n in tree.body
                if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    functions = _functions(tree)
    problems += [f"{f.name} does not only raise ls.NotWritten" for f in functions
                 if not _raises_not_written(_body(f))]
    return problems + ([] if functions else ["it defines no function"])


def bodies(code: str) -> list[tuple[str, str]]:
    """(name, source of its body) of each function ``code`` defines."""
    lines = code.splitlines()
    return [(f.name, "\n".join(lines[body[0].lineno - 1:body[-1].end_lineno]))
            for f in _functions(ast.parse(code)) if (body := _body(f))]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_each_your_turn_cell_holds_a_stub_that_raises_not_written(path):
    cells = nbformat.read(path, as_version=4).cells
    found = [f"cell {i}: {problem}" for i, c in enumerate(cells) if tagged(c, "your-turn")
             for problem in stub_problems(c.source)]
    assert not found, (
        f"{path.name}: " + "; ".join(found) + ". A your-turn cell holds what the reader "
        "writes, each function's body `raise ls.NotWritten(\"<name>\")`; the solution goes "
        "in the collapsed cell tagged solution.")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_each_your_turn_check_says_not_written_in_the_stored_outputs(path):
    """The stored outputs (a real run) show the check of each stub saying so,
    which a run with the solution pasted into the stub would not."""
    cells = nbformat.read(path, as_version=4).cells
    said = "".join(o.get("text", "") for c in cells if c.cell_type == "code"
                   for o in c.outputs if o.get("output_type") == "stream")
    # A check stops at the first stub it meets: one of the cell's names is enough.
    silent = [f"cell {i}: {' or '.join(names)}" for i, c in enumerate(cells)
              if tagged(c, "your-turn")
              for names in [re.findall(r'NotWritten\(\s*"(\w+)"', c.source)]
              if not any(f"{name} is not written yet" in said for name in names)]
    assert not silent, (f"{path.name}: no stored check output says these are not written "
                        f"yet: {'; '.join(silent)}. Re-execute the chapter with the stubs.")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_no_solution_body_is_in_a_visible_cell(path):
    cells = nbformat.read(path, as_version=4).cells
    visible = [(j, c) for j, c in enumerate(cells)
               if c.cell_type == "code" and not tagged(c, "solution")]
    found = [f"the body of {name} (solution, cell {i}) is in cell {j}"
             + (" (your-turn)" if tagged(c, "your-turn") else "")
             for i, s in enumerate(cells) if tagged(s, "solution")
             for name, body in bodies(s.source) if len(sources.tokens(body)) >= MIN_TOKENS
             for j, c in visible if sources.copied(body, c.source)]
    assert not found, (
        f"{path.name}: " + "; ".join(found) + ": a reader sees the solution without "
        "opening it. Leave the stub in the your-turn cell, the solution in its collapsed "
        "cell only.")


def test_the_checks_tell_a_stub_from_a_solution():
    stub = 'def f(x):\n    """Doc."""\n    raise ls.NotWritten("f")\n'
    solution = 'def f(x):\n    """Doc."""\n    y = x * 2 + 1\n    return y - x\n'
    assert stub_problems(stub) == []
    assert stub_problems(solution) == ["f does not only raise ls.NotWritten"]
    assert stub_problems(stub + "f(1)\n") == ["line 4 is not a definition"]
    (name, body), = bodies(solution)
    assert sources.copied(body, solution.replace("x", "z").replace("y", "w"))
    assert not sources.copied(body, stub)
