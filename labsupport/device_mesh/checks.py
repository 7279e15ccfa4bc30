"""The checks of chapter 8 (hybrid parallelism on a DeviceMesh) and its one-process references.

    device_mesh.check_axis_groups(axis_groups)                   # in the kernel
    ls.run(device_mesh.check_grad_sync, grad_sync_plan, 2, 2, 2, world_size=8)
    device_mesh.reference_params(cfg, batches, lr)               # what the grid must equal

Each check says what is wrong with an answer: the case, what came back, what
was expected and the likely reason.
"""
import itertools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labsupport import models
from labsupport.device_mesh import mesh
from labsupport.tensor_parallel import tensor_parallel

# Shapes of the axis_groups check: 2-D grids, the chapter's cube, a size-1
# axis, and Megatron's (pp, dp, cp, tp) order with every size above 1.
SHAPES = [(2, 2), (4, 2), (2, 4), (2, 2, 2), (3, 1, 2), (2, 2, 2, 2), (2, 3, 2)]


def mesh_groups(shape, axis):
    """The groups along ``axis`` of ranks numbered row-major over ``shape``,
    sorted: the sets DeviceMesh makes (torch 2.13, torch/distributed/
    device_mesh.py: row-major strides, ``_MeshLayout.from_sizes_strides``),
    here the rows of the rank tensor with ``axis`` moved last."""
    ranks = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    rows = ranks.transpose(axis, -1).reshape(-1, shape[axis]).tolist()
    return sorted(sorted(row) for row in rows)


def check_axis_groups(fn):
    """``fn(shape, axis)`` against DeviceMesh's groups on every axis of ``SHAPES``."""
    for shape in SHAPES:
        for axis in range(len(shape)):
            got, want = fn(shape, axis), mesh_groups(shape, axis)
            if not isinstance(got, list) or not all(isinstance(g, list) for g in got):
                raise AssertionError(f"shape {shape}, axis {axis}: return a list of lists "
                                     f"of ranks, got {type(got).__name__} {got!r}")
            if got != want:
                raise AssertionError(f"shape {shape}, axis {axis}: got {got}, expected "
                                     f"{want}: {_why(shape, axis, got)}")


def _why(shape, axis, got):
    stride = int(torch.tensor(shape[axis + 1:]).prod()) if axis + 1 < len(shape) else 1
    if got and sorted(sorted(g) for g in got) == mesh_groups(shape, axis):
        return "the right groups, out of order: sort the ranks of each group and the groups"
    for other in range(len(shape)):
        if other != axis and got == mesh_groups(shape, other):
            return (f"those are the groups along axis {other}; along axis {axis} "
                    f"neighbours are {stride} apart (the product of the sizes after it)")
    if len(got) != len(mesh_groups(shape, axis)):
        return (f"expected {len(mesh_groups(shape, axis))} groups of {shape[axis]} ranks: "
                "one for every position on the other axes")
    return (f"along axis {axis} a group's ranks are {stride} apart and every rank of "
            "the mesh is in exactly one group")


# -- grad_sync_plan: a TP(+SP) MLP block on a dp x cp x tp grid ----------------------
# (b, s, h) = (4, 8, 8) on a (2, 2, 2) grid: each rank's cell is 2 sequences of
# 4 tokens; under SP each tp rank holds 2 of them. The MLP's hidden size is 4h.
AXES = ("dp", "cp", "tp")
SYNC_SHAPE = (4, 8, 8)
SYNC_TOL = dict(rtol=1e-4, atol=1e-6)    # fp32: sums of up to 8 ranks in another order


class _MLPBlock(torch.nn.Module):
    """x + fc2(gelu(fc1(ln(x)))) whole: the one-process reference."""

    def __init__(self, h, seed=0):
        super().__init__()
        with models.seeded(seed):
            self.ln = torch.nn.LayerNorm(h)
            self.fc1, self.fc2 = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)
            for p in self.ln.parameters():     # not LayerNorm's 1 and 0: each
                                               # entry moves the loss
                p.data += 0.1 * torch.randn(h)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class _TPMLPBlock(torch.nn.Module):
    """The same block split as chapter 4 splits it over ``tp_group``: fc1 column-
    and fc2 row-parallel; with ``sequence_parallel`` the LayerNorm and fc2's bias
    run on this rank's s/tp tokens (Korthikanti et al. 2022, arXiv 2205.05198,
    §4.2.2)."""

    def __init__(self, whole, tp_group, sequence_parallel):
        super().__init__()
        self.group, self.sp = tp_group, sequence_parallel
        self.ln = whole.ln
        self.fc1 = tensor_parallel.ColumnParallelLinear(whole.fc1, tp_group)
        self.fc2 = tensor_parallel.RowParallelLinear(whole.fc2, tp_group,
                                                     sequence_parallel)

    def forward(self, x):              # (b, s/tp, h) under SP, else (b, s, h)
        y = tensor_parallel.enter_tp(self.ln(x), self.group, self.sp)
        return x + self.fc2(F.gelu(self.fc1(y)))


def _sync_data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(*SYNC_SHAPE, generator=g), torch.randn(*SYNC_SHAPE, generator=g)


def _reference_grads():
    block = _MLPBlock(SYNC_SHAPE[-1])
    x, y = _sync_data()
    F.mse_loss(block(x), y).backward()
    return {n: p.grad for n, p in block.named_parameters()}


def _coords(rank, shape):
    out = []
    for size in reversed(shape):
        out.append(rank % size)
        rank //= size
    return tuple(reversed(out))


def _group_of(rank, shape, axes):
    """The ranks that differ from ``rank`` only on ``axes`` (names of AXES)."""
    me = _coords(rank, shape)
    keep = [i for i, a in enumerate(AXES) if a not in axes]
    return [r for r in range(math.prod(shape))
            if all(_coords(r, shape)[i] == me[i] for i in keep)]


def _subset_groups(shape):
    """{axes: this rank's group} for every non-empty subset of AXES; every rank
    makes every group in the same order (new_group is collective)."""
    rank, mine = dist.get_rank(), {}
    for k in range(1, len(AXES) + 1):
        for axes in itertools.combinations(AXES, k):
            made = set()
            for r in range(math.prod(shape)):
                ranks = tuple(_group_of(r, shape, axes))
                if ranks not in made:
                    made.add(ranks)
                    group = dist.new_group(list(ranks))
                    if rank in ranks:
                        mine[axes] = group
    return mine


def _valid_plan(plan, names, sp):
    if not isinstance(plan, dict) or set(plan) != set(names):
        raise AssertionError(f"sequence_parallel={sp}: return a dict with one entry "
                             f"per parameter {sorted(names)}, got {plan!r}")
    for name, entry in plan.items():
        ok = isinstance(entry, tuple) and len(entry) == 2
        axes, divisor = entry if ok else ((), 0)
        if not (ok and not isinstance(axes, str) and set(axes) <= set(AXES)
                and isinstance(divisor, (int, float)) and divisor > 0):
            raise AssertionError(f"sequence_parallel={sp}, {name}: expected (axes, "
                                 f"divisor), axes a tuple of names from {AXES} and "
                                 f"divisor a positive number, got {entry!r}")
    return {n: (tuple(a for a in AXES if a in axes), d)     # in AXES' order
            for n, (axes, d) in plan.items()}


def _local_grads(block, sp, groups, shape):
    """This rank's gradients, before any dp/cp reduction: its cell of the batch
    (dp splits sequences, cp tokens), its tp shard of the weights, each cell's
    loss the mean over its tokens (under SP each tp rank adds its tokens' share)."""
    dp_rank, cp_rank, tp_rank = _coords(dist.get_rank(), shape)
    x, y = (t.chunk(shape[0], 0)[dp_rank].chunk(shape[1], 1)[cp_rank]
            for t in _sync_data())
    cell = y.numel()
    if sp:
        x, y = x.chunk(shape[2], 1)[tp_rank], y.chunk(shape[2], 1)[tp_rank]
    model = _TPMLPBlock(block, groups[("tp",)], sp)
    ((model(x) - y) ** 2).sum().div(cell).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _why_grad(name, axes, divisor, raw, want, shape, full_shape):
    """What a single change of the plan fixes, read from every rank's raw gradient."""
    rank = dist.get_rank()

    def reduced(candidate):
        return sum(raw[r] for r in _group_of(rank, shape, candidate))

    def fits(total):                      # total / d == want for some d > 0?
        d = (total * want).sum() / (want * want).sum()
        return d > 0 and torch.allclose(total / d, want, **SYNC_TOL), float(d)

    tp_ranks = [raw[r] for r in _group_of(rank, shape, ("tp",))]
    differ = not all(torch.allclose(t, tp_ranks[0], **SYNC_TOL) for t in tp_ranks)
    for extra in AXES:
        if extra not in axes and fits(reduced(axes + (extra,)))[0]:
            return {"dp": "partial over dp (each dp rank saw its own sequences), not "
                          "reduced over dp",
                    "cp": "partial over cp (each cp rank saw its own s/cp tokens of "
                          "every sequence), not reduced over cp",
                    "tp": "partial over tp under SP (each tp rank's copy saw only its "
                          "own s/tp tokens), not reduced over tp"}[extra]
    for extra in axes:
        if fits(reduced(tuple(a for a in axes if a != extra)))[0]:
            if extra != "tp":
                return f"not to be reduced over {extra}"
            if tuple(raw[rank].shape) != full_shape:
                return ("sharded over tp: the tp ranks hold different slices of it, "
                        "and summing them adds unrelated numbers; not reduced over tp")
            return ("already whole on each tp rank (the same on all: without SP every "
                    "tp rank computes it from every token), so reducing over tp "
                    f"counts it {shape[2]} times")
    ok, d = fits(reduced(axes))
    if ok:
        return (f"reduced over the right groups {axes}, but divided by {divisor:g}: "
                f"the result is {d / divisor:.3g} x the one-process gradient; the mean "
                f"over the batch needs {d:.3g} (each cell's loss is the mean over its "
                "own tokens)")
    return (f"reduced over {axes} and divided by {divisor:g}, it differs from the "
            "one-process gradient" + ("; its tp ranks hold different values" if differ
                                      else ""))


def check_grad_sync(fn, dp=2, cp=2, tp=2):
    """``fn(names, dp, cp, tp, sequence_parallel)`` -> {name: (axes, divisor)}, each
    gradient all-reduced over the group along ``axes`` and divided by ``divisor``,
    against one process's gradients of the whole block on the whole batch."""
    shape = (dp, cp, tp)
    if dist.get_world_size() != math.prod(shape):
        raise ValueError(f"a {dp} x {cp} x {tp} grid needs {math.prod(shape)} ranks")
    groups = _subset_groups(shape)
    want_full, rank = _reference_grads(), dist.get_rank()
    tp_rank = _coords(rank, shape)[2]
    runs = []              # every collective first: a rank that fails then hangs no one
    for sp in (False, True):
        local = _local_grads(_MLPBlock(SYNC_SHAPE[-1]), sp, groups, shape)
        plan = _valid_plan(fn(list(local), dp, cp, tp, sp), list(local), sp)
        for name, g in local.items():
            axes, divisor = plan[name]
            grad = g.clone()
            if axes:
                dist.all_reduce(grad, group=groups[axes])
            raw = [torch.empty_like(g) for _ in range(math.prod(shape))]
            dist.all_gather(raw, g.contiguous())
            runs.append((sp, name, axes, divisor, grad / divisor, raw))
    for sp, name, axes, divisor, grad, raw in runs:
        full = want_full[name]
        dim = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}.get(name)
        want = full if dim is None else full.chunk(tp, dim)[tp_rank]
        if not torch.allclose(grad, want, **SYNC_TOL):
            why = _why_grad(name, axes, divisor, raw, want, shape,
                            tuple(full.shape))
            raise AssertionError(f"sequence_parallel={sp}, rank {rank}, {name}: {why}")


# -- one process: what the chapter's parallel runs must equal -----------------------

def reference_params(cfg, batches, lr) -> dict:
    """Parameters of one process's ``models.GPT`` after SGD on each full batch."""
    model = models.GPT(cfg, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for ids, targets in batches:
        opt.zero_grad()
        model(ids, targets).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def reference_3d(pp, hidden, batches, lr) -> list:
    """One process: ``mesh.mlp_stack``'s pp blocks in a row, SGD on the full
    batches; each block's parameters under the names of ``mesh.TPMLP``."""
    blocks = mesh.mlp_stack(pp, hidden)
    params = [p for b in blocks for p in b.parameters()]
    for x, y in batches:
        for p in params:
            p.grad = None
        out = x
        for b in blocks:
            out = b(out)
        F.mse_loss(out, y).backward()
        with torch.no_grad():
            for p in params:
                p -= lr * p.grad
    return [{"fc1.weight": b[0].weight, "fc1.bias": b[0].bias, "fc2.weight": b[2].weight,
             "fc2.bias": b[2].bias} for b in blocks]
