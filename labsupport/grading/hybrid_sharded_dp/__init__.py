"""Checks of assignment 4: hybrid sharded data parallelism (HSDP) on ranks placed on nodes.

    import labsupport.grading.hybrid_sharded_dp as gh
    gh.check_groups(hsdp_groups)              # shard group: a node; replicate: position i
    gh.check_parameters(hsdp_groups, HSDP)    # K steps == one process on the global batch
    gh.check_own_groups(hsdp_groups, HSDP)    # every collective on the rank's two groups
    gh.check_bytes(hsdp_groups, HSDP)         # per dimension, and between nodes, per formula
    gh.check_memory(hsdp_groups, HSDP)        # between steps: the shards, Ψ'/S per rank

The student writes ``hsdp_groups(node_of) -> (shard_group, replicate_group)``
for ranks placed on nodes by the scheduler (``node_of[rank]``, in blocks, round
robin or otherwise: ``placement``) and ``HSDP(model, shard_group,
replicate_group)``: ZeRO-3 inside the shard group (each rank keeps
``shards[i]``, its 1-D slice of parameter i padded to S equal parts;
``gather()`` all-gathers the full parameters before use), replicated across
the replicate group (``reduce()``: each gradient reduce-scattered in the shard
group, then only that shard all-reduced across the replicas, the mean over all
R·S ranks' data; ``step(lr)``: SGD on the shards). That is what FSDP2's
``fully_shard`` does on a 2-D mesh (torch/distributed/fsdp/_fully_shard/
_fully_shard.py, the ``mesh`` argument: "If 2D, then parameters are sharded
across the 1st dim and replicated across the 0th dim (HSDP)"), here with one
unit, the whole model. Every check runs the given ``train_step`` on 4 ranks
through ``labsupport.grading.run`` (a deadlock ends at the deadline,
explained), after the ranks have compared the groups they ask ``new_group``
for (``placement.plan``), with the calls recorded by ``labsupport.calls`` and
the memory by what the student's code still reaches by reference after the steps
(``labsupport.checking.held``: the same count on an idle machine and a loaded
one, whenever gloo's worker thread lets go of a finished work's buffers).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labsupport import calls, models
from labsupport.checking import collective_checks, held
from labsupport.grading.hybrid_sharded_dp import placement
from labsupport.grading.hybrid_sharded_dp.placement import (  # noqa: F401 - the notebook's
    EDGE_PLACEMENTS,
    PLACEMENTS,
    crossing,
    describe,
    expected_groups,
    order_problem,
    shape,
)
from labsupport.launch import session
from labsupport.memory import tally

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


# -- on the ranks ------------------------------------------------------------------------

def hsdp_training(make_groups, cls, node_of):
    """This rank's groups (after every rank's new_group calls are compared); with
    ``cls``, STEPS steps of it: calls, memory, parameters."""
    plans = placement.same_plans(make_groups, node_of)
    if placement.order_problem(plans, node_of):
        return dict(plans=plans)               # named by _run; no group is made
    shard_group, replicate_group = make_groups(list(node_of))
    groups = (_ranks(shard_group), _ranks(replicate_group))
    if cls is None:
        return dict(groups=groups)
    model = new_model()
    hsdp = cls(model, shard_group, replicate_group)
    made = held.Held()                         # what the steps made and the code keeps:
    made.snapshot(_roots(hsdp, model))         # not what the constructor made
    with calls.record() as log:
        for step in range(STEPS):
            train_step(model, hsdp, *data(step), LR)
    kept = dict(full=tally.storage_bytes(model.parameters()),
                grads=tally.storage_bytes(p.grad for p in model.parameters()),
                shards=tally.storage_bytes(getattr(hsdp, "shards", [])),
                made=made.count(_roots(hsdp, model)))
    hsdp.gather()                              # the full parameters, to compare
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(groups=groups, params=params, kept=kept,
                calls=[{k: c[k] for k in ("op", "ranks", "nbytes")} for c in log.calls
                       if c["kind"] == "collective"])


def _roots(hsdp, model) -> list:
    """Where the student's code keeps what it keeps: its object, its class, the model
    (parameters, their .grad, buffers, attributes)."""
    return [hsdp, type(hsdp).__dict__, model]


def _ranks(group) -> tuple:
    """The global ranks of ``group`` (None: the world, as for a collective); () for a
    group this rank is not in."""
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return ()
    return tuple(dist.get_process_group_ranks(dist.group.WORLD if group is None else group))


def _run(make_groups, cls, node_of, timeout) -> list[dict]:
    try:
        out = collective_checks.run(hsdp_training, make_groups, cls, node_of,
                          world_size=len(node_of), timeout=timeout)
    except AssertionError as failure:
        session.current().restart()  # half-made groups must not reach the next check
        hint = ("\nA rank stopped in dist.new_group: every rank must call new_group for "
                "every group, in the same order, even the groups it is not in."
                if "did not finish" in str(failure) and "new_group" in str(failure) else "")
        raise AssertionError(f"with {describe(node_of)}: {failure}{hint}") from None
    runs = [c["value"] for c in out]
    problem = placement.order_problem(runs[0].get("plans", []), node_of)
    if problem:
        raise AssertionError(problem)
    return runs


# -- the checks -------------------------------------------------------------------------

def check_groups(make_groups, placements=PLACEMENTS, *, timeout=None):
    """Rank r's shard group is the ranks of its node, its replicate group the ranks at its
    position on every node; every rank asks new_group for the same groups in order."""
    for node_of in placements:
        for rank, r in enumerate(_run(make_groups, None, node_of, timeout)):
            problem = placement.group_problem(rank, r["groups"], node_of)
            if problem:
                raise AssertionError(problem)


def check_parameters(make_groups, cls, placements=PLACEMENTS, *, timeout=None):
    """After STEPS steps every rank's full parameters equal one process's on the whole
    global batch."""
    want = reference()
    for node_of in placements:
        for rank, r in enumerate(_run(make_groups, cls, node_of, timeout)):
            for name, got in r["params"].items():
                if got.shape != want[name].shape or not torch.allclose(got, want[name], **TOL):
                    raise AssertionError(
                        f"{describe(node_of)}, rank {rank}: after {STEPS} steps {name} "
                        f"(gathered) is not one process's trained on the whole batch"
                        f"{_difference(got, want[name])}. " + _why(rank, r, node_of))


def _difference(got, want) -> str:
    if got.shape != want.shape:
        return f" (shape {tuple(got.shape)}, expected {tuple(want.shape)})"
    return f" (differs by up to {(got - want).abs().max().item():.3g})"


def _why(rank, r, node_of) -> str:
    shard_group, replicate_group = r["groups"]
    ops = {(c["op"], c["ranks"]) for c in r["calls"]}
    if any(op.startswith("reduce_scatter") and ranks == replicate_group and
           replicate_group != shard_group for op, ranks in ops):
        return (f"The reduce-scatter ran across the replicas (ranks {list(replicate_group)}): "
                "the gradient is cut into shards inside the shard group, where each rank "
                "keeps one shard; only that shard then crosses the replicate group.")
    if not any(op == "all_reduce" and ranks == replicate_group for op, ranks in ops) \
            and shape(node_of)[0] > 1:
        return ("No all-reduce crossed the replicate group: each replica saw other data, so "
                "each gradient shard must be all-reduced across it (group=replicate_group).")
    if replicate_group != expected_groups(rank, node_of)[1]:
        return ("Its groups are not HSDP's (check_groups says how): a replicate group must "
                "hold the ranks that keep the same shard.")
    return (f"Each gradient: reduce-scatter its padded flat copy in the shard group, "
            f"all-reduce the shard across the replicate group, divide by R·S = "
            f"{len(node_of)} (the mean over every rank's data), then SGD on the shard.")


def check_own_groups(make_groups, cls, placements=PLACEMENTS, *, timeout=None):
    """Every collective of the steps runs on the rank's shard group or replicate group."""
    for node_of in placements:
        for rank, r in enumerate(_run(make_groups, cls, node_of, timeout)):
            stray = [c for c in r["calls"] if c["ranks"] not in r["groups"]]
            if stray:
                c, world = stray[0], tuple(range(len(node_of)))
                raise AssertionError(
                    f"{describe(node_of)}: rank {rank} called dist.{c['op']} on ranks "
                    f"{list(c['ranks'])}"
                    + (" (the whole world: group=None)" if c["ranks"] == world else "")
                    + f": an HSDP rank talks only to its shard group {list(r['groups'][0])} "
                    f"and its replicate group {list(r['groups'][1])}. Across the world the "
                    "full gradient travels over the slow links between nodes; HSDP sends "
                    "only 1/S of it there.")


def payload_formula(node_of) -> tuple[int, int]:
    """(shard group, replicate group) payload bytes per rank and step, float64: all-gather
    and reduce-scatter of every padded parameter in the shard group, 2Ψ'·8; all-reduce
    of this rank's gradient shards across the replicas, Ψ'/S·8."""
    per_node = shape(node_of)[1]
    padded = sum(padded_numels(per_node))
    return 2 * padded * 8, padded // per_node * 8


def check_bytes(make_groups, cls, placements=PLACEMENTS, *, timeout=None):
    """Payload per rank and step: 2Ψ'·8 B in the shard group, Ψ'/S·8 B across the
    replicas (Ψ' the parameters padded to S shards each), and only the latter between
    nodes."""
    for node_of in placements:
        want = tuple(STEPS * b for b in payload_formula(node_of))
        between = want[1] if shape(node_of)[0] > 1 else 0
        for rank, r in enumerate(_run(make_groups, cls, node_of, timeout)):
            got = tuple(sum(c["nbytes"] for c in r["calls"] if c["ranks"] == g)
                        for g in r["groups"])
            where = f"{describe(node_of)}, rank {rank}: {STEPS} steps "
            if got != want:
                raise AssertionError(
                    where + f"sent payloads of {got[0]:,} B in its shard group and "
                    f"{got[1]:,} B across its replicate group; expected {want[0]:,} B (per "
                    f"step, all-gather and reduce-scatter of every parameter padded to "
                    f"S={shape(node_of)[1]} shards: 2Ψ'·8 B) and {want[1]:,} B (per step, "
                    "all-reduce of this rank's gradient shards only: Ψ'/S·8 B). "
                    + _bytes_hint(r, got, node_of))
            across = [c for c in r["calls"] if crossing(c, node_of)]
            if sum(c["nbytes"] for c in across) != between:
                raise AssertionError(
                    where + f"sent {sum(c['nbytes'] for c in across):,} B of payload on "
                    f"groups that span nodes ({placement.named_calls(across)}); HSDP sends "
                    f"only the all-reduce of the gradient shards between nodes, "
                    f"{between:,} B. Its shard group must be the ranks of one node, where "
                    "the links are fast (check_groups).")


def _bytes_hint(r, got, node_of) -> str:
    shard_group, replicate_group = r["groups"]
    full = STEPS * sum(padded_numels(shape(node_of)[1])) * 8
    if any(c["ranks"] not in r["groups"] for c in r["calls"]):
        return "Some collectives ran on other groups (check_own_groups names them)."
    if shard_group == replicate_group:
        return "Its shard group and its replicate group are the same ranks (check_groups)."
    if any(c["op"].startswith("reduce_scatter") and c["ranks"] == replicate_group
           for c in r["calls"]):
        return "The reduce-scatter ran across the replicas: it belongs to the shard group."
    if got[1] >= full:
        return (f"The replicate group carried the full gradients ({got[1]:,} B): all-reduce "
                f"only the shard the reduce-scatter left, S = {shape(node_of)[1]} times "
                "fewer bytes on the slowest links.")
    return "Each gradient once each way: no collective twice, none left out."


def check_memory(make_groups, cls, placements=PLACEMENTS, *, timeout=None):
    """Between steps a rank holds its parameter shards, Ψ'/S·8 bytes (plus at most its
    gradient shards): no full parameter, no full gradient."""
    for node_of in placements:
        per_node = shape(node_of)[1]
        shard_bytes = sum(padded_numels(per_node)) // per_node * 8
        for rank, r in enumerate(_run(make_groups, cls, node_of, timeout)):
            k = r["kept"]
            where = f"{describe(node_of)}, rank {rank}, after {STEPS} steps: "
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
                    where + f"{k['made']:,} B made during the steps are still held by your "
                    "code (reached from your object or the model), more "
                    f"than a rank's gradient shards and a second copy of its parameter "
                    f"shards (2·Ψ'/S·8 = {2 * shard_bytes:,} B): a full parameter or "
                    "gradient is still kept somewhere.")
