"""Gradient-norm clipping across the 4-D mesh: one process's ``clip_grad_norm_`` step.

    total = clip_grad_norm_(stage, groups, max_norm=1.0)   # after the sync, before the step
    train(layout, steps, clip_norm=1.0)                     # the trainer's option

One process clips by the norm of the whole model's gradient, the square root
of the sum of every parameter's squared entries (``torch.nn.utils.
clip_grad_norm_``). After ``trainer.sync_gradients`` a rank of a (dp, tp, pp,
cp) layout holds a piece of that sum:

- its TP shards (different entries on each tp rank): summed over tp;
- its pipeline stage's blocks (different parameters on each stage): summed over pp;
- a parameter replicated over tp (the LayerNorms, row-parallel biases and
  position embedding that every tp rank keeps whole): the same entries tp
  times, counted once (on tp rank 0);
- a weight tied across two stages (assignment 9's embedding and LM head, equal
  after its embedding-group sum): counted once (on the first stage);
- nothing over dp or cp: after the sync every rank of a dp x cp group holds the
  same averaged gradient, so a sum over them would count it dp·cp times.

Megatron-LM does the same: its optimizer keeps the gradients of parameters
that are neither shared nor tensor-parallel duplicates (``param_is_not_shared``,
``param_is_not_tensor_parallel_duplicate``) and ``get_grad_norm_fp32``
(``megatron/core/optimizer/clip_grads.py``) sums their squares over its
``grad_stats_parallel_group``, the model-parallel (tp x pp) group when the
optimizer is not distributed. ``WRONG`` holds the classic mistakes, as
keywords of ``grad_norm``; ``tests/test_capstone.py`` measures their factors.
"""
import torch
import torch.distributed as dist

SUMMED_OVER = ("tp", "pp")      # the groups whose ranks hold different entries

# The classic wrong norms (``grad_norm``'s keywords), with the factor each is off by.
WRONG = {
    "summed over dp x cp too: sqrt(dp·cp) too large":
        dict(over=("tp", "pp", "dp_cp")),
    "replicated parameters counted tp times: sqrt(total² + (tp - 1)·replicated²)":
        dict(replicas_once=False),
    "not summed over pp: each stage clips by its own blocks' norm":
        dict(over=("tp",)),
}


def counted_params(stage, groups, replicas_once=True) -> list:
    """The parameters whose squares this rank adds to the global sum: all of its
    own, less the copies another rank of its tp x pp slice counts (``replicas_once``)."""
    tp_rank = dist.get_rank(groups["tp"])
    tied = getattr(stage, "shared_embedding_or_output_weight", lambda: None)()
    shards = stage.shards()
    out = []
    for name, p in stage.named_parameters():
        if replicas_once and shards[name] is None and tp_rank > 0:
            continue                 # replicated over tp: tp rank 0 counts it
        if replicas_once and p is tied and not stage.first:
            continue                 # the tied weight's other copy: the first stage's
        out.append(p)
    return out


def counted_grads(stage, groups, replicas_once=True) -> list:
    """The gradients of ``counted_params`` (those that exist)."""
    return [p.grad for p in counted_params(stage, groups, replicas_once)
            if p.grad is not None]


def grad_norm(stage, groups, over=SUMMED_OVER, replicas_once=True) -> torch.Tensor:
    """The global gradient norm (2-norm), the same on every rank: this rank's
    counted squares (``counted_grads``) summed over each group in ``over``."""
    grads = counted_grads(stage, groups, replicas_once)
    p = next(stage.parameters())
    squares = torch.zeros((), dtype=p.dtype, device=p.device)
    for g in grads:
        squares += torch.linalg.vector_norm(g) ** 2
    for name in over:
        if dist.get_world_size(groups[name]) > 1:
            dist.all_reduce(squares, group=groups[name])
    return squares.sqrt()


def clip_grad_norm_(stage, groups, max_norm) -> torch.Tensor:
    """Scale every gradient of this rank by min(1, max_norm / (norm + 1e-6)), the
    norm ``grad_norm``'s (PyTorch's ``clip_grads_with_norm_``, the step of
    ``clip_grad_norm_``); returns the norm before clipping."""
    total = grad_norm(stage, groups)
    torch.nn.utils.clip_grads_with_norm_(stage.parameters(), max_norm, total)
    return total


def clipped(sync, max_norm, norms):
    """``sync`` followed by ``clip_grad_norm_``; each step's norm appended to ``norms``."""
    def sync_and_clip(stage, groups, layout):
        sync(stage, groups, layout)
        norms.append(clip_grad_norm_(stage, groups, max_norm).item())
    return sync_and_clip
