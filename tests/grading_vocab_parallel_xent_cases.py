"""Vocabulary-parallel cross-entropies, wrong, for tests/test_grading_vocab_parallel_xent.py.

Each pasted class is self-contained (torch, dist, F only), so that the nbgrader
test can paste its source into a submission under the assignment's class name
(NoGradOutput, only unit-tested, reuses NoMax's forward). The reference is the
source notebook's (tests/sources.py). In their own module, which imports only
torch: the ranks import it to unpickle each class.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: F401 (used by the pasted sources)


class NoMax(torch.autograd.Function):
    """exp() of the raw logits: right until a logit passes ~88."""
    @staticmethod
    def forward(ctx, logits, targets, group=None):
        v_local = logits.shape[-1]
        local = targets - dist.get_rank(group) * v_local
        mine = (local >= 0) & (local < v_local)
        exp = logits.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        index = local.clamp(0, v_local - 1).unsqueeze(-1)
        target = torch.where(mine, logits.gather(-1, index).squeeze(-1), 0.0)
        dist.all_reduce(target, group=group)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), index, mine)
        return (sum_exp.log() - target).mean()

    @staticmethod
    def backward(ctx, grad_output):
        softmax, index, mine = ctx.saved_tensors
        one_hot = torch.zeros_like(softmax).scatter_(-1, index, mine.unsqueeze(-1).float())
        return (softmax - one_hot) / softmax.shape[0] * grad_output, None, None


class Gathered(torch.autograd.Function):
    """All-gathers the logits, then F.cross_entropy: right, and O(b s V) bytes."""
    @staticmethod
    def forward(ctx, logits, targets, group=None):
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, logits.contiguous(), group=group)
        full = torch.cat(parts, dim=-1).requires_grad_()
        with torch.enable_grad():
            loss = F.cross_entropy(full, targets)
            (grad,) = torch.autograd.grad(loss, full)
        ctx.save_for_backward(grad.chunk(len(parts), -1)[dist.get_rank(group)])
        return loss.detach()

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        return grad * grad_output, None, None


class WrongTarget(torch.autograd.Function):
    """Subtracts the one-hot on every rank, at the clamped local index."""
    @staticmethod
    def forward(ctx, logits, targets, group=None):
        v_local = logits.shape[-1]
        local = targets - dist.get_rank(group) * v_local
        mine = (local >= 0) & (local < v_local)
        row_max = logits.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        exp = (logits - row_max.unsqueeze(-1)).exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        index = local.clamp(0, v_local - 1).unsqueeze(-1)
        target = torch.where(mine, logits.gather(-1, index).squeeze(-1) - row_max, 0.0)
        dist.all_reduce(target, group=group)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), index)
        return (sum_exp.log() - target).mean()

    @staticmethod
    def backward(ctx, grad_output):
        softmax, index = ctx.saved_tensors
        one_hot = torch.zeros_like(softmax).scatter_(-1, index, 1.0)
        return (softmax - one_hot) / softmax.shape[0] * grad_output, None, None


class NoGradOutput(NoMax):
    """Ignores the incoming gradient of the loss (NoMax's forward: right at the scale of
    check_backward's logits)."""
    @staticmethod
    def backward(ctx, grad_output):
        softmax, index, mine = ctx.saved_tensors
        one_hot = torch.zeros_like(softmax).scatter_(-1, index, mine.unsqueeze(-1).float())
        return (softmax - one_hot) / softmax.shape[0], None, None


class Deadlock(torch.autograd.Function):
    """Only rank 0 takes the maximum: the others skip a collective."""
    @staticmethod
    def forward(ctx, logits, targets, group=None):
        v_local = logits.shape[-1]
        local = targets - dist.get_rank(group) * v_local
        mine = (local >= 0) & (local < v_local)
        row_max = logits.max(dim=-1).values
        if dist.get_rank(group) == 0:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        exp = (logits - row_max.unsqueeze(-1)).exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        index = local.clamp(0, v_local - 1).unsqueeze(-1)
        target = torch.where(mine, logits.gather(-1, index).squeeze(-1) - row_max, 0.0)
        dist.all_reduce(target, group=group)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), index, mine)
        return (sum_exp.log() - target).mean()

    @staticmethod
    def backward(ctx, grad_output):
        softmax, index, mine = ctx.saved_tensors
        one_hot = torch.zeros_like(softmax).scatter_(-1, index, mine.unsqueeze(-1).float())
        return (softmax - one_hot) / softmax.shape[0] * grad_output, None, None


class NotWritten(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group=None):
        raise NotImplementedError()

    @staticmethod
    def backward(ctx, grad_output):
        raise NotImplementedError()
