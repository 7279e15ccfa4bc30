"""Chapter 8's time beside bytes: on a (dp, tp) = (2, 2) grid, the data-parallel
reduction of a rank's gradient shard against the backward it could hide behind,
across the tokens each dp rank runs.

    c = crossing.sweep(small=True)         # 4 gloo ranks
    c.measured, c.formula                          # tokens per dp rank

Tensor parallelism divides both sides by TP: a rank computes 1/TP of the
backward of its dp rank's T tokens and reduces 1/TP of the gradients over the n = dp
ranks of its column, so chapter 3's crossing T* = (n-1)/n · g/2 · C/W
(``overlap.dp_min_tokens``) holds on the 2-D layout, with T counted per dp rank
(per tp group), not per device. Measured from the recorded calls
(``calls.record``, each call timed on the device's clock: ``timing.CallClock``),
the median of ``repeats`` steps per size: the backward's compute (its wall time
less its tp collectives) and the dp reduction (the chapter's ``mesh.average_grads``:
one all-reduce per gradient tensor, so on gloo the latency α of each call counts),
each the median rank's.
The formula prices the same reduction with this machine's link (chapter 2's
α-β model fitted to all-reduces on the dp group, ``sweep.measure``, timed
between the sizes of the sweep so that they share its load) against
the backward's FLOPs (2/3 of ``overlap.decoder_flops``, over TP) at the FLOP/s
the backward reached at the largest size, and finds where the two meet
(``overlap.crossing``).
"""
import statistics

from labsupport import calls, models, overlap, timing
from labsupport import sweep as bandwidth_sweep
from labsupport.crossings import Crossing
from labsupport.device_mesh import mesh

DP, TP = 2, 2
CFG = models.GPTConfig(vocab_size=128, seq_len=32, hidden=128, heads=4, layers=2)
SEQUENCES = {False: [1, 2, 4, 8, 16, 32, 64, 128], True: [4, 16, 64, 128]}  # per dp rank
REPEATS = {False: 5, True: 4}
LINK_BYTES = [1 << k for k in range(10, 23, 2)]      # 1 KiB .. 4 MiB


def sweep_sizes(small=False) -> list:
    """Tokens per dp rank of the sweep."""
    return [b * CFG.seq_len for b in SEQUENCES[small]]


def sweep(small=False) -> Crossing:
    """Time both on 4 ranks (a group of 4 is started or reused) and find the crossings."""
    from labsupport.launch.session import run

    per_rank = run(measure, CFG, SEQUENCES[small], REPEATS[small], world_size=DP * TP)
    times = [tuple(statistics.median(r[0][i][k] for r in per_rank) for k in (0, 1))
             for i in range(len(SEQUENCES[small]))]          # the median rank's
    return crossing(sweep_sizes(small), times, *per_rank[0][1:])


def measure(cfg, sequences, repeats):
    """On a rank of the grid: [(compute s, comm s)] by size, the dp link's
    (α, β), and the bytes of each gradient tensor it reduces."""
    import torch.distributed as dist

    from labsupport.tensor_parallel.gpt import TensorParallelGPT

    tp_group, dp_group = mesh.grid_groups(DP, TP)
    model = TensorParallelGPT(models.GPT(cfg, seed=0), tp_group)
    ops = {"dp": lambda t: dist.all_reduce(t, group=dp_group)}
    times, link = [], []
    for b in sequences:     # the link timed between the steps: under the same load
        times.append(_step_times(model, tp_group, dp_group, cfg, b, repeats))
        link.append([t for t, _, _ in bandwidth_sweep.measure(ops, LINK_BYTES, 1, 3)["dp"]])
    alpha_beta = bandwidth_sweep.fit_alpha_beta(
        LINK_BYTES, [statistics.median(column) for column in zip(*link)])
    return times, alpha_beta, [p.numel() * p.element_size() for p in model.parameters()]


def _step_times(model, tp_group, dp_group, cfg, sequences, repeats):
    """Medians over ``repeats`` steps (after one warm-up) of the backward's compute
    and of the dp reduction, from the recorded calls."""
    import torch.distributed as dist

    tp_ranks = tuple(dist.get_process_group_ranks(tp_group))
    ids, targets = models.toy_tokens(sequences, cfg.seq_len, cfg.vocab_size, seed=1)
    compute, comm = [], []
    for repeat in range(repeats + 1):
        model.zero_grad()
        loss = model(ids, targets)
        dist.barrier()                       # both reductions start from a level field
        clock = timing.CallClock(ids.device)     # each call on the device's clock
        with calls.record(clock) as log:
            start = timing.now(ids.device)
            loss.backward()
            backward = timing.now(ids.device) - start
            dist.barrier()
            mesh.average_grads(model, dp_group)
        if repeat:                           # the first is a warm-up
            tp = [c for c in log.calls if c["ranks"] == tp_ranks]
            dp = [c for c in log.calls if c["ranks"] != tp_ranks]
            compute.append(backward - clock.total(tp))
            comm.append(clock.total(dp))
    return statistics.median(compute), statistics.median(comm)


def crossing(tokens, times, alpha_beta, grads) -> Crossing:
    """The measured curves' crossing and the formula's with this machine's numbers."""
    compute, comm = [c for c, _ in times], [m for _, m in times]
    link = overlap.Link(*alpha_beta)
    per_token = 2 / 3 * overlap.decoder_flops(1, CFG.seq_len, CFG.layers, CFG.hidden,
                                              CFG.vocab_size) / TP   # backward, one rank
    flops = per_token * tokens[-1] / compute[-1]          # the backward's own FLOP/s
    reduce_s = sum(link.seconds(nbytes) for nbytes in grads)   # n = 2: each sends S
    formula = overlap.crossing(lambda t: t * per_token / flops, lambda t: reduce_s,
                               1, 1e9)
    here = overlap.Hardware("this machine", flops, link.beta, link.beta, DP * TP,
                            "measured")
    return Crossing(
        "device_mesh", "tokens per dp rank", list(tokens), compute, comm,
        overlap.measured_crossing(tokens, compute, comm), formula,
        extra=dict(alpha=link.alpha, beta=link.beta, flops=flops, calls=len(grads),
                   grad_bytes=sum(grads), reduce_s=reduce_s,
                   bandwidth_only=overlap.dp_min_tokens(here, DP, grad_bytes=4),
                   model=dict(compute=[t * per_token / flops for t in tokens],
                              comm=[reduce_s] * len(tokens))))
