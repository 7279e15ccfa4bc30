"""Chapter 1's your-turn checks: a broadcast from two halves, an all-reduce from messages.

    from labsupport.collectives import checks
    ls.your_turn.check(lambda: checks.broadcast_from_halves(broadcast_from_halves),
                       "broadcast_from_halves", "...")
    ls.your_turn.check(lambda: checks.all_reduce_p2p(all_reduce_p2p), "all_reduce_p2p", "...")

Both run the reader's function on the ranks through the graders' core
(``checking.collective_checks``: a deadline, a deadlock explained rank by rank, the
collectives and point-to-point payload each rank used) and raise
AssertionError with a message that names what is wrong: which collectives
were called, which rank holds what, how many bytes each rank sent. An
untouched stub comes back as ``NotWritten`` (``checking.diagnosis``), which
``ls.your_turn.check`` reports as "not written yet".
"""
import torch
import torch.distributed as dist

from labsupport.checking import collective_checks
from labsupport.checking.diagnosis import name_of as _name

ALL_GATHERS = ("all_gather_single", "all_gather_into_tensor", "all_gather")


# -- a broadcast from a scatter and an all-gather (van de Geijn) ----------------------

def broadcast_from_halves(fn, world_sizes=(2, 4), numel: int = 12):
    """``fn(t)`` returns rank 0's ``t`` on every rank, from one dist.scatter and one
    all-gather: what each rank called, then what each rank got."""
    for world_size in world_sizes:
        ranks = collective_checks.run(_broadcast_on_rank, fn, numel, world_size=world_size)
        _assert_scatter_then_all_gather(_name(fn), ranks)
        for rank, r in enumerate(ranks):
            got, want = r["value"]["got"], r["value"]["want"]
            if got.shape != want.shape or not torch.equal(got, want):
                raise AssertionError(
                    f"{_name(fn)} on {world_size} ranks: rank {rank} got {_show(got)}, "
                    f"expected rank 0's tensor {_show(want)}. The scatter leaves chunk r "
                    "of rank 0's tensor on rank r; the all-gather of those chunks must "
                    "put all N of them, in rank order, on every rank: return its output.")


def _broadcast_on_rank(fn, numel):
    rank = dist.get_rank()
    t = torch.arange(numel, dtype=torch.float32) + 100 * (rank + 1)
    out = fn(t)
    got = t if out is None else out
    want = torch.arange(numel, dtype=torch.float32) + 100  # rank 0's
    return dict(got=got.detach().cpu(), want=want)


def _assert_scatter_then_all_gather(name, ranks):
    for rank, r in enumerate(ranks):
        used = r["collectives"]
        gathers = sum(used.get(op, 0) for op in ALL_GATHERS)
        others = {op: n for op, n in used.items() if op != "scatter" and op not in ALL_GATHERS}
        if used.get("broadcast"):
            raise AssertionError(f"{name} called dist.broadcast on rank {rank}: build the "
                                 "broadcast from its two halves, a dist.scatter from rank 0 "
                                 "then an all-gather of the chunks.")
        if used.get("scatter", 0) != 1 or gathers != 1 or others:
            raise AssertionError(
                f"{name} should call one dist.scatter (from rank 0) and one all-gather "
                f"(dist.all_gather_single) on every rank; rank {rank} called "
                f"{_calls(used)}.")


# -- an all-reduce from point-to-point messages, direct --------------------------------

def all_reduce_p2p(fn, world_sizes=(2, 4), bytes_world_size: int = 4, numel: int = 1200):
    """``fn(tensor)`` in place is an all-reduce from point-to-point messages only (the
    graders' checks of the results), sending 2(N-1)/N·S bytes per rank."""
    collective_checks.check_allreduce(fn, world_sizes=tuple(world_sizes))
    ranks = collective_checks.run(_ones_through, fn, numel, world_size=bytes_world_size)
    collective_checks.assert_rules(ranks, _name(fn))
    n = bytes_world_size
    want = 2 * (n - 1) * numel * 4 // n
    sent = [r["sent"] for r in ranks]
    if sent != [want] * n:
        raise AssertionError(
            f"{_name(fn)} on {n} ranks, S = {numel * 4} bytes: ranks sent {sent} bytes; "
            f"each should send 2(N-1)/N·S = {want}: one chunk of S/N to each of the N-1 "
            "other ranks in the reduce-scatter, and again in the all-gather.")


def _ones_through(fn, numel):
    return fn(torch.ones(numel))


def _calls(used: dict) -> str:
    return ", ".join(f"dist.{op} ({n}x)" for op, n in used.items()) or "no collective"


def _show(t) -> str:
    return "[" + ", ".join(f"{v:g}" for v in t.reshape(-1).tolist()) + "]"
