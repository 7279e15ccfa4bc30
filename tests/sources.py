"""The instructors' source assignments, read by the tests: the one place a reference
solution lives (notebooks/assignments/source/<name>/<name>.ipynb), never labsupport.

    ref = reference("zero_bubble_pipeline")     # a module: the notebook's imports,
    ref.train_step_zb_h1                        # given code and reference solution
    reference(name, {grade_id: replaced((old, new))}, "wrong")  # a variant of it
    solution_regions(path)                      # [(grade_id, the code between the markers)]
    copied(region, text)                        # does text hold the region, names renamed?

``reference`` runs the notebook's definitions only (imports, defs, classes,
assignments of its given and solution cells), never its try-out or test
cells, and registers the module with cloudpickle by value, so that the ranks
of ``ls.run`` or ``ls.grading`` unpickle its functions without importing
anything from tests/.
"""
import ast
import io
import keyword
import re
import sys
import tokenize
import types
from pathlib import Path

import cloudpickle
import nbformat

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIR = ROOT / "notebooks" / "assignments" / "source"
_REGION = re.compile(r"^[ \t]*### BEGIN SOLUTION[^\n]*\n(.*?)^[ \t]*### END SOLUTION", re.S | re.M)
_DEFINITIONS = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef, ast.Assign)


def source_path(assignment: str) -> Path:
    return SOURCE_DIR / assignment / f"{assignment}.ipynb"


def assignments() -> list[str]:
    """Every source assignment's folder name."""
    return sorted(p.name for p in SOURCE_DIR.iterdir() if (p / f"{p.name}.ipynb").exists())


def solution_regions(path: Path) -> list[tuple[str, str]]:
    """(grade_id, code) of every ### BEGIN SOLUTION ... ### END SOLUTION region."""
    out = []
    for cell in nbformat.read(path, as_version=4).cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id", "?")
        out += [(grade_id, region) for region in _REGION.findall(cell.source)]
    return out


def reference(assignment: str, edits: dict | None = None, name: str = "") -> types.ModuleType:
    """The source notebook's definitions, the reference solution included, as a module.

    ``edits`` {grade_id: new source, or a function of the cell's source} gives a
    variant (a wrong answer written as a change of the reference), registered as
    ``reference_<assignment>_<name>``.
    """
    module_name = f"reference_{assignment}" + (f"_{name}" if name else "")
    if module_name in sys.modules:
        return sys.modules[module_name]
    module = types.ModuleType(module_name)
    module.__file__ = str(source_path(assignment))
    for cell in nbformat.read(source_path(assignment), as_version=4).cells:
        role = cell.metadata.get("nbgrader", {})
        given = role.get("locked") or role.get("solution") or "parameters" in cell.metadata.get(
            "tags", [])
        if cell.cell_type != "code" or role.get("grade") or not given:
            continue  # test cells and try-outs
        source = edited(cell.source, (edits or {}).get(role.get("grade_id")))
        tree = ast.parse(source)
        tree.body = [node for node in tree.body if isinstance(node, _DEFINITIONS)]
        exec(compile(tree, f"<{module_name}: {role.get('grade_id')}>", "exec"), module.__dict__)
    sys.modules[module_name] = module
    cloudpickle.register_pickle_by_value(module)
    return module


def edited(source: str, edit) -> str:
    """``source`` after ``edit``: None (unchanged), a new source, or a function of it,
    which must change it."""
    if edit is None:
        return source
    new = edit(source) if callable(edit) else edit
    assert new != source, "the edit changed nothing: has the reference changed?"
    return new


def replaced(*pairs):
    """An edit that replaces each (old, new) text, each of which must be there."""
    def edit(source):
        for old, new in pairs:
            assert old in source, f"{old!r} is not in the reference's cell"
            source = source.replace(old, new)
        return source
    return edit


# -- a solution region copied somewhere, names renamed --------------------------------------

_SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
         tokenize.ENDMARKER}
_STRINGS = {getattr(tokenize, name) for name in (  # f-strings are tokens of their own in 3.12
    "STRING", "FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END") if hasattr(tokenize, name)}


def code_lines(code: str) -> int:
    """Lines that hold code (not blank, not only a comment)."""
    return sum(1 for line in code.splitlines()
               if line.strip() and not line.strip().startswith("#"))


def tokens(code: str) -> list[tuple[str, str]]:
    """(shape, text) of each token: identifiers become "N", strings "S" (keywords,
    operators and numbers stay), line ends ";"; comments and indentation are dropped.
    IPython magic and shell lines are left out."""
    lines = [line.strip() for line in code.splitlines()
             if not line.lstrip().startswith(("%", "!"))]
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline):
            if tok.type in _SKIP:
                continue
            if tok.type == tokenize.NAME and not keyword.iskeyword(tok.string):
                out.append(("N", tok.string))
            elif tok.type in _STRINGS:
                out.append(("S", ""))
            elif tok.type == tokenize.NEWLINE:
                out.append((";", ""))
            else:
                out.append((tok.string, ""))
    except (tokenize.TokenError, SyntaxError):  # an unfinished bracket at the end: keep what came
        pass
    return out


def copied(region: str, text: str) -> bool:
    """Does ``text`` hold the region's code with its identifiers consistently renamed
    (comments, strings and layout aside)?"""
    want, have = tokens(region), tokens(text)
    while want and want[0][0] == ";":
        want.pop(0)
    if not want:
        return False
    shape = "\x00".join(s for s, _ in want) + "\x00"
    haystack = "\x00".join(s for s, _ in have) + "\x00"
    starts = [0] + [i + 1 for i, c in enumerate(haystack) if c == "\x00"]
    index = {offset: i for i, offset in enumerate(starts)}
    at = haystack.find(shape)
    while at != -1:
        if at in index and _renamed(want, have[index[at]:index[at] + len(want)]):
            return True
        at = haystack.find(shape, at + 1)
    return False


def _renamed(want, window) -> bool:
    """The names of ``window`` are those of ``want`` under one renaming, both ways."""
    forward, backward = {}, {}
    for (shape, a), (_, b) in zip(want, window):
        if shape == "N" and (forward.setdefault(a, b) != b or backward.setdefault(b, a) != a):
            return False
    return True
