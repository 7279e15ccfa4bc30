"""The checks of chapter 8 (hybrid parallelism on a DeviceMesh) and its one-process references.

    device_mesh.check_axis_groups(axis_groups)                   # in the kernel
    ls.run(device_mesh.check_average_grads, average_grads, 2, 2, world_size=4)
    device_mesh.reference_params(cfg, batches, lr)               # what the grid must equal

Each check says what is wrong with an answer: the case, what came back, what
was expected and the likely reason.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from labsupport import models
from labsupport.device_mesh import mesh

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


def _grad_cases(rank):
    """A Linear whose weight gradient on ``rank`` is the constant rank + 1."""
    layer = torch.nn.Linear(2, 2, bias=False)
    layer.weight.grad = torch.full((2, 2), float(rank + 1))
    return layer


def check_average_grads(fn, dp=2, tp=2):
    """``fn(model, dp_group)`` on a (dp, tp) grid: each gradient the mean over its column."""
    tp_group, dp_group = mesh.grid_groups(dp, tp)
    rank = dist.get_rank()
    layer = _grad_cases(rank)
    fn(layer, dp_group)
    got = layer.weight.grad[0, 0].item()
    rows, columns = mesh.grid_ranks(dp, tp)
    column, row = columns[rank % tp], rows[rank // tp]
    want = sum(r + 1 for r in column) / dp
    hints = {sum(r + 1 for r in column): "summed but not divided by the dp size",
             sum(r + 1 for r in range(dp * tp)) / (dp * tp):
             "averaged over the whole world, not the dp group",
             sum(r + 1 for r in row) / tp:
             "averaged over the tp group: TP ranks hold different shards"}
    if abs(got - want) > 1e-6:
        why = hints.get(got, "expected the mean over the dp group")
        raise AssertionError(f"rank {rank}: gradient {got:g}, expected {want:g} "
                             f"(mean over ranks {column}): {why}")
    if not torch.equal(layer.weight.grad, torch.full((2, 2), want)):
        raise AssertionError(f"rank {rank}: the gradient is not the same everywhere")


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
