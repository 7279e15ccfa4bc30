"""Assignment 4's functions, right and wrong, for tests/test_grading_mesh.py.

Imports only torch (the ranks import this module to unpickle each function).
The reference functions are the assignment's solution, kept identical by a test.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F


def make_groups(dp, tp):
    """This rank's (tp_group, dp_group): rows of tp consecutive ranks, and columns."""
    rank = dist.get_rank()
    tp_groups = [dist.new_group(list(range(i * tp, (i + 1) * tp))) for i in range(dp)]
    dp_groups = [dist.new_group(list(range(j, dp * tp, tp))) for j in range(tp)]
    return tp_groups[rank // tp], dp_groups[rank % tp]


def dp_tp_step(model, x, y, lr, tp_group, dp_group):
    """One SGD step on this rank's 1/dp of the batch, gradients averaged over dp."""
    dp, dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    x, y = x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank]
    model.zero_grad()
    F.mse_loss(model(x), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            dist.all_reduce(p.grad, group=dp_group)
            p -= lr * p.grad / dp


def swapped_groups(dp, tp):
    """Wrong: rows and columns swapped."""
    tp_group, dp_group = make_groups(dp, tp)
    return dp_group, tp_group


def root_only_step(model, x, y, lr, tp_group, dp_group):
    """Deadlock: only dp rank 0 calls the all-reduce (as if it were a reduce to a root)."""
    dp, dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    x, y = x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank]
    model.zero_grad()
    F.mse_loss(model(x), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            if dp_rank == 0:
                dist.all_reduce(p.grad, group=dp_group)
            p -= lr * p.grad / dp


def world_average_step(model, x, y, lr, tp_group, dp_group):
    """Wrong: gradients averaged over the whole world."""
    dp, dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    x, y = x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank]
    model.zero_grad()
    F.mse_loss(model(x), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p -= lr * p.grad / dist.get_world_size()


def tp_sync_step(model, x, y, lr, tp_group, dp_group):
    """Wrong: the sharded weights' gradients also all-reduced over tp."""
    dp, dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    x, y = x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank]
    model.zero_grad()
    F.mse_loss(model(x), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            dist.all_reduce(p.grad, group=tp_group)
            dist.all_reduce(p.grad, group=dp_group)
            p -= lr * p.grad / dp
