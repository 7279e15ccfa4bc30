"""Chapter 7's time beside bytes: a ZeRO-3 unit's forward against the all-gather of the next.

    c = crossings.run("zero3")          # on 2 gloo ranks, started or reused here
    c.sizes, c.compute, c.comm          # tokens per rank; seconds of one block's
                                        # forward and of one block's all-gather
    c.measured, c.formula               # where they cross: measured, formula
    c.extra["speedup"]                  # forward time without / with prefetch, by size
    c.extra["events"][size]             # {prefetch: the forward's timeline, both ranks}

With prefetch (``labsupport.zero.Zero3``), the all-gather of the next unit
moves while this unit computes, so it can hide when a unit's forward, 2·T·P
FLOPs for T tokens per rank and P parameters, outlasts the all-gather of the
next unit's P parameters, (N-1)/N·P·e bytes: from T* = (N-1)/N · e/2 · C/W
tokens per rank on (``overlap.zero3_min_tokens``; Ultra-Scale Playbook A3).

Each size is measured on the shared decoder (fp32, every block a unit), the
forwards without and with prefetch alternating, the sizes taking turns. Without prefetch the
recorded timeline gives each block's forward (hooks around it, after its
all-gather) and each block's all-gather (``calls.record``, call to return;
of the two ranks, the one that arrived last, whose time is the transfer's
alone), neither hiding the other. C is the blocks' own FLOP/s at the three
largest sizes (``overlap.decoder_flops`` of one layer), W the all-gather's
bytes per rank over its median time; the speed-up is the median over the
pairs of forwards of the slowest rank's time without prefetch over its time
with prefetch.
"""
import statistics

from labsupport import overlap
from labsupport.crossings import Crossing, curves

SIZES = {False: [16, 32, 64, 128, 256, 512, 1024], True: [16, 128, 1024]}
REPEATS = {False: 7, True: 3}
SHAPE = dict(vocab_size=64, seq_len=16, hidden=192, heads=4, layers=4)
WORLD_SIZE = 2


def sweep(small: bool = False, sizes=None, repeats=None) -> Crossing:
    """Measure each size (tokens per rank, multiples of SHAPE's seq_len) on 2 gloo ranks."""
    from labsupport.launch.session import run

    sizes, repeats = sizes or SIZES[small], repeats or REPEATS[small]
    if any(t % SHAPE["seq_len"] or t <= 0 for t in sizes) or repeats < 1:
        raise ValueError(f"sizes must be positive multiples of {SHAPE['seq_len']} tokens "
                         f"and repeats at least 1; got {sizes}, {repeats}")
    by_rank = run(measure, sizes, repeats, SHAPE, world_size=WORLD_SIZE, backend="gloo")
    return summarise(sizes, by_rank, SHAPE, WORLD_SIZE)


def measure(sizes, repeats, shape) -> list:
    """On a rank, for each size: the seconds of each forward without and with
    prefetch, and the events of the last pair (block forwards, all-gathers).
    The sizes take turns in each repeat, so that a burst of load on a shared
    machine falls on all of them rather than on one."""
    from labsupport import models, zero
    cfg = models.GPTConfig(**shape)
    wrapped = {on: zero.Zero3(gpt, gpt.blocks, prefetch=on)
               for on, gpt in ((False, models.GPT(cfg)), (True, models.GPT(cfg)))}
    data = [models.toy_tokens(t // cfg.seq_len, cfg.seq_len, cfg.vocab_size, seed=1)
            for t in sizes]
    rows = [dict(seconds={False: [], True: []}, events={False: [], True: []},
                 block_params=wrapped[False].flats[0].numel) for _ in sizes]
    for model in wrapped.values():                      # warm-up, not kept
        _recorded_forward(model, *data[-1])
    for _ in range(repeats):
        for row, (ids, targets) in zip(rows, data):
            for on, model in wrapped.items():
                seconds, events = _recorded_forward(model, ids, targets)
                row["seconds"][on].append(seconds)
                row["events"][on].append(events)
    return rows


def _recorded_forward(model, ids, targets):
    """One forward (its graph dropped): seconds, and its timeline events."""
    import torch.distributed as dist

    from labsupport import calls, timeline
    tl = timeline.Timeline(device=ids.device)   # the clock: the device's (labsupport.timing)
    handles = _time_blocks(model.module.blocks, tl)
    dist.barrier()
    with calls.record() as log:
        start = tl.now()
        model(ids, targets)
        seconds = tl.now() - start
    for h in handles:
        h.remove()
    unit = model.flats[0].data.numel() * model.flats[0].data.element_size()
    for c in log.calls:
        if c["op"] == "all_gather_single":
            tl.record("comm", "all-gather", c["start"], c["end"],
                      block=c["nbytes"] == unit)
    return seconds, tl.events


def _time_blocks(blocks, tl) -> list:
    """Hooks that record each block's forward: a pre-hook after Zero3's (which
    gathers), a hook before Zero3's (which frees)."""
    starts, handles = {}, []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(
            lambda m, args: starts.__setitem__(m, tl.now())))
        handles.append(block.register_forward_hook(
            lambda m, args, out, i=i: tl.record("compute", f"block {i}", starts[m],
                                                 tl.now()), prepend=True))
    return handles


def summarise(sizes, by_rank, shape, world_size) -> Crossing:
    """The two measured curves, their crossing, the formula's, the speed-ups."""
    def gathers(runs):  # each block's all-gather, in every run
        return [e["end"] - e["start"] for run in runs for e in run if e.get("block")]

    compute, comm, speedup, events = curves(sizes, by_rank, gathers)
    params = by_rank[0][0]["block_params"]
    h, s, f = shape["hidden"], shape["seq_len"], 4 * shape["hidden"]
    flops = [overlap.decoder_flops(t, s, 1, h, 0, f, backward=False) for t in sizes]
    own = statistics.median(n / c for n, c in list(zip(flops, compute))[-3:])
    w = overlap.ring(world_size) * params * 4 / statistics.median(comm)
    here = overlap.Hardware("this machine", own, w, w, world_size, "measured")
    return Crossing(
        technique="zero3", size_label="tokens per rank T", sizes=list(sizes),
        compute=compute, comm=comm,
        measured=overlap.measured_crossing(sizes, compute, comm),
        formula=overlap.zero3_min_tokens(here, world_size, param_bytes=4),
        extra=dict(flops_per_s=own, bytes_per_s=w, block_params=params,
                   speedup=speedup, events=events))
