"""Chapter 4's your-turn checks: the vocabulary-parallel lookup, SP's column layer.

    from labsupport.tensor_parallel import checks
    ls.run(checks.check_shard_saving_linear, ShardSavingLinear, world_size=4)
    ls.run(checks.check_masked_lookup, masked_lookup, world_size=4)

Each check runs on every rank of a launched group, with inputs that differ
by rank, and says which rank, which direction (forward or backward) and
which value is wrong, and why. Until the reader has written the function,
``your_turn.check`` says so without failing.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from labsupport import calls
from labsupport.memory import tally
from labsupport.tensor_parallel import probe as tp_probe

_TOL = dict(rtol=1e-5, atol=1e-5)  # fp32: the same sums in another order


def check_shard_saving_linear(fn, batch=2, seq=8, h_in=6, h_out=4):
    """The reader's ``fn.apply(x, weight, group)`` on this rank, against one process.

    ``x`` is this rank's sequence shard (b, s/N, h_in), ``weight`` its rows of W
    (h_out/N, h_in); the result is x gathered along the sequence times W_i^T.
    Checks the forward, what autograd keeps (the shard only), that backward
    gathers again, and both gradients, naming the usual mistakes.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    x_full, w_full, g_full, ref_x, ref_w, y_ref = _one_process(batch, seq, h_in, h_out)
    x = x_full.chunk(n, 1)[rank].clone().requires_grad_()
    w = w_full.chunk(n, 0)[rank].clone().requires_grad_()
    with tally.saved_tensors(exclude=[w]) as saved:
        y = fn.apply(x, w, None)
    _check_forward(rank, y, y_ref.detach().chunk(n, -1)[rank])
    _check_saved(rank, saved.bytes, x)
    grad = g_full.chunk(n, -1)[rank]
    with calls.record() as log:
        _backward(rank, y, grad, x)
    ops = [e["op"] for e in tp_probe.collectives(log)]
    assert "all_gather" in ops, (
        f"rank {rank}: backward ran {ops or 'no collective'}, no all-gather: the weight "
        "gradient needs the input of every position, so gather the saved shard again "
        "(keeping the gathered input on ctx costs the memory this layer saves)")
    want_w = ref_w.grad.chunk(n, 0)
    _check_grad(rank, "x", x.grad, ref_x.grad.chunk(n, 1)[rank], n, [
        ((grad @ w.detach()).chunk(n, 1)[rank],
         "only this rank's chunk of its own partial product grad @ weight: every "
         "rank's features contribute to each position's gradient, so sum them over "
         "the ranks and keep your positions (a reduce-scatter)")])
    _check_grad(rank, "weight", w.grad, want_w[rank], n, [
        (sum(want_w), "it is summed over the ranks (an all-reduce): each rank's rows "
                      "of W get their own gradient, with no collective"),
        (grad.chunk(n, 1)[rank].flatten(0, 1).T @ x.detach().flatten(0, 1),
         "from this rank's positions only: the rows of W_i meet every position, "
         "so use the gathered input")])
    return True


def _one_process(batch, seq, h_in, h_out):
    """Seeded x, W and the output's gradient, and one process's linear layer run
    forward and backward on them: (x, W, grad, x_ref, W_ref, y_ref)."""
    gen = torch.Generator().manual_seed(0)
    x_full, w_full, g_full = (torch.randn(*shape, generator=gen) for shape in
                              ((batch, seq, h_in), (h_out, h_in), (batch, seq, h_out)))
    ref_x, ref_w = x_full.clone().requires_grad_(), w_full.clone().requires_grad_()
    y_ref = F.linear(ref_x, ref_w)
    (y_ref * g_full).sum().backward()
    return x_full, w_full, g_full, ref_x, ref_w, y_ref


def _check_saved(rank, saved_bytes, x):
    assert saved_bytes <= _nbytes(x), (
        f"rank {rank}: forward saved {saved_bytes:,} B for backward besides the weight; "
        f"the shard x is {_nbytes(x):,} B. Save only the shard "
        "(ctx.save_for_backward(x, weight)) and all-gather it again in backward: "
        "keeping the gathered input is what this layer is meant to avoid")


def _check_forward(rank, y, want):
    assert isinstance(y, torch.Tensor) and y.shape == want.shape, (
        f"rank {rank}: forward returned {_shape(y)}, expected {tuple(want.shape)} "
        "(b, s, h_out/N): all-gather x along the sequence (dim 1), then F.linear")
    assert torch.allclose(y.detach(), want, **_TOL), (
        f"rank {rank}: forward differs from one process's x W^T, sliced to this "
        "rank's output features (largest error "
        f"{(y.detach() - want).abs().max().item():.3g})")


def _backward(rank, y, grad, x):
    try:
        y.backward(grad)
    except RuntimeError as err:
        if "invalid gradient" not in str(err):
            raise
        raise AssertionError(
            f"rank {rank}: backward returned a gradient of the wrong shape ({err}). "
            f"x is the shard {tuple(x.shape)}: grad @ weight is (b, s, h_in), for all "
            "positions and summed over nothing; neither returning it as it is (identity) "
            "nor all-gathering it fits. Reduce-scatter it along the sequence") from None


def _check_grad(rank, name, got, want, n, mistakes):
    # mistakes: (what a plausible wrong backward gives, why it is wrong).
    assert got is not None, f"rank {rank}: backward gave no gradient for {name}"
    if torch.allclose(got, want, **_TOL):
        return
    mistakes = [(n * want, f"{n}x (TP x) too large: summed over the {n} ranks once "
                           "too often")] + mistakes
    why = next((why for wrong, why in mistakes if got.shape == wrong.shape
                and torch.allclose(got, wrong, **_TOL)),
               f"largest error {(got - want).abs().max().item():.3g}")
    raise AssertionError(f"rank {rank}: the gradient of {name} differs from one "
                         f"process's, sliced to this rank: {why}")


def _nbytes(t):
    return t.numel() * t.element_size()


def _shape(t):
    return tuple(t.shape) if isinstance(t, torch.Tensor) else repr(t)


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
