#!/usr/bin/env python3
"""Put each chapter's question first: the hook, then the parameters, then the imports.

A chapter used to open with "## Parameters" (a remark about the tests), the
tagged ``parameters`` cell and a wall of imports, and only then the section
that says why the chapter matters ("## Why: ...", chapter 5's "## The bubble
in one line"). This script moves cells, with their stored outputs, so that a
chapter reads

    title and question (markdown)
    the hook section, its code cells with the few imports they need
    "## Parameters" (a line for the learner), the tagged cell, the imports
    the rest of the chapter, unchanged

and takes the test-keeping remarks out of the lesson text: the sentence about
the tests under "## Parameters", and the "# Kept equal to ... by tests/..."
comment lines of code cells (tests/nbtools.py compares definitions, not
comments).

A hook code cell moves only if it can run before the parameters and the
imports: it reads no name of the parameters cell, and each module it needs is
bound by a one-line import of the imports cell, which moves into the hook cell
(``from m import a, b`` gives up just the name it needs). The first cell that
cannot move ends the hook; a markdown cell whose heading starts the next
section is split at that heading. Nothing else changes: no output, no other
source, no notebook metadata (papermill needs the tagged cell only before the
code that reads its names; nbval compares outputs cell by cell, in order).

Idempotent: a chapter already in this order is left as it is, byte for byte.
Usage: scripts/reorder_openings.py [notebook ...]   (default: every chapter)
       scripts/reorder_openings.py --check          (exit 1 if a chapter would change)
"""
import ast
import builtins
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The headings of the sections that motivate a chapter (its hook).
HOOK_HEADING = re.compile(r"^## (Why\b|The bubble in one line)", re.M)
SECTION = re.compile(r"^## ", re.M)
PARAMETERS_LINE = ("Change a value here and run the notebook again: every number "
                   "and plot below follows.")
TEST_WORDS = re.compile(r"\b(the tests|test suite)\b", re.I)
SENTENCE_END = re.compile(r"((?<=[.!?])\s+(?=[A-Z(]))")
# A comment line that only says which test keeps a copy equal; and a clause of one.
TEST_COMMENT = re.compile(r"^[ \t]*#.*\b(kept equal to|kept identical by)\b.*tests/.*\n",
                          re.M | re.I)
TEST_CLAUSE = re.compile(r";\s*the tests use [^.)]*(\([^)]*\))?\.")


# -- notebook files: nbformat's own layout, so an unchanged chapter stays byte-identical

def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def dump(nb: dict) -> str:
    return json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n"


def text(cell) -> str:
    return "".join(cell["source"])


def set_text(cell, source: str):
    cell["source"] = source.splitlines(keepends=True)


def is_parameters(cell) -> bool:
    return "parameters" in cell["metadata"].get("tags", [])


def is_imports(cell) -> bool:
    """A code cell whose first statement is an import (the chapter's imports)."""
    if cell["cell_type"] != "code" or is_parameters(cell):
        return False
    try:
        body = ast.parse(text(cell)).body
    except SyntaxError:
        return False
    return bool(body) and isinstance(body[0], (ast.Import, ast.ImportFrom))


# -- names a cell reads and binds

def bound(tree) -> set:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def read(tree) -> set:
    return {n.id for n in ast.walk(tree)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def one_line_imports(source: str) -> dict:
    """{bound name: (statement index, alias)} of the cell's one-line import statements."""
    found = {}
    for i, node in enumerate(ast.parse(source).body):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno == node.end_lineno:
            for alias in node.names:
                found[(alias.asname or alias.name).split(".")[0]] = (i, alias)
    return found


def take_imports(imports_cell, names: set) -> list[str]:
    """Remove the imports of ``names`` from the imports cell; return them as lines."""
    source = text(imports_cell)
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    where = one_line_imports(source)
    by_statement = {}
    for name in names:
        i, alias = where[name]
        by_statement.setdefault(i, []).append(alias)
    taken = []
    for i in sorted(by_statement, reverse=True):
        node, moving = tree.body[i], by_statement[i]
        keep = [a for a in node.names if a not in moving]
        taken.insert(0, statement(node, moving))
        row = node.lineno - 1
        lines[row] = statement(node, keep) + "\n" if keep else ""
    set_text(imports_cell, "".join(lines))
    return taken


def statement(node, aliases) -> str:
    names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in aliases)
    if isinstance(node, ast.Import):
        return f"import {names}"
    return f"from {'.' * node.level}{node.module or ''} import {names}"


# -- the reordering

def split_at_section(cells, k) -> bool:
    """Split markdown cell k before its first '## ' heading that is not its first line."""
    cell = cells[k]
    match = SECTION.search(text(cell), 1)
    if cell["cell_type"] != "markdown" or not match:
        return False
    head, tail = text(cell)[:match.start()].rstrip("\n"), text(cell)[match.start():]
    second = json.loads(json.dumps(cell))
    set_text(cell, head)
    set_text(second, tail)
    if "id" in cell:
        second["id"] = (cell["id"] + "-next")[:64]
    cells.insert(k + 1, second)
    return True


def hook_block(cells, start, group_cells) -> tuple[list[int], dict, int | None]:
    """(indices of the hook section's cells that can move, {cell index: its imports},
    the markdown cell of the block in which the next section starts, or None)."""
    if start >= len(cells) or cells[start]["cell_type"] != "markdown" \
            or not HOOK_HEADING.match(text(cells[start])):
        return [], {}, None
    params = next(c for c in group_cells if is_parameters(c))
    imports = next((c for c in group_cells if is_imports(c)), None)
    param_names = bound(ast.parse(text(params)))
    importable = one_line_imports(text(imports)) if imports else {}
    group_names = param_names | (bound(ast.parse(text(imports))) if imports else set())
    block, needs, defined, taken = [start], {}, set(), set()
    k, split = start + 1, None
    while k < len(cells):
        cell = cells[k]
        if cell["cell_type"] == "markdown":
            if SECTION.match(text(cell)):
                break
            block.append(k)
            if SECTION.search(text(cell)):  # the next section starts inside it
                split = k
                break
        else:
            source = text(cell)
            try:
                tree = ast.parse(source)
            except SyntaxError:  # a magic (%%ranks): runs after the imports
                break
            wanted = read(tree) - bound(tree) - defined - set(dir(builtins))
            missing = wanted - set(importable) - taken
            if missing or wanted & param_names or bound(tree) & group_names:
                break
            needs[k] = wanted - taken
            taken |= wanted
            defined |= bound(tree)
            block.append(k)
        k += 1
    # Markdown after the last code cell that moves introduces the code that stays.
    if split is None and k < len(cells) and cells[k]["cell_type"] == "code":
        while len(block) > 1 and cells[block[-1]]["cell_type"] == "markdown":
            block.pop()
    if split is not None and block[-1] != split:
        split = None
    return block, needs, split


def by_role(cell) -> int:
    """The group's order: its markdown, the parameters cell, the imports."""
    return 0 if cell["cell_type"] == "markdown" else 1 if is_parameters(cell) else 2


def reorder(nb) -> dict:
    cells = nb["cells"]
    p = next((i for i, c in enumerate(cells) if is_parameters(c)), None)
    if p is None:
        return nb
    group = [p]
    if p > 0 and cells[p - 1]["cell_type"] == "markdown" \
            and text(cells[p - 1]).startswith("## Parameters"):
        group.append(p - 1)
    imports = next((i for i in (p + 1, p - 1, p - 2)
                    if 0 <= i < len(cells) and is_imports(cells[i])), None)
    if imports is not None:
        group.append(imports)
    group.sort()
    lo, hi = group[0], group[-1]
    group_cells = sorted((cells[i] for i in group), key=by_role)
    block, needs, split = hook_block(cells, hi + 1, group_cells)
    if block:
        if split is not None:  # its head ends the hook; its tail, the next section, stays
            split_at_section(cells, split)
        imports_cell = next((c for c in group_cells if is_imports(c)), None)
        for k, names in needs.items():
            if names:
                lines = take_imports(imports_cell, names)
                set_text(cells[k], "\n".join(lines) + "\n\n" + text(cells[k]))
    between = [cells[i] for i in range(lo, hi + 1) if i not in group]
    end = block[-1] + 1 if block else hi + 1
    nb["cells"] = (cells[:lo] + between + [cells[i] for i in block]
                   + group_cells + cells[end:])
    return nb


def plain_remarks(nb) -> dict:
    """The test-keeping remarks out of the lesson text (module docstring)."""
    cells = nb["cells"]
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "code":
            source = TEST_CLAUSE.sub(".", TEST_COMMENT.sub("", text(cell)))
            if source != text(cell):
                set_text(cell, source)
        elif i + 1 < len(cells) and is_parameters(cells[i + 1]):
            before, sep, body = text(cell).partition("## Parameters")
            if not sep:
                continue
            parts = SENTENCE_END.split(body.strip())  # sentence, space, sentence, ...
            body = "".join(sep + sentence for sep, sentence in zip([""] + parts[1::2], parts[::2])
                           if not TEST_WORDS.search(sentence)).strip()
            body = body if body else PARAMETERS_LINE
            new = f"{before}## Parameters\n\n{body}"
            if new != text(cell):
                set_text(cell, new)
    return nb


def chapters() -> list[Path]:
    return sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def main(argv) -> int:
    check = "--check" in argv
    paths = [Path(a) for a in argv if a != "--check"] or chapters()
    changed = []
    for path in paths:
        before = path.read_text(encoding="utf-8")
        after = dump(plain_remarks(reorder(load(path))))
        if after != before:
            changed.append(path.name)
            if not check:
                path.write_text(after, encoding="utf-8")
    verb = "would change" if check else "changed"
    print(f"{verb}: {', '.join(changed) or 'nothing'}")
    return 1 if check and changed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
