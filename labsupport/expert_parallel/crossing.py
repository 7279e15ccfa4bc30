"""Chapter 9's time beside bytes: the experts' compute on a rank against the
dispatch and combine all-to-alls that feed it, across the experts' width f.

    c = crossing.sweep(small=True)         # 2 gloo ranks
    c.sizes, c.compute, c.comm                         # f; seconds of rank 0's
                                                       # experts, of its all-to-alls
    c.measured, c.formula                              # where they cross (f)

Per rank and forward, with a balanced router, T tokens and k choices, the
experts compute 4·T·k·h·f FLOPs (two h x f matmuls per routed row) and the
dispatch and the combine send 2·T·k·h·e·(N-1)/N bytes: the ratio depends on f
alone, and the experts outlast the all-to-alls from f* = (N-1)/N · e/2 · C/W
on (``overlap.ep_min_ffn``; How to Scale Your Model, GPUs, expert
parallelism). Measured on ``labsupport.expert_parallel.moe.ExpertParallelMoE`` (fp32, no
grad, E = 4 experts, k = 2, no capacity) from its recorded timeline: the
"experts" span (compute) and the "dispatch" + "combine" spans (comm), each
the median over ``runs`` forwards after a warm-up. The formula takes C, the
experts' own FLOP/s at the three largest widths (their rows counted, not
assumed), and W, the bytes per rank over the all-to-alls' median time;
``extra["f_matmul"]`` is the crossing with the FLOP/s of one large matmul
(``overlap.matmul_flops``) instead, as cited peaks are.
"""
import statistics

from labsupport import models, overlap, timeline
from labsupport.crossings import Crossing

WORLD_SIZE, EXPERTS, TOP_K, HIDDEN = 2, 4, 2, 64
ACT_BYTES = 4                                          # fp32 rows on the wire
SIZES = {False: dict(ffns=[16, 32, 64, 128, 256, 512], tokens=1024, runs=5),
         True: dict(ffns=[16, 64, 256, 1024], tokens=512, runs=3)}


def sweep(small=False) -> Crossing:
    """Time both on 2 ranks (a group of 2 is started or reused) and find the crossings."""
    from labsupport.launch.session import run

    size = SIZES[small]
    per_rank = run(measure, size["ffns"], size["tokens"], size["runs"],
                   world_size=WORLD_SIZE)
    return crossing(size["ffns"], size["tokens"], *per_rank[0])


def measure(ffns, tokens, runs):
    """On a rank: [(experts s, all-to-alls s, rows computed)] by width, and the
    FLOP/s of one large matmul on this rank's threads."""
    return ([_forward_times(f, tokens, runs) for f in ffns],
            overlap.matmul_flops(2 * tokens, HIDDEN, 256))


def _forward_times(ffn, tokens, runs):
    import torch
    import torch.distributed as dist

    from labsupport.expert_parallel.moe import MoE, ExpertParallelMoE
    from labsupport.timeline import Timeline

    rank = dist.get_rank()
    with models.seeded(0):
        layer = MoE(HIDDEN, ffn, EXPERTS, TOP_K)
    ep = ExpertParallelMoE(layer)
    x = torch.randn(WORLD_SIZE * tokens, HIDDEN, generator=torch.Generator()
                    .manual_seed(4)).chunk(WORLD_SIZE)[rank]
    compute, comm = [], []
    with torch.no_grad():
        for repeat in range(runs + 1):                 # the first: warm-up
            ep.tl = Timeline(rank)
            dist.barrier()
            ep(x)
            events = timeline.merge([ep.tl.events])
            if repeat:
                compute.append(timeline.busy_time(events, rank, "compute"))
                comm.append(timeline.busy_time(events, rank, "comm"))
    return (statistics.median(compute), statistics.median(comm),
            int(ep.tokens_per_expert.sum()))


def crossing(ffns, tokens, times, matmul_flops) -> Crossing:
    """The measured curves' crossing and the formula's with this machine's numbers."""
    compute, comm = [t[0] for t in times], [t[1] for t in times]
    flop = [4 * rows * HIDDEN * f for f, (_, _, rows) in zip(ffns, times)]
    sent = 2 * tokens * TOP_K * HIDDEN * ACT_BYTES * overlap.ring(WORLD_SIZE)
    bandwidth = sent / statistics.median(comm)
    own = statistics.median(n / t for n, t in zip(flop[-3:], compute[-3:]))
    f_own, f_matmul = (overlap.ep_min_ffn(overlap.Hardware(
        "this machine", c, bandwidth, bandwidth, WORLD_SIZE, "measured"),
        WORLD_SIZE, act_bytes=ACT_BYTES) for c in (own, matmul_flops))
    per_f = [n / f for n, f in zip(flop, ffns)]        # FLOPs per unit of f
    return Crossing(
        "expert_parallel", "expert width f", list(ffns), compute, comm,
        overlap.measured_crossing(ffns, compute, comm), f_own,
        extra=dict(tokens=tokens, top_k=TOP_K, hidden=HIDDEN, act_bytes=ACT_BYTES,
                   flops=own, matmul_flops=matmul_flops, bandwidth=bandwidth,
                   sent=sent, f_matmul=f_matmul, rows=[t[2] for t in times],
                   model=dict(compute=[p * f / own for p, f in zip(per_f, ffns)],
                              comm=[sent / bandwidth] * len(ffns))))
