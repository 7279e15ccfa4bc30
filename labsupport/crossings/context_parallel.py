"""Chapter 6's time beside bytes: one ring step's attention against passing its K/V block on.

    c = crossings.run("context_parallel")   # on 2 gloo ranks, started or reused here
    c.sizes, c.compute, c.comm               # block length c (tokens per rank); seconds
                                             # of one block's attention and of one transfer
    c.measured, c.formula                    # where they cross: measured, α-β formula
    c.extra["speedup"]                       # ring forward without / with overlap, by size
    c.extra["overlap_speedup_large_block"]   # the speed-up at the first block whose
                                             # compute outlasts its transfer twice
    c.extra["events"][size]                  # {overlap: the forward's timeline, both ranks}

A ring step computes a block's attention, 4·c²·h FLOPs for QKᵀ and PV with
h = a·d, while it passes the block's `k` and `v` on, 2·c·h·e bytes: the
transfer can hide behind the compute from c* = e/2 · C/W on
(``overlap.cp_min_block``; Liu et al. 2023, arXiv 2310.01889, §3). The
forward of chapter 6 (``ring_attention.ring_forward``, b = 1, float32,
full attention) runs at each block length without and with overlap,
alternating, the sizes taking turns. Without overlap the transfer is posted
after the compute, so the recorded timeline gives each apart: the compute
(the block's attention spans) and the transfer (of the two ranks, the one
that arrived last, whose wait is the transfer's alone). The formula's
crossing uses C, the attention's own FLOP/s at the three largest blocks,
and this link's α and β fitted to the measured transfers (``sweep``'s
α-β fit): on loopback the latency α matters at small blocks, which the
bandwidth-only c* (``extra["bandwidth_only"]``) ignores.
"""
import statistics

from labsupport import overlap
from labsupport.crossings import Crossing, curves

SIZES = {False: [16, 32, 64, 128, 256, 512, 1024], True: [32, 128, 256, 512]}
REPEATS = {False: 5, True: 5}
HEADS, HEAD_DIM, WORLD_SIZE = 4, 64, 2


def sweep(small: bool = False, sizes=None, repeats=None) -> Crossing:
    """Measure each block length (tokens per rank) on 2 gloo ranks."""
    from labsupport.launch.session import run

    sizes, repeats = sizes or SIZES[small], repeats or REPEATS[small]
    if any(c < 1 for c in sizes) or len(sizes) < 2 or repeats < 1:
        raise ValueError(f"need at least 2 positive block lengths and repeats >= 1; "
                         f"got {sizes}, {repeats}")
    by_rank = run(measure, sizes, repeats, world_size=WORLD_SIZE, backend="gloo")
    return summarise(sizes, by_rank)


def measure(sizes, repeats) -> list:
    """On a rank, for each block length: the seconds of each forward without
    and with overlap, and the events of each (attention spans, transfers)."""
    import torch
    import torch.distributed as dist

    import labsupport as ls
    torch.manual_seed(dist.get_rank())
    blocks = [[torch.randn(1, HEADS, c, HEAD_DIM, device=ls.device()) for _ in range(3)]
              for c in sizes]
    rows = [dict(seconds={False: [], True: []}, events={False: [], True: []})
            for _ in sizes]
    for qkv in blocks:                                   # warm-up, not kept
        _timed_forward(qkv, True)
    for _ in range(repeats):
        for row, qkv in zip(rows, blocks):
            for on in (False, True):
                seconds, events = _timed_forward(qkv, on)
                row["seconds"][on].append(seconds)
                row["events"][on].append(events)
    return rows


def _timed_forward(qkv, overlap_on):
    """One ring forward between barriers: seconds, and its timeline's events."""
    import torch.distributed as dist

    from labsupport import ring_attention, timeline
    tl = timeline.Timeline(dist.get_rank(), qkv[0].device)
    dist.barrier()
    start = tl.now()
    ring_attention.ring_forward(*qkv, overlap=overlap_on, tl=tl)
    seconds = tl.now() - start
    return seconds, tl.events


def _spans(events, lane):
    return [e["end"] - e["start"] for e in events if e["lane"] == lane]


def summarise(sizes, by_rank) -> Crossing:
    """The two measured curves, their crossing, the formula's, the speed-ups."""
    def transfers(runs):  # one run's time waiting for k/v blocks
        return [sum(_spans(run, "comm")) for run in runs]

    compute, comm, speedup, events = curves(sizes, by_rank, transfers)
    return _crossing(sizes, compute, comm, speedup, events)


def _crossing(sizes, compute, comm, speedup, events) -> Crossing:
    from labsupport.sweep import fit_alpha_beta

    h, e = HEADS * HEAD_DIM, 4
    flops = [4 * c * c * h for c in sizes]
    own = statistics.median(f / t for f, t in list(zip(flops, compute))[-3:])
    alpha, beta = fit_alpha_beta([2 * c * h * e for c in sizes], comm)
    model = dict(compute=[f / own for f in flops],
                 comm=[alpha + 2 * c * h * e / beta for c in sizes])
    formula = overlap.crossing(lambda c: 4 * c * c * h / own,
                               lambda c: alpha + 2 * c * h * e / beta, 1, 1e6)
    # past the crossing: the first block whose compute takes twice its transfer
    large = next((c for c, a, b in zip(sizes, compute, comm) if a >= 2 * b), None)
    here = overlap.Hardware("this machine", own, beta, beta, WORLD_SIZE, "measured")
    return Crossing(
        technique="context_parallel", size_label="tokens per rank c (block length)",
        sizes=list(sizes), compute=compute, comm=comm,
        measured=overlap.measured_crossing(sizes, compute, comm), formula=formula,
        extra=dict(flops_per_s=own, alpha=alpha, bytes_per_s=beta, model=model,
                   bandwidth_only=overlap.cp_min_block(here, act_bytes=e),
                   speedup=speedup, large_block=large,
                   overlap_speedup_large_block=speedup[sizes.index(large)] if large else None,
                   events=events))
