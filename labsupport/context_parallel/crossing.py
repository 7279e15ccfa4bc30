"""Chapter 6's time beside bytes: one ring step's attention against passing its K/V block on.

    c = crossing.sweep()   # on 2 gloo ranks, started or reused here
    c.sizes, c.compute, c.comm               # block length c (tokens per rank); seconds
                                             # of one block's attention and of one transfer
    c.measured, c.formula                    # where they cross: measured, α-β formula
    c.extra["speedup"], c.extra["bound"]     # ring forward without / with overlap, by
                                             # size, and the most overlap can give there
    c.extra["speedup_range"]                 # (least, most) over the pairs of forwards
    c.extra["large_block"]                   # the first block past the measured crossing
    c.extra["overlap_speedup_large_block"]   # its speed-up (None: no block past it)
    c.extra["events"][size]                  # {overlap: the forward's timeline, both ranks}

A ring step computes a block's attention, 4·c²·h FLOPs for QKᵀ and PV with
h = a·d, while it passes the block's `k` and `v` on, 2·c·h·e bytes: the
transfer can hide behind the compute from c* = e/2 · C/W on
(``overlap.cp_min_block``; Liu et al. 2023, arXiv 2310.01889, §3). The
forward of chapter 6 (``ring_attention.ring_forward``, b = 1, float32,
full attention) runs at each block length without and with overlap.
Without overlap the transfer is posted after the compute, so the recorded
timeline gives each apart: the compute (the block's attention spans) and
the transfer (of the two ranks, the one that arrived last, whose wait is
the transfer's alone).

The formula's crossing is an independent prediction: C is the attention's
own FLOP/s at the three largest blocks, and α and β are fitted to
``sweep``'s exchanges of one buffer with both neighbours (``sendrecv``, what
``ring_exchange`` does), timed between the repeats on the same ranks but
apart from the ring, so measured / formula tests the α-β model.

The speed-up's bound: N steps of compute a and N-1 transfers b take
N·a + (N-1)·b without overlap and at best a + (N-1)·max(a, b) with it
(the last step has nothing left to send), so no overlap can beat
(N·a + (N-1)·b) / (a + (N-1)·max(a, b)), largest where a = b:
(2N-1)/N, x1.5 on 2 ranks. ``extra["bound"]`` evaluates it for each pair of
forwards from that pair's own times (``_pair_bound``): the forward without
overlap less what overlap could hide, so that a forward slowed by a stall
in its transfer, or by a late peer, is weighed with its own bound; the
median over the pairs.
"""
import statistics

from labsupport import overlap
from labsupport import sweep as bandwidth_sweep
from labsupport.crossings import Crossing, curves

SIZES = {False: [32, 64, 128, 256], True: [32, 64, 128]}   # c; larger: seconds a sweep
REPEATS = {False: 7, True: 4}
HEADS, HEAD_DIM, WORLD_SIZE = 32, 64, 2     # h = 2,048: milliseconds at the crossing
ELEMENT = 4                                 # float32
LINK_BYTES = [1 << k for k in range(17, 24, 2)]        # 128 KiB .. 8 MiB: the blocks


def sweep(small: bool = False, sizes=None, repeats=None) -> Crossing:
    """Measure each block length (tokens per rank) on 2 gloo ranks."""
    from labsupport.launch.session import run

    sizes, repeats = sizes or SIZES[small], repeats or REPEATS[small]
    if any(c < 1 for c in sizes) or len(sizes) < 2 or repeats < 1:
        raise ValueError(f"need at least 2 positive block lengths and repeats >= 1; "
                         f"got {sizes}, {repeats}")
    by_rank = run(measure, sizes, repeats, world_size=WORLD_SIZE, backend="gloo")
    return summarise(sizes, by_rank)


def measure(sizes, repeats) -> dict:
    """On a rank, for each block length: start, end and events of each forward
    without and with overlap; and the link's exchange times after each repeat."""
    import torch
    import torch.distributed as dist

    from labsupport.launch import identity
    torch.manual_seed(dist.get_rank())
    blocks = [[torch.randn(1, HEADS, c, HEAD_DIM, device=identity.device()) for _ in range(3)]
              for c in sizes]
    rows = [dict(start={False: [], True: []}, end={False: [], True: []},
                 events={False: [], True: []}) for _ in sizes]
    link = []
    for r in range(repeats):
        for row, qkv in zip(rows, blocks):
            # Untimed first: the first forward after another size pays for its new
            # buffers (the allocator's page faults), which would favour the second.
            _timed_forward(qkv, False)
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                for key, value in zip(("start", "end", "events"),
                                      _timed_forward(qkv, on)):
                    row[key][on].append(value)
        link.append([t for t, _, _ in bandwidth_sweep.measure(
            {"kv": "sendrecv"}, LINK_BYTES, 1, 3)["kv"]])
    return dict(rows=rows, link=[statistics.median(col) for col in zip(*link)])


def _timed_forward(qkv, overlap_on):
    """One ring forward after a barrier: its start and end (the ranks' shared
    clock), and its timeline's events."""
    import torch.distributed as dist

    from labsupport import timeline
    from labsupport.context_parallel import ring_attention
    tl = timeline.Timeline(dist.get_rank(), qkv[0].device)
    dist.barrier()
    start = tl.now()
    ring_attention.ring_forward(*qkv, overlap=overlap_on, tl=tl)
    return start, tl.now(), tl.events


def _spans(events, lane):
    return [e["end"] - e["start"] for e in events if e["lane"] == lane]


def _seconds(by_rank):
    """Each rank's rows with the seconds of each forward counted from the last
    rank's start: nothing can move before both have left the barrier, so a
    rank that left it early does not count its wait as the ring's time."""
    out = []
    for rank in by_rank:
        rows = []
        for i, row in enumerate(rank["rows"]):
            starts = {on: list(map(max, zip(*(r["rows"][i]["start"][on] for r in by_rank))))
                      for on in (False, True)}
            rows.append(dict(events=row["events"], seconds={
                on: [end - s for end, s in zip(row["end"][on], starts[on])]
                for on in (False, True)}))
        out.append(rows)
    return out


def bound(a, b, n=WORLD_SIZE) -> float:
    """The most overlap can speed up a ring forward of n steps of compute a
    and n-1 transfers b: (n·a + (n-1)·b) / (a + (n-1)·max(a, b))."""
    return (n * a + (n - 1) * b) / (a + (n - 1) * max(a, b))


def _pair_bound(seconds, runs):
    """``bound`` for one forward without overlap, from its own times: it took
    ``seconds`` (the slowest rank's); a rank's overlap can hide at most, at
    each step but the last, the shorter of that step's compute and its wait
    (a wait that may also hold a late peer), so the forward takes at least
    ``seconds`` less the most any rank ("runs": each rank's events) could
    hide. Equal to ``bound(a, b)`` when each rank took n·a + (n-1)·b."""
    def span(run, lane, step):
        return sum(e["end"] - e["start"] for e in run
                   if e["lane"] == lane and e.get("step") == step)
    hidden = max(sum(min(span(run, "compute", s), span(run, "comm", s))
                     for s in {e["step"] for e in run if e["lane"] == "comm"})
                 for run in runs)
    return seconds / (seconds - hidden)


def summarise(sizes, by_rank) -> Crossing:
    """The two measured curves, their crossing, the formula's, the speed-ups."""
    def transfers(runs):  # one run's time waiting for k/v blocks
        return [sum(_spans(run, "comm")) for run in runs]

    per_rank = _seconds(by_rank)
    compute, comm, speedup, events = curves(sizes, per_rank, transfers)
    out = _crossing(sizes, compute, comm, speedup, events, by_rank[0]["link"])
    slowest = [{on: list(map(max, zip(*(r[i]["seconds"][on] for r in per_rank))))
                for on in (False, True)} for i in range(len(sizes))]
    ratios = [[a / b for a, b in zip(s[False], s[True])] for s in slowest]
    out.extra["speedup_range"] = [(min(r), max(r)) for r in ratios]   # over the pairs
    out.extra["bound"] = [statistics.median(
        _pair_bound(t, [r["rows"][i]["events"][False][k] for r in by_rank])
        for k, t in enumerate(s[False])) for i, s in enumerate(slowest)]
    return out


def _crossing(sizes, compute, comm, speedup, events, link_seconds) -> Crossing:
    h, e = HEADS * HEAD_DIM, ELEMENT
    flops = [4 * c * c * h for c in sizes]
    own = statistics.median(f / t for f, t in list(zip(flops, compute))[-3:])
    link = overlap.Link(*bandwidth_sweep.fit_alpha_beta(LINK_BYTES, link_seconds))
    compute_s = lambda c: 4 * c * c * h / own              # noqa: E731
    comm_s = lambda c: link.seconds(2 * c * h * e)         # noqa: E731
    measured = overlap.measured_crossing(sizes, compute, comm)
    # where overlap can pay most: the first block whose compute outlasts its transfer
    large = next((c for c, a, b in zip(sizes, compute, comm) if a >= b), None)
    here = overlap.Hardware("this machine", own, link.beta, link.beta, WORLD_SIZE,
                            "measured")
    return Crossing(
        technique="context_parallel", size_label="tokens per rank c (block length)",
        sizes=list(sizes), compute=compute, comm=comm, measured=measured,
        formula=overlap.crossing(compute_s, comm_s, 1, 1e6),
        extra=dict(flops_per_s=own, alpha=link.alpha, bytes_per_s=link.beta,
                   model=dict(compute=[compute_s(c) for c in sizes],
                              comm=[comm_s(c) for c in sizes]),
                   bandwidth_only=overlap.cp_min_block(here, act_bytes=e),
                   speedup=speedup,
                   large_block=large,
                   overlap_speedup_large_block=speedup[sizes.index(large)] if large else None,
                   events=events))
