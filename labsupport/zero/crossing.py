"""Chapter 7's time beside bytes: a ZeRO-3 unit's forward against the all-gather of the next.

    c = crossing.sweep()          # on 2 gloo ranks, started or reused here
    c.sizes, c.compute, c.comm          # tokens per rank; seconds of one block's
                                        # forward and of one block's all-gather
    c.measured, c.formula               # where they cross: measured, formula
    c.extra["speedup"]                  # forward time without / with prefetch, by size
    c.extra["events"][size]             # {prefetch: the forward's timeline, both ranks}

With prefetch (``labsupport.zero.zero.Zero3``), the all-gather of the next unit
moves while this unit computes, so it can hide when a unit's forward, 2·T·P
FLOPs for T tokens per rank and P parameters, outlasts the all-gather of the
next unit's P parameters, (N-1)/N·P·e bytes: from T* = (N-1)/N · e/2 · C/W
tokens per rank on (``overlap.zero3_min_tokens``; Ultra-Scale Playbook A3).

Each size is measured on the shared decoder (fp32, every block a unit), the
forwards without and with prefetch taking turns, first one then the other
in alternate repeats, after an untimed forward of the same size (the first
forward after another size pays for its new buffers, which would favour
whichever came second); the sizes take turns too. Without prefetch the
recorded timeline gives each block's forward (hooks around it, after its
all-gather) and each block's all-gather (``calls.record``, call to return;
of the two ranks, the one that arrived last, whose time is the transfer's
alone), neither hiding the other. The formula's crossing is an independent
prediction: C is the blocks' own FLOP/s at the three largest sizes
(``overlap.decoder_flops`` of one layer), and the all-gather's α and β are
fitted to ``sweep``'s all-gathers of LINK_BYTES on the same ranks, timed
between the repeats: a block's forward T·F/C meets α + S/β, S the block's
bytes. The speed-up is the median over the pairs of forwards of the
slowest rank's time without prefetch over its time with prefetch; at best
prefetch hides, per block, the shorter of its forward and its all-gather
(``bound``).
"""
import statistics

from labsupport import overlap
from labsupport import sweep as bandwidth_sweep
from labsupport.crossings import Crossing, curves

SIZES = {False: [16, 32, 64, 128, 256, 512], True: [16, 128, 512]}
REPEATS = {False: 7, True: 3}
SHAPE = dict(vocab_size=64, seq_len=16, hidden=512, heads=4, layers=4)
WORLD_SIZE = 2
LINK_BYTES = [1 << k for k in range(16, 25, 2)]        # 64 KiB .. 16 MiB (a block: 12.6 MB)


def sweep(small: bool = False, sizes=None, repeats=None) -> Crossing:
    """Measure each size (tokens per rank, multiples of SHAPE's seq_len) on 2 gloo ranks."""
    from labsupport.launch.session import run

    sizes, repeats = sizes or SIZES[small], repeats or REPEATS[small]
    if any(t % SHAPE["seq_len"] or t <= 0 for t in sizes) or repeats < 1:
        raise ValueError(f"sizes must be positive multiples of {SHAPE['seq_len']} tokens "
                         f"and repeats at least 1; got {sizes}, {repeats}")
    by_rank = run(measure, sizes, repeats, SHAPE, world_size=WORLD_SIZE, backend="gloo")
    return summarise(sizes, by_rank, SHAPE, WORLD_SIZE)


def measure(sizes, repeats, shape) -> dict:
    """On a rank, for each size: the seconds of each forward without and with
    prefetch, and the events of each (block forwards, all-gathers); and the
    link's all-gather times (seconds by LINK_BYTES) after each repeat. The
    sizes take turns in each repeat, so that a burst of load on a shared
    machine falls on all of them rather than on one."""
    from labsupport import models
    from labsupport.zero import zero
    cfg = models.GPTConfig(**shape)
    wrapped = {on: zero.Zero3(gpt, gpt.blocks, prefetch=on)
               for on, gpt in ((False, models.GPT(cfg)), (True, models.GPT(cfg)))}
    data = [models.toy_tokens(t // cfg.seq_len, cfg.seq_len, cfg.vocab_size, seed=1)
            for t in sizes]
    rows = [dict(seconds={False: [], True: []}, events={False: [], True: []},
                 block_params=wrapped[False].flats[0].numel) for _ in sizes]
    link = []
    for r in range(repeats):
        for row, (ids, targets) in zip(rows, data):
            _recorded_forward(wrapped[r % 2 == 1], ids, targets)   # untimed
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                seconds, events = _recorded_forward(wrapped[on], ids, targets)
                row["seconds"][on].append(seconds)
                row["events"][on].append(events)
        link.append([t for t, _, _ in bandwidth_sweep.measure(
            {"ag": "all_gather"}, LINK_BYTES, 1, 3)["ag"]])
    return dict(rows=rows, link=[statistics.median(col) for col in zip(*link)])


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


def bound(a, b, blocks=SHAPE["layers"]) -> float:
    """The most prefetch can speed up a forward of ``blocks`` units of compute
    a and all-gather b each: blocks·(a + b) without; with it, the first
    gather, then each block's max(a, b), the last block's compute alone."""
    return blocks * (a + b) / (b + (blocks - 1) * max(a, b) + a)


def summarise(sizes, by_rank, shape, world_size) -> Crossing:
    """The two measured curves, their crossing, the formula's, the speed-ups."""
    def gathers(runs):  # each block's all-gather, in every run
        return [e["end"] - e["start"] for run in runs for e in run if e.get("block")]

    compute, comm, speedup, events = curves(sizes, [r["rows"] for r in by_rank], gathers)
    params = by_rank[0]["rows"][0]["block_params"]
    h, s, f = shape["hidden"], shape["seq_len"], 4 * shape["hidden"]
    per_token = overlap.decoder_flops(1, s, 1, h, 0, f, backward=False)
    own = statistics.median(t * per_token / c for t, c in list(zip(sizes, compute))[-3:])
    link = overlap.Link(*bandwidth_sweep.fit_alpha_beta(LINK_BYTES, by_rank[0]["link"]))
    compute_s = lambda t: t * per_token / own               # noqa: E731
    gather_s = link.seconds(params * 4)                     # S: the gathered block
    w = link.beta * overlap.ring(world_size)                # W: bytes each rank sends, per s
    here = overlap.Hardware("this machine", own, w, w, world_size, "measured")
    return Crossing(
        technique="zero3", size_label="tokens per rank T", sizes=list(sizes),
        compute=compute, comm=comm,
        measured=overlap.measured_crossing(sizes, compute, comm),
        formula=overlap.crossing(compute_s, lambda t: gather_s, 1e-3, 1e9),
        extra=dict(flops_per_s=own, alpha=link.alpha, beta=link.beta, bytes_per_s=w,
                   block_params=params, gather_s=gather_s,
                   bandwidth_only=overlap.zero3_min_tokens(here, world_size, param_bytes=4),
                   model=dict(compute=[compute_s(t) for t in sizes],
                              comm=[gather_s] * len(sizes)),
                   speedup=speedup, bound=[bound(a, b) for a, b in zip(compute, comm)],
                   events=events))
