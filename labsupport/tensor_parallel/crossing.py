"""Chapter 4's time beside bytes: a tensor-parallel MLP's matmuls against its
all-reduce (Megatron's g), across the hidden size h, on TP = 2 ranks.

    c = crossing.sweep(small=True)         # 2 gloo ranks
    c.measured, c.formula                              # hidden size h

Per rank, the MLP (F = 4h) multiplies T tokens by its column slice of fc1
and its row slice of fc2: 2·T·h·F/TP FLOPs each, 4·T·h·F/TP in all, growing
as h²; g all-reduces the (T, h) output, T·h·e bytes, growing as h. So
compute wins from some h on. ``overlap.tp_max_degree`` states the same
balance as the largest TP degree for a given F on cited hardware (with an
all-gather and a reduce-scatter, sequence parallelism's pair, which move
what one all-reduce moves). Measured from the recorded calls
(``calls.record``), the median of ``repeats`` forwards per size: the
forward's wall time less the all-reduce, and the all-reduce, each the
median rank's, both on the device's clock (``labsupport.timing``: on a GPU,
its work done, not the host's enqueue). The formula prices the same
all-reduce with this machine's link (chapter 2's α-β model fitted to
all-reduces on the group, ``sweep.measure``, timed between the sizes of
the sweep so that they share its load) against the matmuls' FLOPs at the
FLOP/s the forward reached at the largest size, and finds where the two
meet (``overlap.crossing``).
"""
import statistics

from labsupport import calls, overlap, timing
from labsupport import sweep as bandwidth_sweep
from labsupport.crossings import Crossing

TP = 2
TOKENS = 256                                              # T, tokens per rank
HIDDENS = {False: [16, 32, 64, 128, 256, 512], True: [32, 64, 128, 256, 512]}
REPEATS = {False: 9, True: 9}
LINK_BYTES = [1 << k for k in range(10, 23, 2)]          # 1 KiB .. 4 MiB
ELEMENT = 4                                               # fp32 activations


def mlp_flops(h, tokens=TOKENS, tp=TP) -> float:
    """FLOPs of one rank's MLP forward: fc1 and fc2, 2·T·h·F/TP each, F = 4h."""
    return 4 * tokens * h * (4 * h) / tp


def sweep(small=False) -> Crossing:
    """Time both on TP ranks (a group is started or reused) and find the crossings."""
    from labsupport.launch.session import run

    hiddens = HIDDENS[small]
    per_rank = run(measure, hiddens, REPEATS[small], world_size=TP)
    times = [tuple(statistics.median(r[0][i][k] for r in per_rank) for k in (0, 1))
             for i in range(len(hiddens))]                   # the median rank's
    return crossing(hiddens, times, per_rank[0][1])


def measure(hiddens, repeats):
    """On a rank: [(compute s, all-reduce s)] by hidden size, and the link's (α, β)."""
    import torch.distributed as dist

    ops = {"tp": lambda t: dist.all_reduce(t)}
    times, link = [], []
    for h in hiddens:       # the link timed between the sizes: under the same load
        times.append(_forward_times(h, repeats))
        link.append([t for t, _, _ in bandwidth_sweep.measure(ops, LINK_BYTES, 1, 3)["tp"]])
    alpha_beta = bandwidth_sweep.fit_alpha_beta(
        LINK_BYTES, [statistics.median(column) for column in zip(*link)])
    return times, alpha_beta


def _forward_times(h, repeats):
    """Medians over ``repeats`` forwards (after one warm-up) of the matmuls and of g."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from labsupport.launch.identity import device
    from labsupport.tensor_parallel.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        enter_tp,
    )

    torch.manual_seed(0)
    fc1 = ColumnParallelLinear(torch.nn.Linear(h, 4 * h)).to(device())
    fc2 = RowParallelLinear(torch.nn.Linear(4 * h, h)).to(device())
    x = torch.randn(TOKENS, h, device=device())              # (T, h)
    compute, comm = [], []
    with torch.no_grad():
        for repeat in range(repeats + 1):
            dist.barrier()                   # every rank starts from a level field
            clock = timing.CallClock(x.device)   # g's all-reduce, the device's time
            with calls.record(clock) as log:
                start = timing.now(x.device)
                fc2(F.gelu(fc1(enter_tp(x)), approximate="tanh"))
                wall = timing.now(x.device) - start
            if repeat:                       # the first is a warm-up
                reduce_s = clock.total(log.calls)
                compute.append(wall - reduce_s)
                comm.append(reduce_s)
    return statistics.median(compute), statistics.median(comm)


def crossing(hiddens, times, alpha_beta) -> Crossing:
    """The measured curves' crossing and the formula's with this machine's numbers."""
    compute, comm = [c for c, _ in times], [m for _, m in times]
    link = overlap.Link(*alpha_beta)
    flops = mlp_flops(hiddens[-1]) / compute[-1]           # the forward's own FLOP/s
    compute_s = lambda h: mlp_flops(h) / flops              # noqa: E731
    comm_s = lambda h: link.seconds(TOKENS * h * ELEMENT)   # noqa: E731
    formula = overlap.crossing(compute_s, comm_s, 1, 1e6)
    return Crossing(
        "tensor_parallel", "hidden size h", list(hiddens), compute, comm,
        overlap.measured_crossing(hiddens, compute, comm), formula,
        extra=dict(alpha=link.alpha, beta=link.beta, flops=flops, tokens=TOKENS,
                   model=dict(compute=[compute_s(h) for h in hiddens],
                              comm=[comm_s(h) for h in hiddens])))
