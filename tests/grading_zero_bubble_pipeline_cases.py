"""Zero-bubble B, W and schedules, all wrong, for tests/test_grading_zero_bubble_pipeline.py.

Imports only torch (the ranks import this module to unpickle each function). The
reference is the source notebook's (tests/sources.py), never a copy here.
"""
import torch


def backward_input_no_dzs(x, y, dy, zs):
    """Only dL/dx: W has nothing to work with."""
    (dx,) = torch.autograd.grad(y, [x], dy)
    return dx, []


def backward_weight_assigned(layers, dzs):
    """= instead of +=: only the last micro-batch's gradient is left."""
    for (linear, h, _), dz in zip(layers, dzs):
        linear.weight.grad = dz.T @ h
        linear.bias.grad = dz.sum(0)


def backward_weight_transposed(layers, dzs):
    """h^T dz: the right shape only for the square hidden layers, and wrong there."""
    for (linear, h, _), dz in zip(layers, dzs):
        grad = h.T @ dz
        if grad.shape == linear.weight.shape:
            linear.weight.grad += grad
        linear.bias.grad += dz.sum(0)


def backward_weight_noop(layers, dzs):
    pass


def train_step_w_at_once(pp):
    """1F1B with B and then W at once: W runs before the next B, on the critical path."""
    p, m, rank = pp.world_size, pp.m, pp.rank
    warmup = min(p - rank - 1, m)
    for i in range(warmup):
        pp.forward(rank, i)
    for k in range(m - warmup):
        pp.forward(rank, warmup + k)
        pp.backward_input(rank, k)
        pp.backward_weight(rank, k)
    for k in range(m - warmup, m):
        pp.backward_input(rank, k)
        pp.backward_weight(rank, k)


def train_step_w_dropped(pp):
    """ZB-H1 without its last loop: the W's postponed past the cool-down never run."""
    p, m, rank = pp.world_size, pp.m, pp.rank
    warmup, w = min(p - rank - 1, m), 0
    for i in range(warmup):
        pp.forward(rank, i)
    for k in range(m - warmup):
        pp.forward(rank, warmup + k)
        pp.backward_input(rank, k)
        if k >= rank:
            pp.backward_weight(rank, w)
            w += 1
    for k in range(m - warmup, m):
        pp.backward_input(rank, k)
        pp.backward_weight(rank, w)
        w += 1


def train_step_w_at_end(pp):
    """B's in 1F1B order, every W after the last B: m micro-batches held at the end."""
    p, m, rank = pp.world_size, pp.m, pp.rank
    warmup = min(p - rank - 1, m)
    for i in range(warmup):
        pp.forward(rank, i)
    for k in range(m - warmup):
        pp.forward(rank, warmup + k)
        pp.backward_input(rank, k)
    for k in range(m - warmup, m):
        pp.backward_input(rank, k)
    for i in range(m):
        pp.backward_weight(rank, i)


def train_step_mixed_up(pp):
    """Rank 0 runs F, B, W per micro-batch, the others all F's first: rank 0 waits in B of
    micro-batch 0 for rank 1, which waits for rank 0's F of micro-batch 1. A deadlock."""
    for i in range(pp.m):
        pp.forward(pp.rank, i)
        if pp.rank == 0:
            pp.backward_input(pp.rank, i)
            pp.backward_weight(pp.rank, i)
    for i in range(pp.m if pp.rank else 0):
        pp.backward_input(pp.rank, i)
        pp.backward_weight(pp.rank, i)


def train_step_w_before_b(pp):
    """Each rank calls W of a micro-batch before its B."""
    for i in range(pp.m):
        pp.forward(pp.rank, i)
    for i in range(pp.m):
        pp.backward_weight(pp.rank, i)
        pp.backward_input(pp.rank, i)
