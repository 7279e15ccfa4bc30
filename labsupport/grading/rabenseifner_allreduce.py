"""Checks for assignment 1: Rabenseifner's all-reduce, rounds and bytes counted.

    from labsupport.grading import rabenseifner_allreduce as gr
    ls.grading.check_reduce_scatter(halving_reduce_scatter)   # the results: labsupport.grading
    gr.check_rounds(rabenseifner_all_reduce)          # 2*log2(N) rounds, counted from the calls
    gr.check_traffic(rabenseifner_all_reduce)         # 2(N-1)/N*S bytes sent per rank

Rabenseifner's all-reduce (Thakur, Rabenseifner & Gropp, "Optimization of
collective communication operations in MPICH", IJHPCA 2005, Sec. 4.4) is a
reduce-scatter by recursive halving followed by an all-gather by recursive
doubling, for N a power of two. It sends the bytes of the ring, 2(N-1)/N*S
per rank, in 2*log2(N) rounds where the ring needs 2(N-1): the same
bandwidth term, a smaller latency term (alpha-beta model, their eq. for
"recursive halving"). Its results are checked by ``labsupport.grading``'s
``check_reduce_scatter``, ``check_all_gather`` and ``check_allreduce``,
whose contracts (chunk ``rank`` of ``tensor.tensor_split(world_size)``) it
meets; this module adds what is particular to it.

A *round* is counted from the point-to-point calls each rank makes
(recorded by ``labsupport.calls``), in call order: a run of sends to one
partner, ended by a receive or by a send to another rank (a rank has one
link out: sending to three ranks one after the other takes three rounds).
The rounds of a function are the most any rank makes.
"""
import math

import torch
import torch.distributed as dist

from labsupport.calls import record as record_calls
from labsupport.checking import collective_checks
from labsupport.checking.collective_checks import WORLD_SIZES  # (2, 4): one home
from labsupport.checking.diagnosis import name_of
from labsupport.launch.session import current

SIZES = (8, 10, 13)  # 10 and 13 are not divisible by 4
PHASES = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}  # log2(N) rounds each
_TITLES = {"all_reduce": "all-reduce", "reduce_scatter": "recursive-halving reduce-scatter",
           "all_gather": "recursive-doubling all-gather"}


def count_rounds(calls: list[tuple[str, int]]) -> int:
    """Rounds of one rank's ``[(op, peer), ...]``: runs of sends to one peer (module doc)."""
    rounds, partner = 0, None
    for op, peer in calls:
        if "send" not in op:
            partner = None
        elif peer != partner:
            rounds, partner = rounds + 1, peer
    return rounds


def check_rounds(fn, kind="all_reduce", world_sizes=WORLD_SIZES, sizes=(8, 13), *,
                 timeout=None):
    """``fn(tensor)`` makes log2(N) rounds per phase: 2*log2(N) for an all-reduce."""
    _validate(kind, world_sizes)
    for world_size in world_sizes:
        for size in sizes:
            calls = _traced(fn, kind, size, world_size, timeout)
            problem = _rounds_problem(fn, kind, world_size, size, calls)
            if problem:
                raise AssertionError(problem)


def check_traffic(fn, kind="all_reduce", world_sizes=WORLD_SIZES, sizes=SIZES, *,
                  timeout=None):
    """``fn(tensor)`` sends k(N-1)/N*S bytes per rank with send/isend (k = 2 for an
    all-reduce, 1 for either half), every rank within one chunk of it, S in total k(N-1)."""
    _validate(kind, world_sizes)
    for world_size in world_sizes:
        for size in sizes:
            sent = [c["sent"] for c in _run(fn, kind, size, world_size, timeout)]
            problem = _traffic_problem(fn, kind, world_size, size, sent)
            if problem:
                raise AssertionError(problem)


def _validate(kind, world_sizes):
    if kind not in PHASES:
        raise ValueError(f"kind must be one of {sorted(PHASES)}, got {kind!r}")
    bad = [n for n in world_sizes if not (isinstance(n, int) and n >= 1 and n & (n - 1) == 0)]
    if bad or not world_sizes:
        raise ValueError(f"world_sizes must be powers of two (recursive halving pairs rank "
                         f"with rank ^ 2**k), got {world_sizes!r}")


def _run(fn, kind, size, world_size, timeout) -> list[dict]:
    """``collective_checks.run`` of fn on one case; rules checked; the cluster
    restarted after a failure."""
    name = name_of(fn)
    try:
        calls = collective_checks.run(_Traced(fn, kind, size), world_size=world_size,
                                      timeout=timeout)
        collective_checks.assert_rules(calls, name)
        return calls
    except AssertionError:
        if current() is not None:
            current().restart()  # nothing left in flight for the next check
        raise


def _traced(fn, kind, size, world_size, timeout) -> list[list[tuple[str, int]]]:
    return [c["value"] for c in _run(fn, kind, size, world_size, timeout)]


def _rounds_problem(fn, kind, n, size, calls) -> str | None:
    name = name_of(fn)
    phases, log_n = PHASES[kind], int(math.log2(n))
    expected = phases * log_n
    rounds = [count_rounds(c) for c in calls]
    if max(rounds) == expected and min(rounds) == expected:
        return None
    rank = max(range(n), key=lambda r: abs(rounds[r] - expected))
    peers = [peer for op, peer in calls[rank] if "send" in op]
    text = (f"{name} took {rounds[rank]} rounds on rank {rank} of {n} (a tensor of {size} "
            f"elements; every rank: {rounds}); it sent to ranks {peers}, in this order. "
            f"Rabenseifner's {_TITLES[kind]} takes {expected} = {phases if phases > 1 else ''}"
            f"log2(N) rounds: in each round a rank exchanges one message each way with one "
            f"partner, rank ^ distance (distance N/2, N/4, ..., 1 while halving; 1, 2, ..., "
            f"N/2 while doubling).")
    if rounds[rank] == phases * (n - 1) and len(set(peers)) == 1:
        return text + (f" {phases * (n - 1)} = {phases if phases > 1 else ''}(N-1) rounds, "
                       "all to one neighbour, is what a ring takes: its results are right, "
                       "but every round costs a message latency, so on N ranks the ring pays "
                       f"for {phases}(N-1) latencies where recursive halving and doubling "
                       f"pay for {phases}*log2(N).")
    if rounds[rank] > expected:
        return text + (" Each round must halve (or double) the part a rank works on. "
                       "Sending to several ranks one after the other takes one round per "
                       "rank: a rank has one link out.")
    return text + (" Fewer rounds than that means some rank skipped an exchange, or sent "
                   "to every rank at once: count the bytes too (check_traffic).")


def _traffic_problem(fn, kind, n, size, sent) -> str | None:
    name = name_of(fn)
    k = PHASES[kind]
    nbytes = size * 4  # S, float32
    low, high = k * (n - 1) * (size // n) * 4, k * (n - 1) * -(-size // n) * 4
    if sum(sent) == k * (n - 1) * nbytes and all(low <= s <= high for s in sent):
        return None
    rank = max(range(n), key=lambda r: abs(sent[r] - k * (n - 1) * nbytes / n))
    ratio = sent[rank] / nbytes
    formula = f"{k if k > 1 else ''}(N-1)/N*S"
    text = (f"{name} sent too {'many' if ratio > k * (n - 1) / n else 'few'} bytes: on {n} "
            f"ranks with S = {nbytes} bytes ({size} float32), rank {rank} sent {sent[rank]} "
            f"bytes = {ratio:.2f}*S with send/isend (all ranks: {sent}). Recursive halving "
            f"and doubling send {formula} = {k * (n - 1) / n:.2f}*S per rank: half of the "
            f"rank's current part in each round, S/2 + S/4 + ... + S/N per phase.")
    if ratio == 0:
        return text + " No bytes went through dist.send/dist.isend: the data moved some other way."
    if ratio >= n - 1 and ratio > k * (n - 1) / n:  # a phase sent all of S to each rank
        return text + (" At least (N-1)*S: that is what sending the whole tensor to every "
                       "other rank sends (an all-to-all). Each round must send only the half "
                       "the partner keeps.")
    return text


# -- on each rank ----------------------------------------------------------------------

class _Traced:
    """What collective_checks.run runs on a rank: fn on this rank's case, its p2p calls logged."""

    def __init__(self, fn, kind, size):
        self.fn, self.kind, self.size = fn, kind, size
        self.__name__ = name_of(fn)

    def __call__(self):
        rank, world_size = dist.get_rank(), dist.get_world_size()
        g = torch.Generator().manual_seed(1000 * self.size + rank)
        tensor = torch.randint(-9, 10, (self.size,), generator=g).float()
        if self.kind == "all_gather":  # only the rank's own chunk is valid on entry
            own = tensor.tensor_split(world_size)[rank].clone()
            tensor.fill_(float("nan"))
            tensor.tensor_split(world_size)[rank].copy_(own)
        with record_calls() as log:  # inside collective_checks.run's own record: blocks nest
            self.fn(tensor)
        return [(c["op"], c["peer"]) for c in log.calls if c["kind"] == "p2p"]
