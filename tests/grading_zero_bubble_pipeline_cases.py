"""Zero-bubble B, W and schedules, all wrong, for
tests/test_grading_zero_bubble_pipeline.py; and ``Slow``, a right schedule made
slow (tests/test_grades_under_load.py).

Imports only torch (the ranks import this module to unpickle each function). The
reference is the source notebook's (tests/sources.py), never a copy here.
"""
import time

import torch


class Slow:
    """A right schedule made slow: its last rank computes for ``seconds`` of its own
    thread's CPU time before the step, while the others wait for its messages (in
    the step on the ranks; not where the schedule is played on stand-ins).

    Wall time is at least CPU time, so each run lasts more than ``seconds`` on
    any machine, loaded or not: a flat deadline shorter than that would call
    it a deadlock. The schedule's calls and their order are the schedule's:
    every check must grade it exactly as the schedule itself.
    """

    def __init__(self, schedule, seconds: float):
        self.schedule, self.seconds = schedule, seconds
        self.__name__ = f"{schedule.__name__}_slow"

    def __call__(self, pp):
        # in the step on the ranks only (a ZBRank), not where the schedule is played on
        # stand-ins: the grader's ideal machine, each rank's plan of messages
        if pp.rank == pp.world_size - 1 and type(pp).__name__ == "ZBRank":
            start = time.thread_time()  # (a test's answer; no grader reads a clock)
            while time.thread_time() - start < self.seconds:
                pass
        return self.schedule(pp)


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
