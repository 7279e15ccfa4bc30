"""Chapter 4's your-turn checks: Megatron's g, the vocabulary-parallel lookup.

    from labsupport.grading.chapters import tensor_parallel as checks
    ls.run(checks.check_reduce_from_tp, ReduceFromTP, world_size=4)
    ls.run(checks.check_masked_lookup, masked_lookup, world_size=4)

Each check runs on every rank of a launched group, with inputs that differ
by rank, and says which rank, which direction (forward or backward) and
which value is wrong, and why. Until the reader has written the function,
``your_turn.check`` says so without failing.
"""
import torch
import torch.distributed as dist


def check_reduce_from_tp(g):
    """The reader's g, ``g.apply(x, group)``, on this rank: sum forward, identity backward."""
    rank, n = dist.get_rank(), dist.get_world_size()
    x = (torch.arange(6.0).view(2, 3) * (rank + 1)).requires_grad_()
    y = g.apply(x, None)
    want = torch.arange(6.0).view(2, 3) * n * (n + 1) / 2
    assert isinstance(y, torch.Tensor) and torch.equal(y.detach(), want), (
        f"rank {rank}: forward returned {_show(y)}; g's forward is the sum over the "
        f"{n} ranks, {want.tolist()} (dist.all_reduce of a copy of x)")
    y.backward(torch.full_like(y, rank + 1.0))
    assert x.grad is not None and torch.equal(x.grad, torch.full_like(x, rank + 1.0)), (
        f"rank {rank}: backward gave x.grad = {_show(x.grad)} for an incoming gradient of "
        f"{rank + 1.0} everywhere; g's backward is the identity: each rank keeps its own "
        "gradient (an all-reduce there is f's backward, and would sum the ranks' gradients)")
    return True


def check_masked_lookup(fn, vocab_size=12, hidden=3):
    """Run the reader's ``fn(ids, weight, start)`` on this rank's slice of a known table."""
    rank, n = dist.get_rank(), dist.get_world_size()
    table = torch.arange(1.0, vocab_size * hidden + 1).view(vocab_size, hidden)
    rows = vocab_size // n
    start = rank * rows
    weight = table[start:start + rows].clone().requires_grad_()
    ids = torch.arange(vocab_size).flip(0).view(2, -1)                 # (b, s)
    out = fn(ids, weight, start)
    assert isinstance(out, torch.Tensor) and out.shape == (*ids.shape, hidden), (
        f"rank {rank}: expected a tensor of shape {(*ids.shape, hidden)} (b, s, h), "
        f"got {_show(out)}")
    for i in ids.flatten().tolist():
        mine = start <= i < start + rows
        want = table[i] if mine else torch.zeros(hidden)
        got = out.detach().reshape(-1, hidden)[ids.flatten().tolist().index(i)]
        assert torch.equal(got, want), (
            f"rank {rank} (rows {start}..{start + rows - 1} of the table): id {i} gave "
            f"{got.tolist()}, expected {want.tolist()}: " + (
                "its row, weight[id - start]" if mine else
                "zeros, since another rank owns it (the all-reduce adds that rank's row)"))
    out.sum().backward()
    assert weight.grad is not None and torch.equal(weight.grad, torch.ones_like(weight)), (
        f"rank {rank}: each id appears once, so every row of weight should get gradient 1; "
        f"got {_show(weight.grad)}. Ids outside the slice must add nothing to any row "
        "(zero their output rows, e.g. with masked_fill, after the lookup)")
    return True


def _show(t):
    return t.tolist() if isinstance(t, torch.Tensor) else repr(t)
