"""Bandwidth of collectives over a sweep of message sizes, the nccl-tests way.

    from labsupport import sweep
    rows = sweep.run(cluster, {"gloo": "all_reduce", "ring": ring_allreduce},
                     sweep.sizes(1 << 10, 64 << 20))
    print(sweep.table(rows))
    ring = [r for r in rows if r.label == "ring"]
    alpha, beta = sweep.fit_alpha_beta([r.nbytes for r in ring], [r.seconds for r in ring])

An op is the name of a ``torch.distributed`` collective (see COLLECTIVES) or
any ``fn(tensor)`` that works on one tensor of S bytes in place, like a
hand-written all-reduce (its bus-bandwidth factor is ``kind``'s).

Conventions of nccl-tests (doc/PERFORMANCE.md): S is the size of the largest
buffer (the output of all-gather, the input of reduce-scatter), t the time of
one call on the slowest rank, algbw = S/t, and busbw = algbw times a factor
that makes it comparable with the link's speed whatever N: 2(N-1)/N for
all-reduce, (N-1)/N for all-gather, reduce-scatter, all-to-all, scatter and
gather, 1 for broadcast, reduce and sendrecv (a shift round the ring). Each
size gets warm-up calls, then the median of the repeats (a repeat of a small
size times a batch of calls in a row, as nccl-tests does); ops given together
take turns, so they share the load.
"""
import math
import statistics
import time
from dataclasses import dataclass

from labsupport import timing

BUSBW_FACTOR = {  # N -> factor (nccl-tests, doc/PERFORMANCE.md)
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "scatter": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "sendrecv": lambda n: 1.0,  # every rank sends S right and receives S from the left
}
COLLECTIVES = tuple(BUSBW_FACTOR)
# Small messages are timed in batches of back-to-back calls (nccl-tests times
# 20 in a row), so a rank's late start after the barrier is spread over many.
BATCH_BYTES = 8 << 20  # about this many bytes per timed batch
MAX_BATCH = 20
GB = 1e9  # bandwidths in GB/s, 10^9 bytes per second (book/conventions.md)


@dataclass(frozen=True)
class Row:
    """One op at one size: S in bytes, t in seconds, bandwidths in bytes/s."""
    label: str
    world_size: int
    nbytes: int
    seconds: float
    algbw: float
    busbw: float
    fastest: float = 0.0  # seconds of the fastest and slowest repeat: the spread
    slowest: float = 0.0


def busbw_factor(kind: str, world_size: int) -> float:
    """busbw / algbw for a collective (nccl-tests' convention)."""
    if kind not in BUSBW_FACTOR:
        raise ValueError(f"unknown collective {kind!r}: use one of {', '.join(COLLECTIVES)}")
    return BUSBW_FACTOR[kind](world_size)


def sizes(smallest: int = 1 << 10, largest: int = 64 << 20, step: int = 2) -> list[int]:
    """Message sizes in bytes from smallest to largest, each ``step`` times the last."""
    for name, value in (("smallest", smallest), ("largest", largest), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int (bytes), got {value!r}")
    if step < 2 or largest < smallest:
        raise ValueError(f"need step >= 2 and smallest <= largest, got smallest={smallest}, "
                         f"largest={largest}, step={step}")
    out = [smallest]
    while out[-1] * step <= largest:
        out.append(out[-1] * step)
    return out


def run(cluster, ops, nbytes_list, *, kind: str = "all_reduce", warmup: int = 2,
        repeats: int = 5, dtype=None, timeout: float | None = None) -> list[Row]:
    """Time each op at each size on every rank of ``cluster``; rows by size, then op.

    ``ops`` maps a label to an op (a collective's name or ``fn(tensor)``);
    a single op is labelled by its name.
    """
    ops = _check_ops(ops, kind)
    nbytes_list = _check_sizes(nbytes_list, dtype)
    for name, value, least in (("warmup", warmup, 0), ("repeats", repeats, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    seconds = cluster.run(measure, ops, nbytes_list, warmup, repeats, dtype, timeout=timeout)[0]
    n = cluster.world_size
    return [_row(label, n, s, *seconds[label][i], _kind(op, kind))
            for i, s in enumerate(nbytes_list) for label, op in ops.items()]


def measure(ops, nbytes_list, warmup, repeats, dtype=None) -> dict:
    """On every rank: {label: [(median, fastest, slowest) seconds, by size]}, each
    repeat timed on its slowest rank."""
    import torch
    import torch.distributed as dist

    from labsupport.launch.identity import device

    dtype, medians = dtype or torch.float32, {label: [] for label in ops}
    for nbytes in nbytes_list:
        calls = {label: make_call(op, nbytes, dtype, device()) for label, op in ops.items()}
        for _ in range(warmup):
            for call in calls.values():
                call()
        times = torch.zeros(len(calls), repeats, dtype=torch.float64, device=device())
        batch = max(1, min(MAX_BATCH, BATCH_BYTES // nbytes))
        for r in range(repeats):
            for i, call in enumerate(calls.values()):
                times[i, r] = _timed(call, batch)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a call lasts until its slowest rank
        for label, row in zip(calls, times.cpu()):
            t = row.tolist()
            medians[label].append((statistics.median(t), min(t), max(t)))
    return medians


def make_call(op, nbytes, dtype, device):
    """A no-argument function that runs op once on buffers of S = nbytes.

    For the collectives that split S between the ranks, S is rounded down to
    N equal shares (at least one element each).
    """
    import torch
    import torch.distributed as dist

    n, numel = dist.get_world_size(), max(nbytes // dtype.itemsize, 1)
    rank, right, left = dist.get_rank(), (dist.get_rank() + 1) % n, (dist.get_rank() - 1) % n
    if op in ("all_gather", "reduce_scatter", "all_to_all", "scatter", "gather"):
        numel = max(numel // n, 1) * n  # N equal shares
    big = torch.ones(numel, dtype=dtype, device=device)
    small, out = big[: numel // n].clone(), torch.empty_like(big)
    shares = list(big.chunk(n)) if rank == 0 else None  # the root's N shares
    call = {
        "all_reduce": lambda: dist.all_reduce(big),
        "all_gather": lambda: dist.all_gather_single(big, small),
        "reduce_scatter": lambda: dist.reduce_scatter_single(small, big),
        "all_to_all": lambda: dist.all_to_all_single(out, big),
        "broadcast": lambda: dist.broadcast(big, src=0),
        "reduce": lambda: dist.reduce(big, dst=0),
        "scatter": lambda: dist.scatter(small, shares, src=0),
        "gather": lambda: dist.gather(small, shares, dst=0),
        "sendrecv": lambda: [w.wait() for w in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, big, right), dist.P2POp(dist.irecv, out, left)])],
    }.get(op) if not callable(op) else (lambda: op(big))

    def run_once():
        call()
        timing.sync(big.device)  # on a GPU the call only queued the work
    return run_once


def _timed(call, batch) -> float:
    """Seconds per call of ``batch`` calls in a row, after a barrier."""
    import torch.distributed as dist

    dist.barrier()  # every rank starts together
    start = time.perf_counter()
    for _ in range(batch):
        call()
    return (time.perf_counter() - start) / batch


def _row(label, world_size, nbytes, seconds, fastest, slowest, kind) -> Row:
    algbw = nbytes / seconds
    return Row(label, world_size, nbytes, seconds, algbw,
               algbw * busbw_factor(kind, world_size), fastest, slowest)


def _kind(op, kind):
    return kind if callable(op) else op


def _check_ops(ops, kind) -> dict:
    busbw_factor(kind, 2)  # a clear error for an unknown kind
    if callable(ops) or isinstance(ops, str):
        ops = {getattr(ops, "__name__", str(ops)): ops}
    if not isinstance(ops, dict) or not ops:
        raise TypeError("ops must be a collective's name, a fn(tensor), or a dict of them "
                        f"by label, got {type(ops).__name__}")
    for op in ops.values():
        if not callable(op):
            busbw_factor(op, 2)
    return dict(ops)


def _check_sizes(nbytes_list, dtype) -> list[int]:
    itemsize = 4 if dtype is None else dtype.itemsize
    nbytes_list = list(nbytes_list)
    if not nbytes_list:
        raise ValueError("no message sizes given: pass e.g. sweep.sizes(1 << 10, 1 << 20)")
    for s in nbytes_list:
        if isinstance(s, bool) or not isinstance(s, int) or s < itemsize:
            raise ValueError(f"message sizes are ints of at least one element ({itemsize} "
                             f"bytes), got {s!r}")
    return nbytes_list


def fit_alpha_beta(nbytes, seconds) -> tuple[float, float]:
    """Fit the α-β (Hockney) model t = α + S/β; return (α in s, β in bytes/s).

    Hockney (1994), "The communication challenge for MPP: Intel Paragon and
    Meiko CS-2", Parallel Computing 20(3). Least squares on the *relative*
    error, so the microsecond points count as much as the 100 ms ones, with
    α >= 0 (noisy small sizes can otherwise pull it below zero).
    """
    import numpy as np

    s, t = np.asarray(nbytes, dtype=float), np.asarray(seconds, dtype=float)
    if s.shape != t.shape or s.ndim != 1 or len(s) < 2:
        raise ValueError("need two equally long lists of at least 2 sizes and times")
    if not (np.all(s > 0) and np.all(t > 0)):
        raise ValueError("sizes and times must be positive")
    design = np.stack([np.ones_like(s), s], axis=1) / t[:, None]
    (alpha, per_byte), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if alpha < 0:  # the best fit with α = 0: one parameter, closed form
        alpha, per_byte = 0.0, float(design[:, 1].sum() / (design[:, 1] ** 2).sum())
    if per_byte <= 0:
        raise ValueError("the times do not grow with the size: measure larger messages")
    return float(alpha), float(1 / per_byte)


def format_size(nbytes: int) -> str:
    """1024 -> '1 KiB', 3 << 20 -> '3 MiB'; other sizes in bytes."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def table(rows: list[Row]) -> str:
    """Rows as text; the measured fields come last, unpadded, as ``took 1.2 ms``
    and ``0.5 GB/s``, so that nbval's sanitizer masks them and nothing else."""
    width = max(len(r.label) for r in rows)
    lines = [f"{'op':<{width}}  {'N':>2}  {'size':>8}  time, algbw, busbw"]
    for r in rows:
        lines.append(f"{r.label:<{width}}  {r.world_size:>2}  {format_size(r.nbytes):>8}  "
                     f"took {_ms(r.seconds)}, {r.algbw / GB:.3g} GB/s, "
                     f"{r.busbw / GB:.3g} GB/s")
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def ratio(rows: list[Row], label: str, baseline: str, nbytes: int) -> float:
    """busbw of ``label`` over busbw of ``baseline`` at one size."""
    pick = {r.label: r.busbw for r in rows if r.nbytes == nbytes}
    missing = [x for x in (label, baseline) if x not in pick]
    if missing:
        raise ValueError(f"no row for {missing} at {format_size(nbytes)}")
    return pick[label] / pick[baseline] if pick[baseline] > 0 else math.inf
