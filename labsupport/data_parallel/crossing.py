"""Chapter 3's time beside bytes: the backward against the gradients' all-reduce,
across the tokens (samples) each rank runs.

    c = crossing.sweep(small=True)         # 2 gloo ranks, started or reused
    c.sizes, c.compute, c.comm      # tokens per rank T; seconds of the backward and
                                    # of the all-reduce of all the gradients
    c.measured, c.formula           # where they cross: measured, formula (this machine)
    c.extra["speedup"]              # step without overlap / step with buckets, by size

The backward of T tokens costs about 4·T·Ψ FLOPs (twice the forward's
2·T·Ψ) and the ring all-reduce of the gradients sends 2(N-1)/N·Ψ·g bytes
per rank, so the all-reduce can hide behind the backward from
T* = (N-1)/N · g/2 · C/W tokens per rank on (``overlap.dp_min_tokens``;
Ultra-Scale Playbook A3). Each size runs chapter 3's ``DataParallelBucket``
(``labsupport.data_parallel.ddp``) on the chapter's model (``DeepMLP``, one token a row)
twice: with one bucket, whose all-reduce starts when the backward is over,
so that neither hides the other, and the recorded timeline
(``ddp_probe.profile_steps``) gives both times (the backward's segments;
the all-reduce from call to completion on the rank that arrived last,
whose time is the transfer's alone), the median over steps, then over
ranks; and with buckets of ``BUCKET`` bytes, whose all-reduces start during
the backward: the speed-up is the step time (median over steps of the
slowest rank) of the first over the second. The formula's crossing uses
this machine's numbers: C the backward's own FLOP/s at the largest sizes
(FLOPs counted by torch's ``FlopCounterMode``), the link's α and β fitted
to all-reduces on the same ranks (chapter 2's α-β model, timed between the
sizes so that they share the sweep's load): the backward's T·F/C meets
α + S/β, the all-reduce of the S gradient bytes.
"""
import statistics

from labsupport import overlap
from labsupport import sweep as bandwidth_sweep
from labsupport.crossings import Crossing
from labsupport.data_parallel import probe as ddp_probe

WORLD_SIZE = 2
SHAPE = dict(d_in=32, width=512, depth=8, d_out=8)      # the chapter's DeepMLP, wider
SIZES = {False: [4, 8, 16, 32, 64, 128, 256, 512], True: [4, 32, 256]}  # tokens per rank
REPEATS = {False: 7, True: 3}
BUCKET = 3 << 20                   # bytes: 3 buckets of this model's 7.4 MB
LINK_BYTES = [1 << k for k in range(16, 25, 2)]        # 64 KiB .. 16 MiB


def sweep(small: bool = False, sizes=None, repeats=None) -> Crossing:
    """Measure each size on 2 gloo ranks and find the crossings."""
    from labsupport.launch.session import run

    sizes, repeats = sizes or SIZES[small], repeats or REPEATS[small]
    if any(t < 1 for t in sizes) or repeats < 1:
        raise ValueError(f"sizes (tokens per rank) and repeats must be positive; "
                         f"got {sizes}, {repeats}")
    by_rank = run(measure, sizes, repeats, SHAPE, world_size=WORLD_SIZE, backend="gloo")
    return summarise(sizes, by_rank, backward_flops_per_token(SHAPE))


def measure(sizes, repeats, shape) -> dict:
    """On a rank: per size, the one-bucket and the bucketed runs' ``profile_steps``,
    and the link's all-reduce times (seconds by ``LINK_BYTES``) after each size."""
    import functools

    import torch.distributed as dist

    from labsupport import models
    from labsupport.data_parallel import ddp
    make = functools.partial(models.DeepMLP, **shape, seed=0)
    versions = {"after": functools.partial(ddp.DataParallelBucket, bucket_size=2**62),
                "overlap": functools.partial(ddp.DataParallelBucket, bucket_size=BUCKET)}
    ops = {"all_reduce": "all_reduce"}
    runs, link = [], []
    for tokens in sizes:
        x, y = models.toy_regression(tokens, shape["d_in"], shape["d_out"], seed=1)
        runs.append(ddp_probe.profile_versions(make, versions, x, y, repeats, warmup=1))
        link.append([t for t, _, _ in
                     bandwidth_sweep.measure(ops, LINK_BYTES, 1, 3)["all_reduce"]])
    grads = sum(p.numel() * p.element_size() for p in make().parameters())
    return dict(runs=runs, link=link, grad_bytes=grads, world_size=dist.get_world_size())


def backward_flops_per_token(shape) -> float:
    """The backward's FLOPs for one token (row), as torch's FlopCounterMode counts them."""
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from labsupport import models
    model = models.DeepMLP(**shape, seed=0)
    x, y = models.toy_regression(1, shape["d_in"], shape["d_out"], seed=1)
    loss = F.mse_loss(model(x), y)
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return counter.get_total_flops()


def _times(step_events):
    """[(backward seconds, all-reduce span)] of each recorded step on a rank."""
    out = []
    for events in step_events:
        backward = sum(e["end"] - e["start"] for e in events if e["name"] == "backward")
        comm = sum(e["end"] - e["start"] for e in events if e["lane"] == "comm")
        out.append((backward, comm))
    return out


def summarise(sizes, by_rank, flops_per_token) -> Crossing:
    """The two measured curves, their crossing, the formula's, the speed-ups."""
    compute, comm, speedup = [], [], []
    for i in range(len(sizes)):
        per_rank = [_times(r["runs"][i]["after"]["step_events"]) for r in by_rank]
        compute.append(statistics.median(
            statistics.median(b for b, _ in steps) for steps in per_rank))
        comm.append(statistics.median(
            min(pair) for pair in zip(*([c for _, c in steps] for steps in per_rank))))
        step = {name: ddp_probe.step_time([r["runs"][i][name] for r in by_rank])
                for name in ("after", "overlap")}
        speedup.append(step["after"] / step["overlap"])
    return crossing(sizes, compute, comm, flops_per_token, by_rank[0]["grad_bytes"],
                    [statistics.median(col) for col in zip(*by_rank[0]["link"])],
                    speedup, by_rank[0]["world_size"])


def crossing(sizes, compute, comm, flops_per_token, grad_bytes, link_seconds,
             speedup=None, world_size=WORLD_SIZE) -> Crossing:
    """The measured crossing, and the formula's with this machine's C and link."""
    link = overlap.Link(*bandwidth_sweep.fit_alpha_beta(LINK_BYTES, link_seconds))
    top = list(zip(sizes, compute))[-3:]
    flops = statistics.median(t * flops_per_token / c for t, c in top)  # C, the backward's
    reduce_s = link.seconds(grad_bytes)
    formula = overlap.crossing(lambda t: t * flops_per_token / flops,
                               lambda t: reduce_s, 1e-3, 1e9)
    busbw = link.beta * 2 * overlap.ring(world_size)     # W: what each rank sends, per s
    here = overlap.Hardware("this machine", flops, busbw, busbw, world_size, "measured")
    return Crossing(
        "data_parallel", "tokens per rank T", list(sizes), list(compute), list(comm),
        overlap.measured_crossing(sizes, compute, comm), formula,
        extra=dict(flops_per_s=flops, alpha=link.alpha, beta=link.beta,
                   grad_bytes=grad_bytes, reduce_s=reduce_s, speedup=speedup,
                   flops_per_token=flops_per_token,
                   bandwidth_only=overlap.dp_min_tokens(here, world_size, grad_bytes=4),
                   model=dict(compute=[t * flops_per_token / flops for t in sizes],
                              comm=[reduce_s] * len(sizes))))
