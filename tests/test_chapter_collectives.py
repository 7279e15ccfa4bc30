"""labsupport.collectives.checks, behind chapter 1's your-turn cells.

Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_chapter_collectives.py

The chapter's own solutions (read from its solution cells) pass; a library
broadcast, a scatter left ungathered, an all-reduce that forgets its own
chunk and one that sends the whole tensor to everyone each fail with a
message that names the mistake; an untouched stub is "not written yet".
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import labsupport as ls
from labsupport.collectives import checks
from nbtools import ROOT, notebook_definitions

cloudpickle.register_pickle_by_value(sys.modules[__name__])
CHAPTER = ROOT / "notebooks" / "01_collectives.ipynb"


def solution(name):
    """The chapter's solution of ``name`` (its last definition), defined here."""
    exec(notebook_definitions(CHAPTER)[name], globals())
    return globals()[name]


def with_library_broadcast(t):
    dist.broadcast(t, src=0)
    return t


def scatter_only(t):
    mine = torch.empty(t.numel() // dist.get_world_size())
    dist.scatter(mine, list(t.chunk(dist.get_world_size())) if dist.get_rank() == 0
                 else None, src=0)
    out = torch.empty_like(t)
    dist.all_gather_single(out, mine)
    return t  # the gathered tensor is dropped


def all_reduce_p2p_direct(tensor, add_own=True):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    chunks = tensor.view(-1).tensor_split(world_size)
    others = [r for r in range(world_size) if r != rank]
    incoming = {r: torch.empty_like(chunks[rank]) for r in others}
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, chunks[r], r) for r in others]
        + [dist.P2POp(dist.irecv, incoming[r], r) for r in others])
    for work in works:
        work.wait()
    total = chunks[rank].clone() if add_own else torch.zeros_like(chunks[rank])
    for r in others:
        total += incoming[r]
    chunks[rank].copy_(total)
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, chunks[rank], r) for r in others]
        + [dist.P2POp(dist.irecv, chunks[r], r) for r in others])
    for work in works:
        work.wait()
    return tensor


def all_reduce_p2p_forgets_own(tensor):
    return all_reduce_p2p_direct(tensor, add_own=False)


def all_reduce_whole_to_everyone(tensor):
    """Right result, S·(N-1) bytes: every rank sends its whole tensor to every other."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    others = [r for r in range(world_size) if r != rank]
    incoming = {r: torch.empty_like(tensor) for r in others}
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, tensor, r) for r in others]
        + [dist.P2POp(dist.irecv, incoming[r], r) for r in others])
    for work in works:
        work.wait()
    for r in others:
        tensor += incoming[r]
    return tensor


def stub(*args):
    raise ls.NotWritten("stub")


def test_the_chapters_broadcast_from_halves_passes():
    checks.broadcast_from_halves(solution("broadcast_from_halves"))


def test_a_library_broadcast_is_named():
    with pytest.raises(AssertionError, match=r"called dist\.broadcast on rank 0"):
        checks.broadcast_from_halves(with_library_broadcast)


def test_the_gathered_tensor_dropped_is_shown_rank_by_rank():
    with pytest.raises(AssertionError, match=r"on 2 ranks: rank 1 got \[200, .*expected "
                                             r"rank 0's tensor \[100, "):
        checks.broadcast_from_halves(scatter_only)


def test_the_chapters_direct_all_reduce_passes_results_and_bytes():
    checks.all_reduce_p2p(solution("all_reduce_p2p"))


def test_a_direct_all_reduce_that_forgets_its_own_chunk_is_caught():
    with pytest.raises(AssertionError, match=r"(?s)not an all-reduce on 2 ranks.*expected"):
        checks.all_reduce_p2p(all_reduce_p2p_forgets_own)


def test_sending_the_whole_tensor_to_everyone_is_caught_by_the_bytes():
    with pytest.raises(AssertionError, match=r"ranks sent \[14400, 14400, 14400, 14400\]"):
        checks.all_reduce_p2p(all_reduce_whole_to_everyone)


@pytest.mark.parametrize("check", [checks.broadcast_from_halves, checks.all_reduce_p2p],
                         ids=["broadcast_from_halves", "all_reduce_p2p"])
def test_an_untouched_stub_is_not_written_yet_not_a_failure(check, capsys):
    assert ls.your_turn.check(lambda: check(stub), "stub") is None
    assert "stub is not written yet" in capsys.readouterr().out
