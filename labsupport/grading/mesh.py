"""Checks of graded assignment 4: a 2-D DP x TP training step built from process groups.

    import labsupport.grading.mesh as gm
    gm.check_groups(make_groups)                    # each rank's row and column
    gm.check_parameters(make_groups, dp_tp_step)    # K steps == one process, full batch
    gm.check_own_groups(make_groups, dp_tp_step)    # every collective on the rank's groups
    gm.check_bytes(make_groups, dp_tp_step)         # payload per group and step

The student writes ``make_groups(dp, tp) -> (tp_group, dp_group)`` (rank r
at row r // tp, column r % tp; every rank makes every group) and
``dp_tp_step(model, x, y, lr, tp_group, dp_group)``: this rank's 1/dp of the
batch through ``TPMLP`` (chapter 4's column- then row-parallel MLP inside the
tp group, Shoeybi et al. 2019, Section 3), MSE loss, backward, gradients
averaged over the dp group, one SGD step. Each check runs on 4 ranks (2 x 2)
through ``labsupport.grading.run``: a deadlock fails at the deadline with
where each rank was, and every failure says what to fix.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labsupport import mesh, models
from labsupport.grading import checks as grading
from labsupport.launch import session
from labsupport.mesh import TPMLP  # noqa: F401 (the assignment shows it as gm.TPMLP)

DP, TP = 2, 2
BATCH, SEQ, HIDDEN = 4, 3, 8         # the global batch; each dp rank takes BATCH / DP
STEPS, LR = 2, 0.1
SPLIT = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}   # the dim each TP shard splits


def full_mlp() -> nn.Sequential:
    """The single-process MLP every run starts from (seed 0)."""
    with models.seeded(0):
        return nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(approximate="tanh"),
                             nn.Linear(4 * HIDDEN, HIDDEN))


def data(step):
    """The global batch of ``step``: x, y of shape (BATCH, SEQ, HIDDEN)."""
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(BATCH, SEQ, HIDDEN, generator=g),
            torch.randn(BATCH, SEQ, HIDDEN, generator=g))


def reference() -> dict:
    """Parameters of one process after STEPS SGD steps on the full batches."""
    model = full_mlp()
    names = {"0": "fc1", "2": "fc2"}
    for step in range(STEPS):
        model.zero_grad()
        F.mse_loss(model(data(step)[0]), data(step)[1]).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return {names[n.split(".")[0]] + "." + n.split(".")[1]: p.detach()
            for n, p in model.named_parameters()}


def dp_tp_training(make_groups, step):
    """On each rank: its groups' ranks, its parameters after STEPS steps, the calls."""
    tp_group, dp_group = make_groups(DP, TP)
    groups = dict(tp=dist.get_process_group_ranks(tp_group),
                  dp=dist.get_process_group_ranks(dp_group))
    if step is None:
        return dict(groups=groups)
    model = TPMLP(full_mlp(), tp_group)
    with mesh.record_calls() as log:
        for k in range(STEPS):
            step(model, *data(k), LR, tp_group, dp_group)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(groups=groups, params=params, log=log)


def _run(make_groups, step, timeout):
    try:
        calls = grading.run(dp_tp_training, make_groups, step, world_size=DP * TP,
                            timeout=timeout)
    except AssertionError as failure:
        session.current().restart()  # half-made groups must not reach the next check
        hint = ("\nIf a rank stopped in dist.new_group: every rank must call new_group for "
                "every group, in the same order, even the groups it is not in."
                if "did not finish" in str(failure) else "")
        raise AssertionError(str(failure) + hint) from None
    return [c["value"] for c in calls]


def _expected(rank):
    rows, columns = mesh.grid_ranks(DP, TP)
    dp_rank, tp_rank = mesh.grid_coords(rank, TP)
    return rows[dp_rank], columns[tp_rank]


def _own(r):
    """The (tp, dp) ranks the student's groups hold: the later checks grade the step on
    those, so that a wrong grid costs the points of check_groups only."""
    return r["groups"]["tp"], r["groups"]["dp"]


def check_groups(make_groups, *, timeout=None):
    """Rank r's tp group is its row of TP consecutive ranks, its dp group its column."""
    for rank, r in enumerate(_run(make_groups, None, timeout)):
        row, column = _expected(rank)
        if r["groups"] != dict(tp=row, dp=column):
            raise AssertionError(
                f"rank {rank}: tp group {r['groups']['tp']}, dp group {r['groups']['dp']}; "
                f"expected tp {row} (its row: ranks {row[0]}..{row[-1]}, TP={TP} consecutive "
                f"ranks) and dp {column} (its column: ranks with the same rank % TP)")


def check_parameters(make_groups, step, *, timeout=None):
    """After STEPS steps each rank's shards equal one process trained on the full batches."""
    want = reference()
    for rank, r in enumerate(_run(make_groups, step, timeout)):
        tp_rank = _own(r)[0].index(rank)
        for name, got in r["params"].items():
            shard = want[name] if name not in SPLIT else \
                want[name].chunk(TP, SPLIT[name])[tp_rank]
            if not torch.allclose(got, shard, rtol=1e-5, atol=1e-6):
                diff = (got - shard).abs().max().item()
                raise AssertionError(f"rank {rank}: {name} differs from one process trained "
                                     f"on the full batch by up to {diff:.3g}: "
                                     + _why(r["log"], _own(r), r["params"]))


def _why(log, own, params) -> str:
    row, column = own
    world = tuple(range(DP * TP))
    sharded = {tuple(params[n].shape) for n in SPLIT}
    if any(c["ranks"] == world for c in log):
        return ("a collective ran over the whole world (group=None). Average the gradients "
                f"over the dp group only (ranks {column}): the tp ranks hold different shards")
    if any(c["ranks"] == tuple(row) and c["op"] == "all_reduce" and c["shape"] in sharded
           for c in log):
        return (f"a gradient of a TP-sharded weight was all-reduced over the tp group "
                f"(ranks {row}): those ranks hold different rows or columns of fc1/fc2, so "
                "their gradients must not be summed; average every gradient over dp only")
    return ("take this rank's 1/dp of the batch (x.chunk(dp)[dp_rank]), average every "
            "gradient over the dp group (all_reduce, then divide by dp), then p -= lr * p.grad")


def check_own_groups(make_groups, step, *, timeout=None):
    """Every collective of the step runs on the rank's own tp group or dp group."""
    for rank, r in enumerate(_run(make_groups, step, timeout)):
        row, column = _own(r)
        stray = [c for c in r["log"] if c["ranks"] not in (tuple(row), tuple(column))]
        if stray:
            c = stray[0]
            raise AssertionError(
                f"rank {rank} called dist.{c['op']} on ranks {list(c['ranks'])}: a rank "
                f"talks only to its tp group {row} and its dp group {column} "
                "(pass group=tp_group or group=dp_group)")


def check_bytes(make_groups, step, *, timeout=None):
    """Per step: tp group b s h e (g's forward all-reduce); dp group the rank's gradients.

    f's backward all-reduce does not run: the input x needs no gradient.
    """
    tp_want = STEPS * (BATCH // DP) * SEQ * HIDDEN * 4
    for rank, r in enumerate(_run(make_groups, step, timeout)):
        row, column = (tuple(g) for g in _own(r))
        by_group = mesh.bytes_by_group(r["log"])
        dp_want = STEPS * sum(p.numel() * 4 for p in r["params"].values())
        got = (by_group.get(row, 0), by_group.get(column, 0))
        if got != (tp_want, dp_want):
            raise AssertionError(
                f"rank {rank} sent payloads of {got[0]:,} B on its tp group and {got[1]:,} B "
                f"on its dp group in {STEPS} steps; expected {tp_want:,} B (per step, the "
                f"MLP's output all-reduce g, b s h x 4 B with b = BATCH/DP; f's backward "
                f"all-reduce does not run, x needs no gradient) and {dp_want:,} B (per "
                "step, one all-reduce of every gradient of the rank, over dp only)")
