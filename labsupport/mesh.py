"""Hybrid parallelism on a 2-D (dp, tp) grid of ranks, chapter 8.

    tp_group, dp_group = grid_groups(dp=2, tp=2)     # on every rank
    model = TensorParallelGPT(models.GPT(cfg, seed=0), tp_group)
    loss = hybrid_step(model, opt, ids, targets, dp_group)  # calls.record(): collectives

Rank r sits at (dp_rank, tp_rank) = (r // tp, r % tp): the rows of the grid
are the tp groups (consecutive ranks, on one node in practice), the columns
the dp groups: tensor parallelism inside a row, gradient averaging across a
column, the rule of Narayanan et al. (arXiv 2104.04473, Section 3.3): tensor
parallelism within a node, data parallelism across. The code between the
lesson markers is the notebook's, character for character (tests/test_mesh.py).
"""
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labsupport import calls, models
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from labsupport.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, enter_tp,
                                        parallelize_dtensor)
from labsupport.tp_gpt import TensorParallelGPT


# --- lesson: notebooks/08_device_mesh.ipynb (the notebook's copy must match) ---
def grid_coords(rank, tp):
    """(dp_rank, tp_rank) of ``rank``: rows of ``tp`` consecutive ranks."""
    return rank // tp, rank % tp


def grid_ranks(dp, tp):
    """The ranks of every tp group (rows) and every dp group (columns)."""
    rows = [list(range(i * tp, (i + 1) * tp)) for i in range(dp)]
    columns = [list(range(j, dp * tp, tp)) for j in range(tp)]
    return rows, columns


def grid_groups(dp, tp):
    """This rank's (tp_group, dp_group); every rank makes all, in order."""
    if dist.get_world_size() != dp * tp:
        raise ValueError(f"a {dp} x {tp} grid needs {dp * tp} ranks, "
                         f"not {dist.get_world_size()}: start that many")
    rows, columns = grid_ranks(dp, tp)
    tp_groups = [dist.new_group(ranks) for ranks in rows]
    dp_groups = [dist.new_group(ranks) for ranks in columns]
    dp_rank, tp_rank = grid_coords(dist.get_rank(), tp)
    return tp_groups[dp_rank], dp_groups[tp_rank]


def average_grads(model, dp_group):
    """Each gradient averaged over ``dp_group`` (each saw 1/dp of the batch)."""
    dp = dist.get_world_size(dp_group)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=dp_group)
            p.grad /= dp


def hybrid_step(model, opt, ids, targets, dp_group):
    """One step on this rank's 1/dp of the global batch; returns its loss."""
    dp, dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    ids, targets = ids.chunk(dp)[dp_rank], targets.chunk(dp)[dp_rank]
    opt.zero_grad()
    loss = model(ids, targets)                     # TP collectives: tp_group
    loss.backward()
    average_grads(model, dp_group)                 # DP collectives: dp_group
    opt.step()
    return loss.detach()


def train_device_mesh(cfg, batches, lr, dp, tp):
    """K steps on init_device_mesh's (dp, tp) mesh: DTensor TP on "tp", then
    fully_shard on "dp". Returns the full parameters (``full_tensor``), the
    same on every rank.
    """
    # DTensor warns that gathering a (dp, tp)-sharded parameter takes two
    # all-gathers
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(
        logging.ERROR)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = parallelize_dtensor(models.GPT(cfg, seed=0), mesh["tp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    dp_rank = mesh["dp"].get_local_rank()
    for ids, targets in batches:
        opt.zero_grad()
        model(ids.chunk(dp)[dp_rank], targets.chunk(dp)[dp_rank]).backward()
        opt.step()
    return {n: p.full_tensor().detach() for n, p in model.named_parameters()}
# --- end of lesson ---


def reference_params(cfg, batches, lr) -> dict:
    """Parameters of one process's ``models.GPT`` after SGD on each full batch."""
    model = models.GPT(cfg, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for ids, targets in batches:
        opt.zero_grad()
        model(ids, targets).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_grid(cfg, batches, lr, dp, tp, log=False):
    """K hybrid steps on a hand-made (dp, tp) grid; this rank's parameters (and the
    ``calls.Log`` of its calls: ``log.bytes_by_group()``)."""
    tp_group, dp_group = grid_groups(dp, tp)
    model = TensorParallelGPT(models.GPT(cfg, seed=0), tp_group)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with calls.record() as recorded:
        for ids, targets in batches:
            hybrid_step(model, opt, ids, targets, dp_group)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return (params, recorded) if log else params


class TPMLP(nn.Module):
    """fc1 column-parallel, GELU, fc2 row-parallel, inside ``tp_group`` (Megatron's f ... g)."""

    def __init__(self, mlp: nn.Sequential, tp_group):
        super().__init__()
        self.group = tp_group
        self.fc1 = ColumnParallelLinear(mlp[0], tp_group)    # (h -> 4h/t)
        self.act = mlp[1]
        self.fc2 = RowParallelLinear(mlp[2], tp_group)       # (4h/t -> h), all-reduce

    def forward(self, x):                                    # (b, s, h)
        return self.fc2(self.act(self.fc1(enter_tp(x, self.group))))


def cube_ranks(dp, pp, tp):
    """{axis: its groups} of a dp x pp x tp grid, rank r at (r // (pp tp), r // tp % pp, r % tp)."""
    coords = {r: (r // (pp * tp), r // tp % pp, r % tp) for r in range(dp * pp * tp)}
    out = {}
    for axis, name in enumerate(("dp", "pp", "tp")):
        groups = {}
        for r, c in coords.items():
            groups.setdefault(c[:axis] + c[axis + 1:], []).append(r)
        out[name] = sorted(groups.values())
    return out


def cube_groups(dp, pp, tp):
    """{axis: this rank's group}; every rank makes every group of every axis, in order."""
    rank, mine = dist.get_rank(), {}
    for axis, groups in cube_ranks(dp, pp, tp).items():
        for ranks in groups:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[axis] = group
    return mine


def mlp_stack(pp, hidden, seed=0):
    """pp MLP blocks (h -> 4h -> h), one per pipeline stage: the 3-D step's model."""
    with models.seeded(seed):
        return [nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(approximate="tanh"),
                              nn.Linear(4 * hidden, hidden)) for _ in range(pp)]


def step_3d(stage, x, y, lr, groups, pp):
    """One SGD step of a pp-stage pipeline (one micro-batch) of TPMLPs, grads averaged over dp.

    The activation goes to the same (dp, tp) place of the next stage (rank + tp)
    and its gradient comes back; Narayanan et al. 2021 (arXiv 2104.04473), §2.
    """
    rank, tp = dist.get_rank(), dist.get_world_size(groups["tp"])
    dp, dp_rank = dist.get_world_size(groups["dp"]), dist.get_rank(groups["dp"])
    s = dist.get_rank(groups["pp"])                               # this rank's stage
    x, y = x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank]             # (b/dp, s, h)
    stage.zero_grad()
    inp = x if s == 0 else torch.empty_like(x)
    if s > 0:
        dist.recv(inp, rank - tp)
        inp.requires_grad_()
    out = stage(inp)
    if s < pp - 1:
        dist.send(out.detach(), rank + tp)
        grad = torch.empty_like(out)
        dist.recv(grad, rank + tp)
        out.backward(grad)
    else:
        F.mse_loss(out, y).backward()
    if s > 0:
        dist.send(inp.grad, rank - tp)
    with torch.no_grad():
        for p in stage.parameters():
            dist.all_reduce(p.grad, group=groups["dp"])
            p -= lr * p.grad / dp


def train_3d(dp, pp, tp, hidden, batches, lr):
    """K 3-D steps; this rank's stage parameters (its TP shards of block ``stage``)."""
    groups = cube_groups(dp, pp, tp)
    stage = TPMLP(mlp_stack(pp, hidden)[dist.get_rank(groups["pp"])], groups["tp"])
    for x, y in batches:
        step_3d(stage, x, y, lr, groups, pp)
    return {n: p.detach().clone() for n, p in stage.named_parameters()}


def reference_3d(pp, hidden, batches, lr) -> list:
    """One process: the pp blocks in a row, SGD on the full batches; each block's params."""
    blocks = mlp_stack(pp, hidden)
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


# -- the checks behind the chapter's your-turn cells ----------------------------------

def check_grid_coords(fn):
    """``fn(rank, tp)`` against (rank // tp, rank % tp) on several grids (any rank runs it)."""
    for dp, tp in ((2, 2), (4, 2), (2, 4), (3, 1), (1, 3)):
        for rank in range(dp * tp):
            got, want = tuple(fn(rank, tp)), grid_coords(rank, tp)
            if got != want:
                raise AssertionError(
                    f"grid {dp} x {tp}: rank {rank} -> {got}, expected (dp_rank, tp_rank) = "
                    f"{want}: the tp groups are rows of {tp} consecutive ranks")


def _grad_cases(rank):
    """A Linear whose weight gradient on ``rank`` is the constant rank + 1."""
    layer = torch.nn.Linear(2, 2, bias=False)
    layer.weight.grad = torch.full((2, 2), float(rank + 1))
    return layer


def check_average_grads(fn, dp=2, tp=2):
    """``fn(model, dp_group)`` on a (dp, tp) grid: each gradient the mean over its column."""
    tp_group, dp_group = grid_groups(dp, tp)
    rank = dist.get_rank()
    layer = _grad_cases(rank)
    fn(layer, dp_group)
    got = layer.weight.grad[0, 0].item()
    column = grid_ranks(dp, tp)[1][rank % tp]
    want = sum(r + 1 for r in column) / dp
    world = sum(r + 1 for r in range(dp * tp)) / (dp * tp)
    hints = {sum(r + 1 for r in column): "summed but not divided by the dp size",
             world: "averaged over the whole world, not the dp group",
             sum(r + 1 for r in grid_ranks(dp, tp)[0][rank // tp]) / tp:
             "averaged over the tp group: TP ranks hold different shards"}
    if abs(got - want) > 1e-6:
        why = hints.get(got, "expected the mean over the dp group")
        raise AssertionError(f"rank {rank}: gradient {got:g}, expected {want:g} "
                             f"(mean over ranks {column}): {why}")
    if not torch.equal(layer.weight.grad, torch.full((2, 2), want)):
        raise AssertionError(f"rank {rank}: the gradient is not the same everywhere")
