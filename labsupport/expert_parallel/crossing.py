"""Chapter 9's time beside bytes: the experts' compute on a rank against the
dispatch and combine all-to-alls that feed it, forward and backward, across
the experts' width f.

    c = crossing.sweep(small=True)         # 2 gloo ranks
    c.sizes, c.compute, c.comm                         # f; seconds of a rank's
                                                       # experts, of its all-to-alls
    c.measured, c.formula                              # where they cross (f)
    c.extra["comm_range"]                              # (least, most) over the runs
    c.extra["alpha"], c.extra["beta"]                  # the all-to-all's fit

Per rank and training step, with a balanced router, T tokens and k choices,
the experts compute 12·T·k·h·f FLOPs (two h x f matmuls per routed row,
4·T·k·h·f forward, twice that backward) and four all-to-alls move the rows:
dispatch and combine forward, their reverses backward, 4·T·k·h·e·(N-1)/N
bytes. The ratio depends on f alone: the experts outlast the all-to-alls
from f* = (N-1)/N · e/3 · C/W on (``overlap.ep_min_ffn(backward=True)``).

Measured on ``labsupport.expert_parallel.moe.ExpertParallelMoE`` (fp32, E = 4 experts,
k = 2, no capacity), forward and backward of each width in turn, ``runs``
times after a warm-up. The compute: the experts' forward span (the layer's
own timeline) and their backward (tensor hooks: from the gradient of their
output arriving to the gradient of their input leaving), the median over
ranks and runs. The communication: each ``all_to_all_single`` of the step
(``calls.record``, call to return: the counts, the rows both ways, and the
two in the backward), summed; of the two ranks, the one that waited least
in that run, whose time is the wire's and not a wait for the other's
experts; the median over the runs, and its range. ``extra["replay"]``: the
same five calls with the layer's own split sizes (recorded from its
forward), run back to back after the step with no compute between them,
timed and summed the same way: what the layer's calls cost when nothing
else runs. The model's time against the replay is the difference of the
calls themselves (the counts, uneven splits); the replay against the
layer's is what the calls pay for running inside the layer.

The formula's crossing is an independent prediction, as in chapters 6 and
7: C is the experts' own FLOP/s at the three largest widths (their rows
counted, not assumed), and α and β are fitted to ``sweep``'s
``all_to_all_single`` of LINK_BYTES on the same ranks, timed between the
runs but apart from the layer (each size's fastest call over the runs: other
work only adds time to a call): the step's experts 12·R·h·f/C meet
4·(α + S/β) + (α + 8E/β), S = R·h·e the rows a rank sends (R = T·k), the
last term the counts. ``extra["f_matmul"]`` is the crossing with the FLOP/s
of one large matmul (``overlap.matmul_flops``) instead, as cited peaks are.
"""
import statistics

from labsupport import models, overlap, timing
from labsupport import sweep as bandwidth_sweep
from labsupport.crossings import Crossing

WORLD_SIZE, EXPERTS, TOP_K, HIDDEN = 2, 4, 2, 64
ACT_BYTES = 4                                          # fp32 rows on the wire
SIZES = {False: dict(ffns=[16, 32, 64, 128, 256, 512], tokens=1024, runs=5),
         True: dict(ffns=[16, 64, 256, 1024], tokens=512, runs=3)}
LINK_BYTES = [1 << k for k in range(15, 22, 2)]        # 32 KiB .. 2 MiB (rows: 512 KiB)


def sweep(small=False) -> Crossing:
    """Time both on 2 ranks (a group of 2 is started or reused); the crossings."""
    from labsupport.launch.session import run

    size = SIZES[small]
    by_rank = run(measure, size["ffns"], size["tokens"], size["runs"],
                  world_size=WORLD_SIZE)
    return summarise(size["ffns"], size["tokens"], by_rank)


def measure(ffns, tokens, runs):
    """On a rank: per width, each run's (experts s, all-to-alls s) and the rows
    its experts computed; the all-to-all link's times by LINK_BYTES (the fastest
    call over the runs, each timed after the widths); one large matmul's FLOP/s."""
    import torch.distributed as dist

    layers = [_layer(f, tokens) for f in ffns]
    rows = [dict(compute=[], comm=[], replay=[], rows=0) for _ in ffns]
    link = []
    for repeat in range(runs + 1):                     # the first: warm-up
        for row, (ep, x) in zip(rows, layers):
            compute, comm, computed = _step_times(ep, x)
            replay = _replay(ep.splits)
            if repeat:
                row["compute"].append(compute)
                row["comm"].append(comm)
                row["replay"].append(replay)
                row["rows"] = computed
        if repeat:
            link.append([fastest for _, fastest, _ in bandwidth_sweep.measure(
                {"a2a": "all_to_all"}, LINK_BYTES, 1, 3)["a2a"]])
    dist.barrier()
    # Each size's least disturbed call (the fastest over every run): on a loaded
    # machine medians can be flat in the size, with no β to fit (chapter 5's).
    return dict(rows=rows, link=[min(col) for col in zip(*link)],
                matmul_flops=overlap.matmul_flops(2 * tokens, HIDDEN, 256))


def _layer(ffn, tokens):
    import torch
    import torch.distributed as dist

    from labsupport.expert_parallel.moe import AllToAll, ExpertParallelMoE, MoE

    rank = dist.get_rank()
    with models.seeded(0):
        layer = MoE(HIDDEN, ffn, EXPERTS, TOP_K)
    x = torch.randn(WORLD_SIZE * tokens, HIDDEN, generator=torch.Generator()
                    .manual_seed(4)).chunk(WORLD_SIZE)[rank]
    ep = ExpertParallelMoE(layer)
    ep.splits = []                      # (output, input) split sizes of each call

    def all_to_all(rows, output_splits, input_splits, group=None):
        ep.splits.append((list(output_splits), list(input_splits)))
        return AllToAll.apply(rows, output_splits, input_splits, group)
    ep.all_to_all = all_to_all
    return ep, x.requires_grad_()


def _replay(splits):
    """The step's five all_to_all_single calls back to back, nothing between
    them: the counts, the forward's dispatch and combine with their split
    sizes, then their reverses as the backward makes them (combine's first);
    each call's seconds, call to return."""
    import torch
    import torch.distributed as dist

    forward = splits[-2:]                              # this step's dispatch, combine
    shapes = [None] + forward + [(i, o) for o, i in reversed(forward)]
    buffers = [(torch.empty(EXPERTS, dtype=torch.int64),
                torch.zeros(EXPERTS, dtype=torch.int64), None, None)
               if s is None else
               (torch.empty(sum(s[0]), HIDDEN), torch.zeros(sum(s[1]), HIDDEN), *s)
               for s in shapes]
    seconds = []
    dist.barrier()
    for out, inp, out_splits, in_splits in buffers:
        start = timing.now()
        dist.all_to_all_single(out, inp, out_splits, in_splits)
        seconds.append(timing.now() - start)
    return seconds


def _step_times(ep, x):
    """One forward and backward: the experts' seconds (forward and backward
    spans), the all-to-alls' seconds (every call, call to return), the rows."""
    import torch.distributed as dist

    from labsupport import calls
    from labsupport.timeline import Timeline

    ep.tl = tl = Timeline(dist.get_rank())
    handles = _time_experts_backward(ep.experts, tl)
    ep.zero_grad(set_to_none=True)
    x.grad = None
    dist.barrier()
    with calls.record() as log:
        ep(x).square().sum().backward()
    for h in handles:
        h.remove()
    compute = sum(e["end"] - e["start"] for e in tl.events if e["lane"] == "compute")
    comm = [c["end"] - c["start"] for c in log.calls
            if c["op"] == "all_to_all_single"]                 # each call, in order
    return compute, comm, int(ep.tokens_per_expert.sum())


def _time_experts_backward(experts, tl):
    """Hooks that record the experts' backward on ``tl``: from the gradient of
    their output arriving to the gradient of their input leaving."""
    start = {}

    def before(module, args):
        if args[0].requires_grad:
            args[0].register_hook(lambda grad: tl.record(
                "compute", "experts backward", start["t"], tl.now()))

    def after(module, args, out):
        if out.requires_grad:
            out.register_hook(lambda grad: start.__setitem__("t", tl.now()))

    return [experts.register_forward_pre_hook(before),
            experts.register_forward_hook(after)]


def summarise(ffns, tokens, by_rank) -> Crossing:
    """Per width: the median compute (ranks and runs), the least-waiting rank's
    all-to-alls (median over runs, and their range); then the crossings."""
    compute, comm, spread = [], [], []
    for i in range(len(ffns)):
        per_rank = [r["rows"][i] for r in by_rank]
        compute.append(statistics.median(t for r in per_rank for t in r["compute"]))
        least = [sum(map(min, zip(*calls)))    # each call: the rank that waited least
                 for calls in zip(*(r["comm"] for r in per_rank))]
        comm.append(statistics.median(least))
        spread.append((min(least), max(least)))
    rows = [statistics.mean(r["rows"][i]["rows"] for r in by_rank)
            for i in range(len(ffns))]
    out = crossing(ffns, tokens, compute, comm, rows, by_rank[0]["link"],
                   by_rank[0]["matmul_flops"])
    replay = [statistics.median(sum(map(min, zip(*calls))) for calls in zip(
        *(r["rows"][i]["replay"] for r in by_rank))) for i in range(len(ffns))]
    out.extra.update(replay=replay, comm_range=spread, slowest_rank_comm=[
        statistics.median(max(sum(run) for run in runs) for runs in zip(
            *(r["rows"][i]["comm"] for r in by_rank))) for i in range(len(ffns))])
    return out


def crossing(ffns, tokens, compute, comm, rows, link_seconds, matmul_flops) -> Crossing:
    """The measured curves' crossing, and the formula's from the experts' own
    FLOP/s and the all-to-all's α-β fit (``link_seconds`` by LINK_BYTES)."""
    h, e = HIDDEN, ACT_BYTES
    flop = [12 * r * h * f for f, r in zip(ffns, rows)]          # forward + backward
    own = statistics.median(n / t for n, t in list(zip(flop, compute))[-3:])
    link = overlap.Link(*bandwidth_sweep.fit_alpha_beta(LINK_BYTES, link_seconds))
    routed = tokens * TOP_K                                      # a balanced router
    step_comm = 4 * link.seconds(routed * h * e) + link.seconds(8 * EXPERTS)
    compute_s = lambda f: 12 * routed * h * f / own              # noqa: E731
    w = link.beta * overlap.ring(WORLD_SIZE)        # bytes each rank sends, per s
    here = overlap.Hardware("this machine", own, w, w, WORLD_SIZE, "measured")
    f_matmul = overlap.crossing(lambda f: 12 * routed * h * f / matmul_flops,
                                lambda f: step_comm, 1e-3, 1e9)
    return Crossing(
        "expert_parallel", "expert width f", list(ffns), list(compute), list(comm),
        overlap.measured_crossing(ffns, compute, comm),
        overlap.crossing(compute_s, lambda f: step_comm, 1e-3, 1e9),
        extra=dict(tokens=tokens, top_k=TOP_K, hidden=h, act_bytes=e, rows=list(rows),
                   flops=own, matmul_flops=matmul_flops, alpha=link.alpha,
                   beta=link.beta, step_comm=step_comm,
                   sent=4 * routed * h * e * overlap.ring(WORLD_SIZE),
                   f_matmul=f_matmul,
                   bandwidth_only=overlap.ep_min_ffn(here, WORLD_SIZE, e,
                                                     backward=True),
                   model=dict(compute=[compute_s(f) for f in ffns],
                              comm=[step_comm] * len(ffns))))
