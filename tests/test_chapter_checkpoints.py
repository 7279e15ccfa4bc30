"""labsupport.checkpoints.checks, behind chapter 10's your-turn cells: the
chapter's read plan passes, plausible wrong ones fail with a message that names the
mistake; a resumed run that differs is told which field and why."""
from pathlib import Path

import pytest

import labsupport as ls
from labsupport.checkpoints import checks
from nbtools import notebook_definitions

CHAPTER = Path(__file__).resolve().parents[1] / "notebooks/10_checkpoints_and_failures.ipynb"


def _solution():
    namespace = {}
    exec(notebook_definitions(CHAPTER)["read_plan"], namespace)   # the solution cell's
    return namespace["read_plan"]


def _elements_not_bytes(pieces, start, length, itemsize):   # offset in elements
    return [t for t in _plan_by_piece(pieces, start, length, 1) if t[2]]


def _plan_by_piece(pieces, start, length, itemsize):
    out = []
    for p in pieces:
        lo, hi = max(start, p["start"]), min(start + length, p["start"] + p["length"])
        out.append((p["file"], p["offset"] + (lo - p["start"]) * itemsize,
                    max(0, hi - lo), lo - start))
    return out


def _from_piece_start(pieces, start, length, itemsize):     # ignores where it overlaps
    return [(f, p["offset"], c, pos) for p, (f, o, c, pos)
            in zip(pieces, _plan_by_piece(pieces, start, length, itemsize)) if c]


def _whole_files(pieces, start, length, itemsize):          # reads every saved piece
    return [(p["file"], p["offset"], p["length"], p["start"] - start) for p in pieces
            if p["length"]]


def test_the_chapters_read_plan_passes():
    checks.check_read_plan(_solution())


@pytest.mark.parametrize("wrong, message", [
    (_elements_not_bytes, r"new rank 1 of 2 .* should come from rank1.bin at byte"),
    (_from_piece_start, r"element 19 should come from rank1.bin at byte 56; your plan "
                        r"reads \('rank1.bin', 20\)"),
    (_whole_files, "is outside the new slice"),
])
def test_read_plan_check_names_the_mistake(wrong, message):
    with pytest.raises(AssertionError, match=message):
        checks.check_read_plan(wrong)


def test_an_unwritten_read_plan_is_reported_not_failed(capsys):
    def stub(*args):
        raise ls.NotWritten("read_plan")
    assert ls.your_turn.check(lambda: checks.check_read_plan(stub), "read_plan") is None
    assert "read_plan is not written yet" in capsys.readouterr().out


def _records(losses, **change):
    return [dict(step=i, samples=[i], lr=0.1, rng=7, loss=loss, **change.get(i, {}))
            for i, loss in enumerate(losses)]


def test_a_resumed_run_is_told_which_field_differs_and_why():
    want = [_records([3.0, 2.0, 1.0, 0.5])]
    checks.compare_resumed([want[0][2:]], want, 2)
    with pytest.raises(AssertionError, match="resumed at step 1, expected 2"):
        checks.compare_resumed([want[0][1:]], want, 2)
    forgot = [dict(r, samples=[0]) for r in want[0][2:]]
    with pytest.raises(AssertionError, match=r"step 2: samples \[0\] instead of \[2\]: "
                                             r"the data position"):
        checks.compare_resumed([forgot], want, 2)
    with pytest.raises(AssertionError, match="rng 8 instead of 7: the random stream"):
        checks.compare_resumed([[dict(r, rng=8) for r in want[0][2:]]], want, 2)
