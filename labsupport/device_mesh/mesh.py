"""Hybrid parallelism on a grid of ranks, chapter 8's lesson (and nothing else).

    tp_group, dp_group = grid_groups(dp=2, tp=2)     # on every rank
    model = TensorParallelGPT(models.GPT(cfg, seed=0), tp_group)
    loss = hybrid_step(model, opt, ids, targets, dp_group)
    axis_groups((2, 2, 2), 0)                        # [[0, 4], [1, 5], [2, 6], [3, 7]]

Ranks are numbered row-major over the mesh's shape, the last dimension
varying fastest: rank r of a (dp, tp) grid sits at (r // tp, r % tp), so a
tp group is tp consecutive ranks (one node in practice), as in
``init_device_mesh`` and in Megatron Core's default order, tp first.
The code between the lesson markers is the notebook's, character for
character (tests/test_mesh.py); the chapter's checks and one-process
references are in ``labsupport.device_mesh.checks``.
"""
import logging
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from labsupport import models
from labsupport.tensor_parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    enter_tp,
    parallelize_dtensor,
)


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


def axis_groups(shape, axis):
    """The groups along ``axis`` of a mesh of ``shape`` (ranks row-major, the
    last axis fastest), each sorted, in order of their first rank."""
    stride = math.prod(shape[axis + 1:])      # ranks one step apart on axis
    size = shape[axis]
    starts = [r for r in range(math.prod(shape)) if r // stride % size == 0]
    return [[s + i * stride for i in range(size)] for s in starts]


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
    """One step per batch on init_device_mesh's (dp, tp) mesh: DTensor TP on "tp", then
    fully_shard on "dp", each block then the root (chapter 7). Returns the full
    parameters (``full_tensor``), the same on every rank.
    """
    # DTensor warns that gathering a (dp, tp)-sharded parameter takes two
    # all-gathers
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(
        logging.ERROR)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = parallelize_dtensor(models.GPT(cfg, seed=0), mesh["tp"])
    for block in model.blocks:                     # one unit per block: its
        fully_shard(block, mesh=mesh["dp"])        # all-gather just before it
    fully_shard(model, mesh=mesh["dp"])            # the root: the rest
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    dp_rank = mesh["dp"].get_local_rank()
    for ids, targets in batches:
        opt.zero_grad()
        model(ids.chunk(dp)[dp_rank], targets.chunk(dp)[dp_rank]).backward()
        opt.step()
    return {n: p.full_tensor().detach() for n, p in model.named_parameters()}


class TPMLP(nn.Module):
    """fc1 column-parallel, GELU, fc2 row-parallel over ``tp_group``
    (chapter 4's MLP: f before fc1, g after fc2)."""

    def __init__(self, mlp, tp_group):
        super().__init__()
        self.group = tp_group
        self.fc1 = ColumnParallelLinear(mlp[0], tp_group)  # h -> 4h/TP
        self.act = mlp[1]
        self.fc2 = RowParallelLinear(mlp[2], tp_group)     # 4h/TP -> h, g

    def forward(self, x):                                  # (b, s, h)
        return self.fc2(self.act(self.fc1(enter_tp(x, self.group))))


def mlp_stack(pp, hidden, seed=0):
    """pp MLP blocks (h -> 4h -> h), one per pipeline stage."""
    with models.seeded(seed):
        return [nn.Sequential(nn.Linear(hidden, 4 * hidden),
                              nn.GELU(approximate="tanh"),
                              nn.Linear(4 * hidden, hidden))
                for _ in range(pp)]


def cube_groups(dp, pp, tp):
    """{axis: this rank's group} on a (dp, pp, tp) mesh; every rank makes
    every group of every axis, in the same order."""
    rank, mine = dist.get_rank(), {}
    for axis, name in enumerate(("dp", "pp", "tp")):
        for ranks in axis_groups((dp, pp, tp), axis):
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[name] = group
    return mine


def step_3d(stage, x, y, lr, groups, pp):
    """One SGD step of a pp-stage pipeline (one micro-batch) of TPMLPs,
    gradients averaged over dp."""
    rank, tp = dist.get_rank(), dist.get_world_size(groups["tp"])
    dp, dp_rank = dist.get_world_size(groups["dp"]), dist.get_rank(groups["dp"])
    s = dist.get_rank(groups["pp"])                     # this rank's stage
    x, y = x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank]   # (b/dp, s, h)
    stage.zero_grad()
    inp = x if s == 0 else torch.empty_like(x)
    if s > 0:                                           # from rank - tp
        dist.recv(inp, rank - tp)
        inp.requires_grad_()
    out = stage(inp)
    if s < pp - 1:                                      # to rank + tp
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
    """One 3-D step per batch; this rank's parameters (its TP shards of its stage)."""
    groups = cube_groups(dp, pp, tp)
    block = mlp_stack(pp, hidden)[dist.get_rank(groups["pp"])]
    stage = TPMLP(block, groups["tp"])
    for x, y in batches:
        step_3d(stage, x, y, lr, groups, pp)
    return {n: p.detach().clone() for n, p in stage.named_parameters()}
# --- end of lesson ---
