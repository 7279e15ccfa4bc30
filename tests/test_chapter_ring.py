"""labsupport.ring.checks, behind chapter 2's your-turn cells.

Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_chapter_ring.py

The chapter's own solutions (read from its solution cells) pass; a
reduce-scatter that uses one direction only, one that posts each direction
in its own batch, a chain that stores and forwards, one that sends a
segment before it has arrived and one that sends the whole tensor at once
each fail with a message that names the mistake; an untouched stub is
"not written yet".
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import labsupport as ls
from labsupport.ring import checks
from nbtools import ROOT, notebook_definitions

cloudpickle.register_pickle_by_value(sys.modules[__name__])
CHAPTER = ROOT / "notebooks" / "02_ring_allreduce.ipynb"


def solution(name):
    """The chapter's solution of ``name`` (its last definition), defined here."""
    exec(notebook_definitions(CHAPTER)[name], globals())
    return globals()[name]


def _wait(ops):
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def one_direction_reduce_scatter(tensor):
    """The chapter's plain reduce-scatter: right only."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = tensor.view(-1).tensor_split(n)
    for step in range(n - 1):
        mine = chunks[(rank - step - 2) % n]
        incoming = torch.empty_like(mine)
        _wait([dist.P2POp(dist.isend, chunks[(rank - step - 1) % n], (rank + 1) % n),
               dist.P2POp(dist.irecv, incoming, (rank - 1) % n)])
        mine += incoming
    return tensor


def two_batches_reduce_scatter(tensor):
    """Right sums, both directions, but each direction in its own batch."""
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    halves = [c.tensor_split(2) for c in tensor.view(-1).tensor_split(n)]
    for step in range(n - 1):
        for half, sign, to, frm in ((0, -1, right, left), (1, 1, left, right)):
            out, into = (halves[(rank + sign * (step + d)) % n][half] for d in (1, 2))
            got = torch.empty_like(into)
            _wait([dist.P2POp(dist.isend, out, to), dist.P2POp(dist.irecv, got, frm)])
            into += got
    return tensor


def _chain(tensor, segment_bytes, lag_of):
    """A chain broadcast where a middle rank sends segment i in batch i + lag."""
    rank, n = dist.get_rank(), dist.get_world_size()
    segments = tensor.view(-1).split(max(1, segment_bytes // 4))
    k, lag = len(segments), 0 if rank == 0 else lag_of(len(segments))
    for i in range(k + lag):
        ops = []
        if rank > 0 and i < k:
            ops.append(dist.P2POp(dist.irecv, segments[i], rank - 1))
        if rank < n - 1 and 0 <= i - lag < k:
            ops.append(dist.P2POp(dist.isend, segments[i - lag], rank + 1))
        if ops:
            _wait(ops)
    return tensor


def store_and_forward(tensor, segment_bytes):
    return _chain(tensor, segment_bytes, lambda k: k)


def whole_tensor_chain(tensor, segment_bytes):
    return _chain(tensor, tensor.numel() * 4, lambda k: 1)


def stub(*args):
    raise ls.NotWritten("stub")


def test_the_chapters_bidirectional_reduce_scatter_passes():
    checks.bidirectional_reduce_scatter(solution("bidirectional_reduce_scatter"))


def test_one_direction_only_is_named():
    with pytest.raises(AssertionError, match=r"(?s)on rank 0 of 4.*sent 3600 bytes to its "
                                             r"right neighbour and 0 to its left.*One "
                                             r"direction only"):
        checks.bidirectional_reduce_scatter(one_direction_reduce_scatter, world_sizes=(4,))


def test_each_direction_in_its_own_batch_is_named():
    with pytest.raises(AssertionError, match=r"posted its messages in 2 batches or calls "
                                             r"of \[2, 2\] operations"):
        checks.bidirectional_reduce_scatter(two_batches_reduce_scatter)


def test_the_chapters_chain_broadcast_passes():
    checks.chain_broadcast(solution("chain_broadcast"))


def test_store_and_forward_is_named():
    with pytest.raises(AssertionError, match=r"on rank 1 of 4.*store and forward"):
        checks.chain_broadcast(store_and_forward, world_sizes=(4,))


def test_the_whole_tensor_in_one_message_is_named():
    with pytest.raises(AssertionError, match=r"carried \[4000\] bytes; cut the tensor "
                                             r"into k = 10 segments"):
        checks.chain_broadcast(whole_tensor_chain)


@pytest.mark.parametrize("check", [checks.bidirectional_reduce_scatter,
                                   checks.chain_broadcast],
                         ids=["bidirectional_reduce_scatter", "chain_broadcast"])
def test_an_untouched_stub_is_not_written_yet_not_a_failure(check, capsys):
    assert ls.your_turn.check(lambda: check(stub), "stub") is None
    assert "stub is not written yet" in capsys.readouterr().out
