"""Checks of graded assignment 2: vocabulary-parallel cross-entropy, forward and backward.

    import labsupport.grading.vocab_parallel_xent as gx
    gx.check_forward(VocabParallelCrossEntropy)                # loss == F.cross_entropy
    gx.check_forward(VocabParallelCrossEntropy, scale=1e4)     # ... on logits that overflow exp
    gx.check_backward(VocabParallelCrossEntropy)               # logits.grad == autograd's
    gx.check_no_gather(VocabParallelCrossEntropy)              # O(b s) bytes, not O(b s V)

The student's ``cls`` is a ``torch.autograd.Function``: ``cls.apply(logits,
targets, group)`` with ``logits`` (n, V/TP), rank r's slice of the vocabulary
(ids [r V/TP, (r+1) V/TP)), and ``targets`` (n,), the same on every rank;
it returns the mean cross-entropy, the same on every rank. Megatron-LM's
``_VocabParallelCrossEntropy`` (Shoeybi et al. 2019, Section 3) is the
model answer. Each check runs through ``labsupport.grading.run``, so a
deadlock fails at the deadline with what each rank was doing, and raises
AssertionError with a message a student can act on.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from labsupport import traffic
from labsupport.checking import collective_checks
from labsupport.checking.collective_checks import WORLD_SIZES  # (2, 4): one home

TOKENS, V_LOCAL = 32, 512          # n tokens; vocabulary entries per rank


def _trial(cls, tokens, v_local, scale, seed, grad_scale):
    """On each rank: the student's loss and logits.grad, the reference's, wire bytes sent."""
    rank, t = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(tokens, v_local * t, generator=g) * scale          # (n, V)
    targets = torch.randint(v_local * t, (tokens,), generator=g)          # (n,)
    full.requires_grad_()
    (F.cross_entropy(full, targets) * grad_scale).backward()
    mine = full.detach()[:, rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
    dist.barrier()
    with traffic.count() as wire:
        loss = cls.apply(mine, targets, None)
        if isinstance(loss, torch.Tensor) and loss.requires_grad and grad_scale:
            (loss * grad_scale).backward()
        dist.barrier()
    return dict(loss=loss.detach() if isinstance(loss, torch.Tensor) else loss,
                want=F.cross_entropy(full.detach(), targets), grad=mine.grad,
                want_grad=full.grad[:, rank * v_local:(rank + 1) * v_local],
                wire=wire.wire_sent, shard_bytes=mine.numel() * 4)


def _runs(cls, world_sizes, scale, grad_scale, timeout):
    if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
        raise TypeError(f"pass the class (a torch.autograd.Function subclass), got {cls!r}")
    for t in world_sizes:
        calls = collective_checks.run(_trial, cls, TOKENS, V_LOCAL, scale, 1000 + t, grad_scale,
                            world_size=t, timeout=timeout)
        yield t, [c["value"] for c in calls]


def check_forward(cls, world_sizes=WORLD_SIZES, *, scale=3.0, timeout=None):
    """Every rank's loss equals F.cross_entropy on the full logits (times ``scale``)."""
    for t, ranks in _runs(cls, world_sizes, scale, 0.0, timeout):
        for rank, r in enumerate(ranks):
            _assert_loss(r["loss"], r["want"], rank, t, scale)


def _assert_loss(loss, want, rank, t, scale):
    where = f"on {t} ranks, rank {rank} (logits of size about {scale:g})"
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise AssertionError(f"{where}: forward returned {loss!r}; return the mean loss "
                             "over the tokens as a tensor with one element")
    if not torch.isfinite(loss).all():
        raise AssertionError(
            f"{where}: the loss is {loss.item()}, F.cross_entropy gives {want.item():.4f}. "
            "exp() overflows in fp32 above about 88: subtract each row's maximum over the "
            "WHOLE vocabulary (a dist.all_reduce with op=dist.ReduceOp.MAX) before exp")
    if not torch.allclose(loss.reshape(()), want, rtol=1e-5, atol=1e-5):
        raise AssertionError(
            f"{where}: the loss is {loss.item():.6f}, F.cross_entropy on the full logits "
            f"gives {want.item():.6f}. Loss per token: log(sum over all V of exp(logit)) "
            "minus the target's logit, which lives on one rank only; then the mean")


def check_backward(cls, world_sizes=WORLD_SIZES, *, scale=3.0, grad_scale=3.0, timeout=None):
    """``(loss * grad_scale).backward()`` gives each rank's slice of autograd's gradient."""
    for t, ranks in _runs(cls, world_sizes, scale, grad_scale, timeout):
        for rank, r in enumerate(ranks):
            _assert_loss(r["loss"], r["want"], rank, t, scale)
            _assert_grad(r["grad"], r["want_grad"], rank, t, grad_scale)


def _assert_grad(got, want, rank, t, grad_scale):
    where = f"on {t} ranks, rank {rank}"
    if got is None or got.shape != want.shape:
        raise AssertionError(f"{where}: logits.grad is {None if got is None else got.shape}; "
                             f"backward must return a gradient of shape {tuple(want.shape)} "
                             "for the logits (and None for targets and group)")
    if torch.allclose(got, want, rtol=1e-4, atol=1e-6):
        return
    if torch.allclose(got * grad_scale, want, rtol=1e-4, atol=1e-6):
        raise AssertionError(f"{where}: logits.grad is 1/{grad_scale:g} of the right one: "
                             "multiply by the incoming gradient (grad_output) of the loss")
    bad = (got - want).abs() > 1e-4 + 1e-4 * want.abs()
    row, col = [int(i) for i in bad.nonzero()[0]]
    minus_one = abs((got[row, col] - want[row, col]).item() * TOKENS / grad_scale + 1) < 1e-3
    if want[row, col] < 0:
        hint = ("this is the target's entry, where d loss / d logit = (softmax - 1) / n: the "
                "rank that owns the target subtracts the 1 there")
    elif minus_one:
        hint = ("1/n too little, as if this were the target's entry, but row "
                f"{row}'s target is elsewhere (ids on rank r start at r*V/TP): only the rank "
                "that owns the target subtracts the 1")
    else:
        hint = ("away from the target, d loss / d logit = softmax / n, the softmax "
                "normalised over the whole vocabulary (all ranks)")
    raise AssertionError(f"{where}: logits.grad[{row}, {col}] is {got[row, col].item():.6g}, "
                         f"expected {want[row, col].item():.6g}: {hint}")


def check_no_gather(cls, world_sizes=(4,), *, timeout=None):
    """Each rank sends O(n) bytes (a few statistics per token), far below its n*V/TP logits."""
    for t, ranks in _runs(cls, world_sizes, 3.0, 1.0, timeout):
        for rank, r in enumerate(ranks):
            if r["wire"] > r["shard_bytes"] // 4:
                raise AssertionError(
                    f"on {t} ranks, rank {rank} sent {r['wire']:,} bytes for forward and "
                    f"backward; its logits are {r['shard_bytes']:,} bytes ({TOKENS} tokens x "
                    f"{V_LOCAL} entries). Gathering the logits moves O(b s V) bytes; the "
                    "loss needs only a few numbers per token from each rank (the maximum, "
                    "the sum of exponentials, the target's logit): O(b s)")
