"""Checks of assignment 4: hybrid sharded data parallelism (HSDP) from process groups.

    import labsupport.grading.hybrid_sharded_dp as gh
    gh.check_groups(hsdp_groups)              # (replicate, shard) grid: rows and columns
    gh.check_parameters(hsdp_groups, HSDP)    # K steps == one process on the global batch
    gh.check_own_groups(hsdp_groups, HSDP)    # every collective on the rank's two groups
    gh.check_bytes(hsdp_groups, HSDP)         # payload per dimension against the formula
    gh.check_memory(hsdp_groups, HSDP)        # between steps: the shards, Ψ'/S per rank

The ranks form a (replicate, shard) grid, rank r at (r // S, r % S): each
row of S consecutive ranks is a shard group, each column a replicate group.
The student writes ``hsdp_groups(replicate, shard) -> (shard_group,
replicate_group)`` and ``HSDP(model, shard_group, replicate_group)``:
ZeRO-3 inside the shard group (each rank keeps ``shards[i]``, its 1-D slice
of parameter i padded to S equal parts; ``gather()`` all-gathers the full
parameters before use), replicated across the replicate group
(``reduce()``: each gradient reduce-scattered in the shard group, then only
that shard all-reduced across the replicas, the mean over all R·S ranks'
data; ``step(lr)``: SGD on the shards). That is what FSDP2's
``fully_shard`` does on a 2-D mesh (torch/distributed/fsdp/_fully_shard/
_fully_shard.py, the ``mesh`` argument: "If 2D, then parameters are sharded
across the 1st dim and replicated across the 0th dim (HSDP)"), here with
one unit, the whole model. Every check runs the given ``train_step`` on 4
ranks through ``labsupport.grading.run`` (a deadlock ends at the deadline,
explained), with the calls recorded by ``labsupport.calls`` and the memory
by a tally of live storages (``memory.PeakTally``).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labsupport import calls, memory, models
from labsupport.grading import checks as grading
from labsupport.launch import session

GRIDS = ((2, 2),)                # (replicate, shard) of the visible checks: 4 ranks
EDGE_GRIDS = ((1, 4), (4, 1))    # one replica: ZeRO-3 alone; no sharding: plain DDP
SIZES = (5, 7, 3)                # the MLP's widths: parameters of 35, 7, 21, 3 elements
BATCH, STEPS, LR = 8, 2, 0.1     # the global batch: each of the R·S ranks takes 1/(R·S)
TOL = dict(rtol=1e-10, atol=1e-12)  # float64: the same sums in another order


def new_model() -> nn.Sequential:
    """The model every run starts from (seed 0, float64): Linear, GELU, Linear."""
    with models.seeded(0):
        return nn.Sequential(nn.Linear(SIZES[0], SIZES[1]), nn.GELU(approximate="tanh"),
                             nn.Linear(SIZES[1], SIZES[2])).double()


def data(step):
    """The global batch of ``step``: x (BATCH, 5), y (BATCH, 3), the same on every rank."""
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(BATCH, SIZES[0], generator=g, dtype=torch.float64),
            torch.randn(BATCH, SIZES[-1], generator=g, dtype=torch.float64))


def flat_padded(tensor, parts):
    """``tensor`` as a 1-D copy, zero-padded to a multiple of ``parts`` elements."""
    flat = tensor.detach().reshape(-1)
    return torch.cat([flat, flat.new_zeros(-flat.numel() % parts)])


def train_step(model, hsdp, x, y, lr):
    """One HSDP step on this rank's 1/N of the global batch (N = R·S ranks)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    hsdp.gather()                                     # full parameters, for this step
    F.mse_loss(model(x.chunk(n)[rank]), y.chunk(n)[rank]).backward()
    hsdp.reduce()                                     # this rank's shard of the mean
    hsdp.step(lr)


def reference() -> dict:
    """Parameters of one process after STEPS SGD steps on the whole global batch."""
    model = new_model()
    for step in range(STEPS):
        model.zero_grad()
        F.mse_loss(model(data(step)[0]), data(step)[1]).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return {n: p.detach() for n, p in model.named_parameters()}


def padded_numels(shard) -> list[int]:
    """Each parameter's element count padded to S equal shards: S·⌈n/S⌉."""
    return [-(-p.numel() // shard) * shard for p in new_model().parameters()]


def expected_groups(rank, grid) -> tuple:
    """(shard group, replicate group) of ``rank``: its row and its column."""
    replicate, shard = grid
    row, column = rank // shard, rank % shard
    return (tuple(range(row * shard, (row + 1) * shard)),
            tuple(range(column, replicate * shard, shard)))


# -- on the ranks ------------------------------------------------------------------------

def hsdp_training(make_groups, cls, grid):
    """This rank's groups; with ``cls``, STEPS steps of it: calls, memory, parameters."""
    shard_group, replicate_group = make_groups(*grid)
    groups = tuple(tuple(dist.get_process_group_ranks(g)) for g in (shard_group,
                                                                     replicate_group))
    if cls is None:
        return dict(groups=groups)
    model = new_model()
    hsdp = cls(model, shard_group, replicate_group)
    made = memory.PeakTally()                  # storages made during the steps, live
    with calls.record() as log:
        for step in range(STEPS):
            with made:
                train_step(model, hsdp, *data(step), LR)
    kept = dict(full=memory.storage_bytes(model.parameters()),
                grads=memory.storage_bytes(p.grad for p in model.parameters()),
                shards=memory.storage_bytes(getattr(hsdp, "shards", [])), made=made.live)
    hsdp.gather()                              # the full parameters, to compare
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(groups=groups, params=params, kept=kept,
                calls=[{k: c[k] for k in ("op", "ranks", "nbytes")} for c in log.calls
                       if c["kind"] == "collective"])


def _run(make_groups, cls, grid, timeout) -> list[dict]:
    try:
        out = grading.run(hsdp_training, make_groups, cls, grid,
                          world_size=grid[0] * grid[1], timeout=timeout)
    except AssertionError as failure:
        session.current().restart()  # half-made groups must not reach the next check
        hint = ("\nA rank stopped in dist.new_group: every rank must call new_group for "
                "every group, in the same order, even the groups it is not in."
                if "did not finish" in str(failure) and "new_group" in str(failure) else "")
        raise AssertionError(f"on the {grid[0]} x {grid[1]} grid: {failure}{hint}") from None
    return [c["value"] for c in out]


# -- the checks -------------------------------------------------------------------------

def check_groups(make_groups, grids=GRIDS, *, timeout=None):
    """Rank r's shard group is its row of S consecutive ranks, its replicate group its
    column."""
    for grid in grids:
        for rank, r in enumerate(_run(make_groups, None, grid, timeout)):
            want = expected_groups(rank, grid)
            if r["groups"] != want:
                raise AssertionError(
                    f"{grid[0]} x {grid[1]} grid (replicate x shard), rank {rank}: shard "
                    f"group {list(r['groups'][0])}, replicate group {list(r['groups'][1])}; "
                    f"expected shard {list(want[0])} (its row: {grid[1]} consecutive ranks, "
                    f"on one node in practice) and replicate {list(want[1])} (its column: "
                    f"the ranks with the same rank % {grid[1]})")


def check_parameters(make_groups, cls, grids=GRIDS, *, timeout=None):
    """After STEPS steps every rank's full parameters equal one process's on the whole
    global batch."""
    want = reference()
    for grid in grids:
        for rank, r in enumerate(_run(make_groups, cls, grid, timeout)):
            for name, got in r["params"].items():
                if got.shape != want[name].shape or not torch.allclose(got, want[name], **TOL):
                    raise AssertionError(
                        f"{grid[0]} x {grid[1]} grid (replicate x shard), rank {rank}: after "
                        f"{STEPS} steps {name} (gathered) is not one process's trained on "
                        f"the whole batch{_difference(got, want[name])}. "
                        + _why(r, grid))


def _difference(got, want) -> str:
    if got.shape != want.shape:
        return f" (shape {tuple(got.shape)}, expected {tuple(want.shape)})"
    return f" (differs by up to {(got - want).abs().max().item():.3g})"


def _why(r, grid) -> str:
    shard_group, replicate_group = r["groups"]
    ops = {(c["op"], c["ranks"]) for c in r["calls"]}
    if any(op.startswith("reduce_scatter") and ranks == replicate_group and
           replicate_group != shard_group for op, ranks in ops):
        return (f"The reduce-scatter ran across the replicas (ranks {list(replicate_group)}): "
                "the gradient is cut into shards inside the shard group, where each rank "
                "keeps one shard; only that shard then crosses the replicate group.")
    if not any(op == "all_reduce" and ranks == replicate_group for op, ranks in ops) \
            and grid[0] > 1:
        return ("No all-reduce crossed the replicate group: each replica saw other data, so "
                "each gradient shard must be all-reduced across it (group=replicate_group).")
    return (f"Each gradient: reduce-scatter its padded flat copy in the shard group, "
            f"all-reduce the shard across the replicate group, divide by R·S = "
            f"{grid[0] * grid[1]} (the mean over every rank's data), then SGD on the shard.")


def check_own_groups(make_groups, cls, grids=GRIDS, *, timeout=None):
    """Every collective of the steps runs on the rank's shard group or replicate group."""
    for grid in grids:
        for rank, r in enumerate(_run(make_groups, cls, grid, timeout)):
            stray = [c for c in r["calls"] if c["ranks"] not in r["groups"]]
            if stray:
                c, world = stray[0], tuple(range(grid[0] * grid[1]))
                raise AssertionError(
                    f"rank {rank} called dist.{c['op']} on ranks {list(c['ranks'])}"
                    + (" (the whole world: group=None)" if c["ranks"] == world else "")
                    + f": an HSDP rank talks only to its shard group {list(r['groups'][0])} "
                    f"and its replicate group {list(r['groups'][1])}. Across the world the "
                    "full gradient travels over the slow links between nodes; HSDP sends "
                    "only 1/S of it there.")


def payload_formula(grid) -> tuple[int, int]:
    """(shard group, replicate group) payload bytes per rank and step, float64: all-gather
    and reduce-scatter of every padded parameter in the shard group, 2Ψ'·8; all-reduce
    of this rank's gradient shards across the replicas, Ψ'/S·8."""
    padded = sum(padded_numels(grid[1]))
    return 2 * padded * 8, padded // grid[1] * 8


def check_bytes(make_groups, cls, grids=GRIDS, *, timeout=None):
    """Payload per rank on each dimension: 2Ψ'·8 B in the shard group, Ψ'/S·8 B across
    the replicas, per step (Ψ' the parameters padded to S shards each)."""
    for grid in grids:
        want = tuple(STEPS * b for b in payload_formula(grid))
        for rank, r in enumerate(_run(make_groups, cls, grid, timeout)):
            got = tuple(sum(c["nbytes"] for c in r["calls"] if c["ranks"] == g)
                        for g in r["groups"])
            if got != want:
                raise AssertionError(
                    f"{grid[0]} x {grid[1]} grid, rank {rank}: {STEPS} steps sent payloads of "
                    f"{got[0]:,} B in its shard group and {got[1]:,} B across its replicate "
                    f"group; expected {want[0]:,} B (per step, all-gather and reduce-scatter "
                    f"of every parameter padded to S={grid[1]} shards: 2Ψ'·8 B) and "
                    f"{want[1]:,} B (per step, all-reduce of this rank's gradient shards "
                    "only: Ψ'/S·8 B). " + _bytes_hint(r, got, want, grid))


def _bytes_hint(r, got, want, grid) -> str:
    shard_group, replicate_group = r["groups"]
    full = STEPS * sum(padded_numels(grid[1])) * 8
    if any(c["ranks"] not in r["groups"] for c in r["calls"]):
        return "Some collectives ran on other groups (check_own_groups names them)."
    if any(c["op"].startswith("reduce_scatter") and c["ranks"] == replicate_group
           for c in r["calls"]):
        return "The reduce-scatter ran across the replicas: it belongs to the shard group."
    if got[1] >= full:
        return (f"The replicate group carried the full gradients ({got[1]:,} B): all-reduce "
                f"only the shard the reduce-scatter left, S = {grid[1]} times fewer bytes "
                "on the slowest links.")
    return "Each gradient once each way: no collective twice, none left out."


def check_memory(make_groups, cls, grids=GRIDS, *, timeout=None):
    """Between steps a rank holds its parameter shards, Ψ'/S·8 bytes (plus at most its
    gradient shards): no full parameter, no full gradient."""
    for grid in grids:
        shard_bytes = sum(padded_numels(grid[1])) // grid[1] * 8
        for rank, r in enumerate(_run(make_groups, cls, grid, timeout)):
            k = r["kept"]
            where = f"{grid[0]} x {grid[1]} grid, rank {rank}, after {STEPS} steps: "
            if k["full"] or k["grads"]:
                raise AssertionError(
                    where + f"the model's parameters still hold {k['full']:,} B and their "
                    f".grad {k['grads']:,} B. ZeRO-3 keeps only the shards between steps "
                    "(free() once the gradients are reduced): the full parameters exist "
                    "from gather() to reduce(), nowhere else.")
            if k["shards"] != shard_bytes:
                raise AssertionError(
                    where + f"self.shards hold {k['shards']:,} B (their storages); a rank "
                    f"keeps 1/S of every padded parameter, Ψ'/S·8 = {shard_bytes:,} B: "
                    "each shard a tensor of its own (a view keeps the whole flat copy).")
            if k["made"] > 2 * shard_bytes:
                raise AssertionError(
                    where + f"{k['made']:,} B made during the steps are still alive, more "
                    f"than a rank's gradient shards and a second copy of its parameter "
                    f"shards (2·Ψ'/S·8 = {2 * shard_bytes:,} B): a full parameter or "
                    "gradient is still kept somewhere.")
