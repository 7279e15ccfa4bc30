# Run: .venv/bin/python -m pytest tests/test_your_turn.py
"""labsupport.your_turn: the check behind every chapter's `your-turn` cells.

An untouched stub is reported as not written (on a rank or in the kernel),
without raising; a wrong answer raises the check's own message; a right one
prints what was checked.
"""
import pytest
import torch
import torch.distributed as dist

import labsupport as ls
from labsupport.your_turn import check


def stub(x):
    raise ls.NotWritten("double")


def right(x):
    return 2 * x


def wrong(x):
    return x + 2


def checker(fn):
    """On every rank: fn(rank) must equal 2 * rank, and the ranks must agree on the sum."""
    rank = dist.get_rank()
    got = fn(torch.tensor(float(rank)))
    assert got == 2 * rank, f"double({rank}) gave {got.item()}, expected {2 * rank}"
    total = torch.tensor(got.item())
    dist.all_reduce(total)
    return total.item()


@pytest.fixture(scope="module")
def cluster():
    with ls.start(world_size=2) as c:
        yield c


def test_untouched_stub_is_reported_on_the_ranks_without_raising(cluster, capsys):
    assert check(lambda: cluster.run(checker, stub), "double") is None
    out = capsys.readouterr().out
    assert "double is not written yet" in out and "run this check again" in out


def test_untouched_stub_is_reported_in_the_kernel_too(capsys):
    assert check(lambda: stub(1), "double") is None
    assert "double is not written yet" in capsys.readouterr().out


def test_wrong_answer_raises_the_checks_message(cluster):
    with pytest.raises(ls.RankError, match=r"double\(1\) gave 3.0, expected 2"):
        check(lambda: cluster.run(checker, wrong), "double")


def test_right_answer_passes_and_returns_the_result(cluster, capsys):
    assert check(lambda: cluster.run(checker, right), "double", "2 ranks agree") == [2.0, 2.0]
    assert "✓ double: 2 ranks agree" in capsys.readouterr().out


def test_a_stub_on_one_rank_and_a_real_error_on_another_is_an_error(cluster):
    def mixed(x):
        if dist.get_rank() == 0:
            raise ls.NotWritten("double")
        raise ValueError("a real bug")
    with pytest.raises(ls.RankError, match="a real bug"):
        check(lambda: cluster.run(checker, mixed), "double")

