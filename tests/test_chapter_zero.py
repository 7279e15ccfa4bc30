"""labsupport.zero.checks, behind chapter 7's your-turn cells: right and wrong answers.

Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_chapter_zero.py

ZeRO-2 by whole tensors (reduce to each owner, step, broadcast from it) and
FSDP2's rows of a parameter: the chapter's solutions pass; an all-reduce,
gradients kept on every rank, a sum instead of a mean, a broadcast from the
wrong rank, and FSDP2's rows balanced instead of chunked each fail with a
message that names the mistake; an untouched stub is "not written yet".
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import labsupport as ls
from labsupport.zero import checks

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def by_tensor(params, owners, optimizer):
    """The chapter's solution."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for p, owner in zip(params, owners):
        dist.reduce(p.grad, dst=owner)
        if owner == rank:
            p.grad /= world_size
        else:
            p.grad = None
    optimizer.step()
    for p, owner in zip(params, owners):
        dist.broadcast(p.detach(), src=owner)


def with_all_reduce(params, owners, optimizer):
    for p in params:
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    optimizer.step()
    for p, owner in zip(params, owners):
        dist.broadcast(p.detach(), src=owner)


def keeping_gradients(params, owners, optimizer):
    for p, owner in zip(params, owners):
        dist.reduce(p.grad, dst=owner)
        p.grad /= dist.get_world_size()
    optimizer.step()
    for p, owner in zip(params, owners):
        dist.broadcast(p.detach(), src=owner)


def the_sum(params, owners, optimizer):
    for p, owner in zip(params, owners):
        dist.reduce(p.grad, dst=owner)
        if owner != dist.get_rank():
            p.grad = None
    optimizer.step()
    for p, owner in zip(params, owners):
        dist.broadcast(p.detach(), src=owner)


def from_rank_0(params, owners, optimizer):
    for p, owner in zip(params, owners):
        dist.reduce(p.grad, dst=owner)
        if owner == dist.get_rank():
            p.grad /= dist.get_world_size()
        else:
            p.grad = None
    optimizer.step()
    for p in params:
        dist.broadcast(p.detach(), src=0)


def rows(dim0, rank, world_size):
    chunk = -(-dim0 // world_size)
    return min(rank * chunk, dim0), min((rank + 1) * chunk, dim0)


def balanced_rows(dim0, rank, world_size):
    return rank * dim0 // world_size, (rank + 1) * dim0 // world_size


def a_list(dim0, rank, world_size):
    return list(rows(dim0, rank, world_size))


def stub(*args):
    raise ls.NotWritten("stub")


SIZES = (5, 9, 1, 7, 3)


def _torch_partition():
    """The rank ZeroRedundancyOptimizer gives each tensor of SIZES."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    params = [torch.nn.Parameter(torch.zeros(n)) for n in SIZES]
    opt = ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1)
    per_rank = opt._partition_parameters()        # [rank][group]["params"]
    return [next(r for r, groups in enumerate(per_rank)
                 for g in groups if any(q is p for q in g["params"])) for p in params]


def test_owners_deal_the_largest_tensors_first_as_zero_redundancy_optimizer_does():
    # 9 -> rank 0, 7 -> 1, 5 -> 1 (7 < 9), 3 -> 0 (9 < 12), 1 -> 0 (a tie: the lower rank)
    assert checks.owners([torch.empty(n) for n in SIZES], 2) == [1, 0, 0, 1, 0]
    assert ls.run(_torch_partition, world_size=2)[0] == [1, 0, 0, 1, 0]


def test_the_chapters_answers_pass(capsys):
    checks.check_zero2_by_tensor(by_tensor)
    checks.check_fsdp2_rows(rows)
    out = capsys.readouterr().out
    assert "✓ zero2_by_tensor" in out and "✓ fsdp2_rows" in out


@pytest.mark.parametrize("answer, message", [
    (with_all_reduce, "called {'all_reduce'"),
    (keeping_gradients, "still has a gradient after your function"),
    (the_sum, "is not the mean over the ranks"),
    (from_rank_0, "broadcast from the owner"),
])
def test_each_wrong_zero2_by_tensor_is_named(answer, message):
    with pytest.raises(ls.RankError, match=message.replace("(", r"\(").replace("{", r"\{")):
        checks.check_zero2_by_tensor(answer)


@pytest.mark.parametrize("answer, message", [
    (balanced_rows, "as torch.chunk does"),
    (a_list, "return a pair of ints"),
])
def test_each_wrong_fsdp2_rows_is_named(answer, message):
    with pytest.raises(ls.RankError, match=message):
        checks.check_fsdp2_rows(answer)


@pytest.mark.parametrize("check", [checks.check_zero2_by_tensor, checks.check_fsdp2_rows])
def test_an_untouched_stub_is_not_written_yet(check, capsys):
    assert check(stub) is None
    assert "is not written yet" in capsys.readouterr().out
