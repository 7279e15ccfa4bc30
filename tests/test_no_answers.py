# Run: .venv/bin/python -m pytest tests/test_no_answers.py   (~5 s)
"""No graded answer a student can import or copy.

Every solution region of every source assignment (### BEGIN SOLUTION ...
### END SOLUTION, at least MIN_LINES lines of code) is looked for in the
package a student imports (labsupport/) and in every chapter notebook,
with identifiers consistently renamed and comments, strings and layout
ignored (``sources.copied``); so are the regions of each grade_id together
and the assignment's shorter regions together (helpers of a few lines, such
as assignment 3's backward_input and backward_weight), found where every one
of them is, when they add up to MIN_LINES. And each source folder holds its notebook
only: ``nbgrader generate_assignment`` copies every other file of the
folder into release/ as it is. The graders' tests check the release
notebook itself (nbgrader_run.assert_release_only).
"""
from pathlib import Path

import nbformat
import pytest

import sources
from nbgrader_run import MIN_LINES

ROOT = sources.ROOT


def places(root: Path) -> dict:
    """{where: code} of everything a student imports or reads in a chapter."""
    found = {str(p.relative_to(root)): p.read_text() for p in (root / "labsupport").rglob("*.py")}
    for path in sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if cell.cell_type == "code":
                found[f"{path.relative_to(root)}, cell {i}"] = cell.source
    return found


def looked_for(regions: list[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """(what, its regions) of everything looked for (module docstring): a long region
    alone, a grade_id's regions together, the short regions together."""
    by_id, short = {}, [(gid, code) for gid, code in regions
                        if sources.code_lines(code) < MIN_LINES]
    for gid, code in regions:
        by_id.setdefault(gid, []).append(code)
    units = [(gid, [code]) for gid, code in regions if sources.code_lines(code) >= MIN_LINES]
    units += [(f"{gid} (its {len(codes)} regions)", codes)
              for gid, codes in by_id.items() if len(codes) > 1]
    if len(short) > 1:
        units.append((" + ".join(gid for gid, _ in short) + " (the short regions)",
                      [code for _, code in short]))
    return [(what, codes) for what, codes in units
            if sum(sources.code_lines(code) for code in codes) >= MIN_LINES]


def copies(assignment: str) -> list[str]:
    """'<what> in <where>' for each graded solution found outside the source notebook."""
    units = looked_for(sources.solution_regions(sources.source_path(assignment)))
    return [f"the solution of {what} ({sum(map(sources.code_lines, codes))} lines) in {where}"
            for where, text in places(ROOT).items() for what, codes in units
            if all(sources.copied(code, text) for code in codes)]


@pytest.mark.parametrize("assignment", sources.assignments())
def test_no_solution_is_in_the_package_or_a_chapter(assignment):
    found = copies(assignment)
    assert not found, (
        "a student can import or copy the reference: " + "; ".join(found) + ". A reference "
        "solution lives only in notebooks/assignments/source; tests read it from there "
        "(tests/sources.py).")


@pytest.mark.parametrize("assignment", sources.assignments())
def test_the_source_folder_holds_only_its_notebook(assignment):
    folder = sources.SOURCE_DIR / assignment
    others = sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                    if p.is_file() and p.name != f"{assignment}.ipynb")
    assert not others, f"generate_assignment would copy {others} into release/{assignment}/"


def test_every_assignment_has_regions_long_enough_to_check():
    """Each assignment has a region of MIN_LINES or more, so the scan above means something."""
    for assignment in sources.assignments():
        lengths = [sources.code_lines(code) for _, code in
                   sources.solution_regions(sources.source_path(assignment))]
        assert max(lengths) >= MIN_LINES, (assignment, lengths)


def test_a_renamed_copy_is_found_and_a_changed_one_is_not():
    region = ("    warmup, w = min(p - rank - 1, m), 0\n    for i in range(warmup):\n"
              "        pp.forward(rank, i)  # warm-up\n    for k in range(m - warmup):\n"
              "        pp.backward(rank, k)\n")
    renamed = region.replace("warmup", "first").replace("rank", "me").replace("pp", "pipe")
    assert sources.copied(region, f'"""A module."""\ndef f(pipe, me):\n{renamed}    return 1\n')
    assert not sources.copied(region, renamed.replace("m - first", "m + first"))
    assert not sources.copied(region, renamed.replace("first, w", "me, w"))  # two names, one


def test_short_regions_are_looked_for_together():
    regions = sources.solution_regions(sources.source_path("zero_bubble_pipeline"))
    units = dict(looked_for(regions))
    pair = units["backward_input + backward_weight (the short regions)"]
    assert len(pair) == 2 and "train_step_zb_h1" in units  # 2 + 3 lines; 15 alone
    renamed = ["\n".join(line.replace("grad", "g") for line in code.splitlines())
               for code in pair]
    text = "def b(x, g):\n" + renamed[0] + "\n\ndef w(x, g):\n" + renamed[1]
    assert all(sources.copied(code, text) for code in pair)
    assert not all(sources.copied(code, "def b(x, g):\n" + renamed[0]) for code in pair)
