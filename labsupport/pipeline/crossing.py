"""Chapter 5's time beside bytes: a stage's forward against sending its activation on,
across the hidden size h.

    c = crossing.sweep(small=True)         # 2 gloo ranks, started or reused
    c.sizes, c.compute, c.comm       # h; seconds of a stage's forward of one
                                     # micro-batch and of sending its output on
    c.measured, c.formula            # where they cross: measured, formula (this machine)

A stage of L layers computes about 2·T·h²·L·k FLOPs on a micro-batch of T
tokens (k·h² weights per layer: 12 in a transformer layer, 1 in the
chapter's Linear(h, h) block) and sends the T·h·e bytes of its output to the
next stage: the send hides behind the next micro-batch's forward once
h > h* = e·C/(2·k·L·W) (``overlap.pp_min_hidden``; Ultra-Scale Playbook A3).
The compute grows as h², the message as h, so a wide enough stage always
wins. Measured here on the chapter's stage (``STAGE_BLOCKS`` blocks of
Linear(h, h) + ReLU, ``TOKENS`` rows a micro-batch) between 2 gloo ranks, by
NCCL's point-to-point rules (one ``batch_isend_irecv`` each, as the
chapter's pipeline posts them; ``LABSUPPORT_P2P=strict`` holds): rank 0
times the stage's forward, then sends the output to rank 1, which sends it
straight back (the gradient of the backward has the same size): one
message takes half the round trip (the ping-pong of OSU's osu_latency), read
from the recorded calls (``calls.record``: rank 0's send posted, its
receive of the reply done). Each time is the median of ``repeats``, the
sizes taking turns. The formula's crossing uses this machine's numbers: C
the forward's FLOP/s at the two largest sizes (where the
FLOPs, not the calls' overhead, take the time), and the link's α and β
(chapter 2's α-β model) fitted to the same ping-pong at ``LINK_BYTES``,
timed between the sizes so that they share the sweep's load: the forward's
2·T·h²·L/C meets α + T·h·e/β.
"""
import statistics

from labsupport import overlap
from labsupport.crossings import Crossing

WORLD_SIZE = 2
TOKENS, STAGE_BLOCKS = 16, 2
SIZES = {False: [32, 64, 128, 256, 512, 1024, 2048, 4096], True: [64, 256, 1024]}  # h
REPEATS = {False: 9, True: 3}
LINK_BYTES = [1 << k for k in range(10, 23, 2)]     # 1 KiB .. 4 MiB


def sweep(small: bool = False, sizes=None, repeats=None) -> Crossing:
    """Measure each hidden size on 2 gloo ranks and find the crossings."""
    from labsupport.launch.session import run

    sizes, repeats = sizes or SIZES[small], repeats or REPEATS[small]
    if any(h < 1 for h in sizes) or repeats < 1:
        raise ValueError(f"hidden sizes and repeats must be positive; got {sizes}, {repeats}")
    by_rank = run(measure, sizes, repeats, TOKENS, STAGE_BLOCKS, world_size=WORLD_SIZE,
                  backend="gloo")
    times = by_rank[0]
    # The link's fit takes each size's least disturbed ping-pong (the minimum over
    # repeats): on a loaded machine a median of 3 could be a wake-up delay at
    # 1 KiB and leave the times flat in the size, with no β to fit.
    return crossing(sizes, [statistics.median(t) for t in times["compute"]],
                    [statistics.median(t) for t in times["comm"]],
                    [min(t) for t in zip(*times["link"])])


def stage(hidden, blocks):
    """The chapter's stage: ``blocks`` blocks of Linear(h, h) + ReLU (DeepMLP's)."""
    from torch import nn

    from labsupport import models
    return nn.Sequential(*models.DeepMLP(hidden, hidden, blocks + 1, 1, seed=0).blocks()[1:-1])


def measure(sizes, repeats, tokens, blocks) -> dict:
    """On rank 0 of 2: the seconds of each forward and each one-way message
    (by size), and of the link's messages after each repeat."""
    import torch

    stages = {h: stage(h, blocks) for h in sizes}
    inputs = {h: torch.randn(tokens, h) for h in sizes}             # (T, h)
    compute = {h: [] for h in sizes}
    comm = {h: [] for h in sizes}
    link = []
    for repeat in range(repeats + 1):          # the first is a warm-up
        for h in sizes:
            c, m = _forward_and_send(stages[h], inputs[h])
            if repeat:
                compute[h].append(c)
                comm[h].append(m)
        link.append([ping_pong(torch.empty(max(n // 4, 1)))[1] for n in LINK_BYTES])
    return dict(compute=[compute[h] for h in sizes], comm=[comm[h] for h in sizes],
                link=link[1:])


def _forward_and_send(module, x):
    """Rank 0: the forward's seconds, then the message's (half the round trip)."""
    import torch
    import torch.distributed as dist

    from labsupport import timing
    dist.barrier()
    seconds = 0.0
    if dist.get_rank() == 0:
        with torch.no_grad():
            module(x)                  # untimed: wakes the thread pool after the barrier
        start = timing.now(x.device)   # the device's clock, not the host's enqueue
        with torch.no_grad():
            y = module(x)                                          # (T, h)
        seconds = timing.now(x.device) - start
    else:
        y = torch.empty_like(x)
    return seconds, ping_pong(y)[1]


def ping_pong(tensor):
    """Rank 0 sends ``tensor`` to rank 1, which sends it back: (the calls, the
    seconds of one message, half of rank 0's round trip from the recorded calls)."""
    import torch.distributed as dist

    from labsupport import calls
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    order = ("isend", "irecv") if rank == 0 else ("irecv", "isend")
    dist.barrier()
    with calls.record() as log:
        for op in order:       # one message at a time, each in its own batch
            p2p = dist.P2POp(getattr(dist, op), tensor, peer)   # dist's, as recorded
            for work in dist.batch_isend_irecv([p2p]):
                work.wait()
    first, last = log.calls[0], log.calls[-1]
    return log.calls, (last["end"] - first["start"]) / 2 if rank == 0 else 0.0


def crossing(sizes, compute, comm, link_seconds, tokens=TOKENS, blocks=STAGE_BLOCKS,
             act_bytes=4) -> Crossing:
    """The measured crossing, and the formula's with this machine's C, α and β."""
    flops = [2 * tokens * blocks * h * h for h in sizes]              # the stage's forward
    c = statistics.median(f / t for f, t in list(zip(flops, compute))[-2:])  # C: the widest
    link = overlap.Link(*_fit(link_seconds))
    model_compute = lambda h: 2 * tokens * blocks * h * h / c   # noqa: E731
    model_comm = lambda h: link.seconds(tokens * h * act_bytes)  # noqa: E731
    here = overlap.Hardware("this machine", c, link.beta, link.beta, WORLD_SIZE, "measured")
    return Crossing(
        "pipeline", "hidden size h", list(sizes), list(compute), list(comm),
        overlap.measured_crossing(sizes, compute, comm),
        overlap.crossing(model_compute, model_comm, 1, 1e7),
        extra=dict(flops_per_s=c, alpha=link.alpha, beta=link.beta, tokens=tokens,
                   blocks=blocks,
                   bandwidth_only=overlap.pp_min_hidden(here, blocks, act_bytes,
                                                        layer_weights=1),
                   model=dict(compute=[model_compute(h) for h in sizes],
                              comm=[model_comm(h) for h in sizes])))


def _fit(link_seconds):
    from labsupport.sweep import fit_alpha_beta
    return fit_alpha_beta(LINK_BYTES, link_seconds)
