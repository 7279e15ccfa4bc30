"""The shared decoder split over a tensor-parallel group (chapter 4's layers put together).

    tp_model = TensorParallelGPT(models.GPT(cfg, seed=0), group=None, sequence_parallel=False)
    loss = tp_model(ids, targets)               # on every rank of ``group``
    loss.backward()
    allreduce_sequence_parallel_grads(tp_model)  # LayerNorm/position grads, under SP only

The layers are ``labsupport.tensor_parallel.tensor_parallel``'s (the chapter's own code);
chapter 8 builds this model inside the tp sub-group of a 2-D grid.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labsupport.tensor_parallel.tensor_parallel import (
    ColumnParallelLinear,
    GatherLastDim,
    TensorParallelBlock,
    VocabParallelEmbedding,
    enter_tp,
    my_chunk,
)


class TensorParallelGPT(nn.Module):
    """``models.GPT`` split over the ranks of ``group`` (TP, or TP+SP).

    The embedding is vocab-parallel; the (tied) LM head is column-parallel
    over the vocabulary and its logits are all-gathered before the loss. Under
    sequence parallelism the residual stream holds s/t positions per rank and
    LayerNorm, position embedding and dropout run on that shard: their
    parameters' gradients are partial, see :func:`allreduce_sequence_parallel_grads`.
    The GPT passed in is taken apart: build a fresh one per call.
    """

    def __init__(self, gpt, group=None, sequence_parallel=False):
        super().__init__()
        _validate(gpt.cfg, dist.get_world_size(group), sequence_parallel)
        self.cfg, self.group, self.sequence_parallel = gpt.cfg, group, sequence_parallel
        self.tok = VocabParallelEmbedding(gpt.tok, group, sequence_parallel)
        self.pos, self.dropout, self.ln_f = gpt.pos, gpt.dropout, gpt.ln_f
        self.blocks = nn.ModuleList(TensorParallelBlock(b, group, sequence_parallel)
                                    for b in gpt.blocks)
        self.lm_head = ColumnParallelLinear(gpt.lm_head, group)
        if gpt.cfg.tie_weights:
            self.lm_head.weight = self.tok.weight         # the same shard of the table
        self.sp_params = sequence_parallel_params(self.blocks, self.pos, self.ln_f)

    def forward(self, ids, targets=None):                 # ids: (b, s) int64
        s, sp = ids.shape[1], self.sequence_parallel
        pos = self.pos(torch.arange(s, device=ids.device))            # (s, h)
        if sp:
            pos = my_chunk(pos, 0, self.group)                        # (s/t, h)
        x = self.dropout(self.tok(ids) + pos)             # (b, s, h) or (b, s/t, h)
        for block in self.blocks:
            x = block(x)
        x = enter_tp(self.ln_f(x), self.group, sp)        # (b, s, h)
        logits = GatherLastDim.apply(self.lm_head(x), self.group)     # (b, s, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def sequence_parallel_params(blocks, *modules) -> list:
    """The parameters whose gradients are partial under SP: all of ``modules``'
    (the position embedding, the final LayerNorm, when this piece holds them),
    and of each block its LayerNorms and the biases of its row-parallel layers
    (added after the reduce-scatter, to a sequence shard)."""
    return [p for m in modules for p in m.parameters()] + [
        p for b in blocks for m in (b.ln1, b.ln2, b.attn.o, b.mlp.fc2)
        for name, p in m.named_parameters() if name != "weight" or m in (b.ln1, b.ln2)]


def _validate(cfg, world_size, sequence_parallel):
    sizes = {"heads": cfg.heads, "hidden": cfg.hidden, "vocab_size": cfg.vocab_size,
             "ffn_hidden": cfg.ffn_hidden}
    if sequence_parallel:
        sizes["seq_len"] = cfg.seq_len
    bad = {k: v for k, v in sizes.items() if v % world_size}
    if bad:
        sizes = ", ".join(f"{name}={value}" for name, value in bad.items())
        raise ValueError(f"tensor parallelism over {world_size} ranks cannot split {sizes}: "
                         f"choose sizes divisible by {world_size} "
                         "(under sequence parallelism, feed sequences of exactly seq_len)")


def allreduce_sequence_parallel_grads(model: TensorParallelGPT):
    """Sum the gradients of the parameters that saw only a sequence shard (SP only).

    Under SP each rank's LayerNorm and position-embedding gradients cover its
    s/t positions; Megatron all-reduces them over the TP group after backward.
    """
    if not model.sequence_parallel:
        return
    for p in model.sp_params:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=model.group)
