"""labsupport.chapter_checks, behind the chapters' your-turn cells: a right and a wrong answer each.

Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_chapter_checks.py
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import labsupport as ls
from labsupport import chapter_checks as cc
from labsupport import ring

cloudpickle.register_pickle_by_value(sys.modules[__name__])


# -- right answers (the chapters' reference solutions) and plausible wrong ones --------

def ring_reduce_scatter(tensor):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    chunks = tensor.view(-1).tensor_split(world_size)
    for step in range(world_size - 1):
        mine = chunks[(rank - step - 2) % world_size]
        incoming = torch.empty_like(mine)
        ring.exchange(chunks[(rank - step - 1) % world_size], right, incoming, left)
        mine += incoming
    return tensor


def ring_reduce_scatter_old_convention(tensor):
    """Leaves chunk r+1 on rank r: the first edition's convention."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    chunks = tensor.view(-1).tensor_split(world_size)
    for step in range(world_size - 1):
        mine = chunks[(rank - step - 1) % world_size]
        incoming = torch.empty_like(mine)
        ring.exchange(chunks[(rank - step) % world_size], right, incoming, left)
        mine += incoming
    return tensor


def ring_all_gather(tensor):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    chunks = tensor.view(-1).tensor_split(world_size)
    for step in range(world_size - 1):
        ring.exchange(chunks[(rank - step) % world_size], right,
                      chunks[(rank - step - 1) % world_size], left)
    return tensor


def all_gather_whole_tensor(tensor):
    """Right result, but forwards the whole tensor at every step: (N-1)·S bytes."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    chunks = tensor.view(-1).tensor_split(world_size)
    for step in range(world_size - 1):
        incoming = torch.empty_like(tensor)
        ring.exchange(tensor.clone(), right, incoming, left)
        c = chunks[(rank - step - 1) % world_size]
        c.copy_(incoming.view(-1).tensor_split(world_size)[(rank - step - 1) % world_size])
    return tensor


def all_reduce_p2p(tensor, add_own=True):
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
    return all_reduce_p2p(tensor, add_own=False)


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


def all_reduce_from_halves(tensor):
    mine = torch.empty(tensor.numel() // dist.get_world_size())
    dist.reduce_scatter_single(mine, tensor, async_op=True).wait()
    out = torch.empty_like(tensor)
    dist.all_gather_single(out, mine)
    return out


def all_reduce_library(tensor):
    dist.all_reduce(tensor)
    return tensor


def stub(*args):
    raise ls.NotWritten("stub")


# -- the checks ------------------------------------------------------------------------

@pytest.mark.parametrize("kind, right", [("reduce_scatter", ring_reduce_scatter),
                                         ("all_gather", ring_all_gather),
                                         ("all_reduce", ring.ring_allreduce_simple)])
def test_a_ring_collective_passes(kind, right):
    cc.collective(kind, right, ring=True)


def test_the_old_chunk_convention_is_named_chunk_by_chunk():
    with pytest.raises(AssertionError, match=r"(?s)rank 0, chunk 0 .*chunk `rank`"):
        cc.collective("reduce_scatter", ring_reduce_scatter_old_convention, ring=True)


def test_an_all_gather_forwarding_the_whole_tensor_sends_too_many_bytes():
    with pytest.raises(AssertionError, match=r"(?s)too many bytes.*whole tensor"):
        cc.collective("all_gather", all_gather_whole_tensor, ring=True)


def test_a_direct_all_reduce_passes_results_and_bytes():
    cc.collective("all_reduce", all_reduce_p2p)
    cc.bytes_sent(all_reduce_p2p, factor=2, world_size=4)


def test_a_direct_all_reduce_that_forgets_its_own_chunk_is_caught():
    with pytest.raises(AssertionError, match=r"(?s)not an all-reduce on 2 ranks.*expected"):
        cc.collective("all_reduce", all_reduce_p2p_forgets_own)


def test_sending_the_whole_tensor_to_everyone_is_caught_by_the_bytes():
    cc.collective("all_reduce", all_reduce_whole_to_everyone)  # the result is right
    with pytest.raises(AssertionError, match=r"ranks sent \[14400, 14400, 14400, 14400\]"):
        cc.bytes_sent(all_reduce_whole_to_everyone, factor=2, world_size=4)


def test_the_all_reduce_from_its_halves_passes_and_the_library_call_does_not():
    cc.composed_all_reduce(all_reduce_from_halves)
    with pytest.raises(AssertionError, match=r"called dist\.all_reduce"):
        cc.composed_all_reduce(all_reduce_library)


@pytest.mark.parametrize("check", [
    lambda: cc.collective("all_gather", stub, ring=True),
    lambda: cc.bytes_sent(stub, factor=2),
    lambda: cc.composed_all_reduce(stub),
], ids=["collective", "bytes", "composed"])
def test_an_untouched_stub_is_not_written_yet_not_a_failure(check, capsys):
    assert ls.your_turn.check(check, "stub") is None
    assert "not written yet" in capsys.readouterr().out
