"""Checks behind the chapters' ``your-turn`` cells: run the reader's function, say what is wrong.

    from labsupport import chapter_checks as cc
    ls.your_turn.check(lambda: cc.collective("all_gather", ring_all_gather, ring=True),
                       "ring_all_gather", "...")

Collectives written from send/recv reuse the graders' checking core
(``labsupport.grading``: results against ``dist.all_reduce``, no library
collective, every request waited for, ring neighbours and bytes, a deadlock
explained rank by rank). (Chapters 3 and 5's checks moved to
``labsupport.grading.chapters``.) Each raises AssertionError
with a message that names what differs, and NotWritten while the stub is
untouched, so that ``ls.your_turn.check`` says "not written yet".
"""
import torch
import torch.distributed as dist

from labsupport.grading import checks as grading
from labsupport.your_turn import NotWritten

_STUB = "is not written yet"


def _name(fn) -> str:
    return getattr(fn, "__name__", "the function")


def _graded(check, fn, *args, **kwargs):
    """A grading check; its report of an untouched stub becomes NotWritten."""
    try:
        return check(fn, *args, **kwargs)
    except AssertionError as failure:
        if _STUB in str(failure):
            raise NotWritten(_name(fn)) from None
        raise


def collective(kind: str, fn, world_sizes=(2, 4), ring: bool = False):
    """``fn(tensor)`` in place is ``kind`` ("all_reduce", "reduce_scatter", "all_gather").

    Chunk r is ``tensor.tensor_split(world_size)[r]`` (dist.reduce_scatter's
    convention). ``ring=True`` also checks the ring: only neighbours, and
    k(N-1)/N·S bytes sent per rank (k = 2 for all-reduce, else 1).
    """
    checks = dict(all_reduce=grading.check_allreduce, all_gather=grading.check_all_gather,
                  reduce_scatter=grading.check_reduce_scatter)
    if kind not in checks:
        raise ValueError(f"kind must be one of {sorted(checks)}, got {kind!r}")
    _graded(checks[kind], fn, tuple(world_sizes), traffic=ring)


def _ones_through(fn, numel):
    return fn(torch.ones(numel))


def bytes_sent(fn, factor: int, world_size: int = 4, numel: int = 1200):
    """Each rank sends exactly factor·(N-1)/N·S bytes with send/isend (S = numel floats)."""
    calls = _graded(grading.run, _ones_through, fn, numel, world_size=world_size)
    grading.assert_rules(calls, _name(fn))
    want = factor * (world_size - 1) * numel * 4 // world_size
    sent = [c["sent"] for c in calls]
    if sent != [want] * world_size:
        raise AssertionError(
            f"{_name(fn)} on {world_size} ranks, S = {numel * 4} bytes: ranks sent {sent} "
            f"bytes; each should send {factor}(N-1)/N·S = {want}: one chunk of S/N to each "
            f"of the N-1 other ranks{' per half' if factor == 2 else ''}.")


def _composed(fn, numel):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x = torch.arange(numel, dtype=torch.float32) * (rank + 1)
    want = torch.arange(numel, dtype=torch.float32) * world_size * (world_size + 1) / 2
    out = fn(x)
    got = x if out is None else out
    return dict(got=got, want=want)


def composed_all_reduce(fn, world_size: int = 4, numel: int = 12):
    """``fn(t)`` returns the all-reduced t using reduce-scatter then all-gather, tensor forms."""
    calls = _graded(grading.run, _composed, fn, numel, world_size=world_size)
    used = calls[0]["collectives"]
    if used.get("all_reduce"):
        raise AssertionError(f"{_name(fn)} called dist.all_reduce: build it from the two "
                             "halves, a reduce-scatter then an all-gather.")
    halves = {"reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
              "all_gather": ("all_gather_single", "all_gather_into_tensor")}
    for half, names in halves.items():
        if sum(used.get(n, 0) for n in names) != 1:
            raise AssertionError(f"{_name(fn)} should call one {half} in its tensor form "
                                 f"({' or '.join('dist.' + n for n in names)}); it called "
                                 f"{used or 'no collective'}.")
    for rank, c in enumerate(calls):
        got, want = c["value"]["got"], c["value"]["want"]
        if got.shape != want.shape or not torch.equal(got, want):
            raise AssertionError(f"{_name(fn)} on {world_size} ranks: rank {rank} got "
                                 f"{got.tolist()}, expected the sum over ranks {want.tolist()}.")
