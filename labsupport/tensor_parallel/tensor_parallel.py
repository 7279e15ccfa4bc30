"""Tensor parallelism (Megatron-LM) and sequence parallelism (Megatron-SP), chapter 4.

    y = RowParallelLinear(fc2, group)(ColumnParallelLinear(fc1, group)(enter_tp(x)))
    with calls.record() as log: ...             # tp_probe.collectives(log): op, phase, S
    # the whole decoder split over a group: labsupport.tensor_parallel.gpt.TensorParallelGPT

Shoeybi et al., "Megatron-LM" (arXiv 1909.08053), Section 3: the conjugate
operators f and g around a column-parallel then a row-parallel linear layer;
Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (arXiv 2205.05198), Section 4.2.2: sequence parallelism replaces
f/g by all-gather / reduce-scatter along the sequence (g and g-bar).
Every collective takes ``group=`` (None: the default group), so chapter 8
runs the same layers inside the tp sub-group of a 2-D mesh. Each goes
through torch.distributed's module, so ``labsupport.calls.record`` (the one
recorder) sees it. The code between the lesson markers is the notebook's,
character for character (tests/test_tensor_parallel.py).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


# --- lesson: notebooks/04_tensor_parallel.ipynb (the notebook's copy must match) ---
def all_reduce(x, group=None):
    """Sum of ``x`` over the ranks of ``group`` (a new tensor)."""
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


def all_gather(x, dim, group=None):
    """The ranks' ``x`` concatenated along ``dim``, in rank order."""
    world_size = dist.get_world_size(group)
    x0 = x.movedim(dim, 0).contiguous()                   # gather along dim 0
    out = x0.new_empty((world_size * x0.shape[0], *x0.shape[1:]))
    dist.all_gather_single(out, x0, group=group)
    return out.movedim(0, dim).contiguous()


def reduce_scatter(x, dim, group=None):
    """This rank's chunk along ``dim`` of the sum of ``x`` over the ranks."""
    world_size = dist.get_world_size(group)
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((x0.shape[0] // world_size, *x0.shape[1:]))
    dist.reduce_scatter_single(out, x0, group=group)
    return out.movedim(0, dim).contiguous()


def my_chunk(x, dim, group=None):
    """A copy of this rank's chunk of ``x`` along ``dim`` (no communication)."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(world_size, dim)[rank].clone(
        memory_format=torch.contiguous_format)


class CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce backward (Fig. 3a)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward (Fig. 3a)."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromSP(torch.autograd.Function):
    """Megatron-SP's g: all-gather the sequence, reduce-scatter backward.

    Korthikanti et al. 2022 (arXiv 2205.05198), Section 4.2.2, Figure 5.
    """

    @staticmethod
    def forward(ctx, x, dim, group):                      # (b, s/N, h)
        ctx.dim, ctx.group = dim, group
        return all_gather(x, dim, group)                  # (b, s, h)

    @staticmethod
    def backward(ctx, grad):                              # (b, s, h)
        return reduce_scatter(grad, ctx.dim, ctx.group), None, None


class ReduceScatterToSP(torch.autograd.Function):
    """Megatron-SP's g-bar: reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, dim, group):                      # (b, s, h) partial
        ctx.dim, ctx.group = dim, group
        return reduce_scatter(x, dim, group)              # (b, s/N, h)

    @staticmethod
    def backward(ctx, grad):                              # (b, s/N, h)
        return all_gather(grad, ctx.dim, ctx.group), None, None


class GatherLastDim(torch.autograd.Function):
    """All-gather along the last dim; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):                           # (b, s, V/N)
        ctx.group = group
        return all_gather(x, -1, group)                   # (b, s, V)

    @staticmethod
    def backward(ctx, grad):
        return my_chunk(grad, -1, ctx.group), None


def enter_tp(x, group=None, sequence_parallel=False):
    """Into a parallel region: f (TP), or all-gather of the sequence (SP)."""
    if sequence_parallel:
        return GatherFromSP.apply(x, 1, group)        # (b, s/N, h) -> (b, s, h)
    return CopyToTP.apply(x, group)


def exit_tp(x, group=None, sequence_parallel=False):
    """Out of a parallel region: g (TP), or reduce-scatter of the sequence."""
    if sequence_parallel:
        return ReduceScatterToSP.apply(x, 1, group)   # (b, s, h) -> (b, s/N, h)
    return ReduceFromTP.apply(x, group)


class ColumnParallelLinear(nn.Module):
    """Y_i = X A_i: rank i holds rows i of W (output features), Megatron Eq. 3.

    Takes the full input (after f or the all-gather) and returns this rank's
    slice of the output features; no communication here.
    """

    def __init__(self, linear: nn.Linear, group=None):
        super().__init__()
        self.shard_dims = {"weight": 0, "bias": 0}
        self.weight = nn.Parameter(my_chunk(linear.weight.detach(), 0, group))
        self.bias = None if linear.bias is None else \
            nn.Parameter(my_chunk(linear.bias.detach(), 0, group))

    def forward(self, x):                                 # (b, s, h_in)
        return F.linear(x, self.weight, self.bias)        # (b, s, h_out/N)


class RowParallelLinear(nn.Module):
    """Y = sum_i X_i A_i: rank i holds columns i of W (input features).

    Takes this rank's slice of the input features, sums the partial products
    over the ranks (g, or a reduce-scatter under SP), then adds the bias once.
    """

    def __init__(self, linear: nn.Linear, group=None, sequence_parallel=False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.shard_dims = {"weight": 1}
        self.weight = nn.Parameter(my_chunk(linear.weight.detach(), 1, group))
        self.bias = None if linear.bias is None else \
            nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):                                 # (b, s, h_in/N)
        partial = F.linear(x, self.weight)            # (b, s, h_out) partial
        y = exit_tp(partial, self.group, self.sequence_parallel)
        return y if self.bias is None else y + self.bias


def masked_lookup(ids, weight, start):
    """Rows of ``weight`` (this rank's V/N rows, from id ``start``), else 0."""
    local = ids - start                                   # (b, s)
    outside = (local < 0) | (local >= weight.shape[0])
    rows = F.embedding(local.masked_fill(outside, 0), weight)     # (b, s, h)
    return rows.masked_fill(outside.unsqueeze(-1), 0.0)


class VocabParallelEmbedding(nn.Module):
    """Rank i holds rows [i V/N, (i+1) V/N) of the table (Megatron Section 3).

    Ids outside the slice look up zeros; summing over the ranks (g, or a
    reduce-scatter of the sequence under SP) gives every id its row.
    """

    def __init__(self, embedding: nn.Embedding, group=None,
                 sequence_parallel=False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.shard_dims = {"weight": 0}
        weight = my_chunk(embedding.weight.detach(), 0, group)  # (V/N, h)
        self.weight = nn.Parameter(weight)
        self.start = dist.get_rank(group) * self.weight.shape[0]

    def forward(self, ids):                               # (b, s) int64
        rows = masked_lookup(ids, self.weight, self.start)        # (b, s, h)
        return exit_tp(rows, self.group, self.sequence_parallel)


class TensorParallelBlock(nn.Module):
    """A DecoderBlock with attention split by heads and the MLP column-then-row.

    Per layer, forward: 2 all-reduces (TP), or 2 all-gathers + 2
    reduce-scatters (SP, where x is a sequence shard); the same backward.
    """

    def __init__(self, block, group=None, sequence_parallel=False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.ln1, self.attn = block.ln1, block.attn
        self.ln2, self.mlp, self.dropout = block.ln2, block.mlp, block.dropout
        for name in ("q", "k", "v"):                     # a/N heads per rank
            column = ColumnParallelLinear(getattr(self.attn, name), group)
            setattr(self.attn, name, column)
        self.attn.o = RowParallelLinear(self.attn.o, group, sequence_parallel)
        self.mlp.fc1 = ColumnParallelLinear(self.mlp.fc1, group)
        self.mlp.fc2 = RowParallelLinear(self.mlp.fc2, group, sequence_parallel)

    def forward(self, x):                         # (b, s, h) or (b, s/N, h)
        def enter(y):
            return enter_tp(y, self.group, self.sequence_parallel)
        x = x + self.dropout(self.attn(enter(self.ln1(x))))
        return x + self.dropout(self.mlp(enter(self.ln2(x))))


def dtensor_tp_plan(cfg):
    """DTensor's plan for the same split as TensorParallelGPT (TP only)."""
    plan = {"tok": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(cfg.layers):
        plan |= {f"blocks.{i}.attn.{name}": ColwiseParallel() for name in "qkv"}
        plan |= {f"blocks.{i}.attn.o": RowwiseParallel(),
                 f"blocks.{i}.mlp.fc1": ColwiseParallel(),
                 f"blocks.{i}.mlp.fc2": RowwiseParallel()}
    return plan


def dtensor_sp_plan(cfg):
    """DTensor's plan for TP+SP: sequence shards between parallel regions."""
    seq, full = (Shard(1),), (Replicate(),)
    plan = {"tok": RowwiseParallel(input_layouts=Replicate(),
                                   output_layouts=Shard(1)),
            "pos": PrepareModuleOutput(output_layouts=Replicate(),
                                       desired_output_layouts=Shard(0)),
            "ln_f": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1),
                                       output_layouts=Replicate())}
    for i in range(cfg.layers):
        b = f"blocks.{i}"
        plan |= {f"{b}.{name}": SequenceParallel() for name in ("ln1", "ln2")}
        plan |= {f"{b}.{name}": PrepareModuleInput(input_layouts=seq,
                 desired_input_layouts=full) for name in ("attn", "mlp")}
        plan |= {f"{b}.attn.{name}": ColwiseParallel() for name in "qkv"}
        plan |= {f"{b}.attn.o": RowwiseParallel(output_layouts=Shard(1)),
                 f"{b}.mlp.fc1": ColwiseParallel(),
                 f"{b}.mlp.fc2": RowwiseParallel(output_layouts=Shard(1))}
    return plan


def parallelize_dtensor(gpt, mesh, sequence_parallel=False):
    """``gpt`` split by DTensor's parallelize_module over a 1-D ``mesh``."""
    plan = (dtensor_sp_plan if sequence_parallel else dtensor_tp_plan)(gpt.cfg)
    model = parallelize_module(gpt, mesh, plan)
    if gpt.cfg.tie_weights:  # each style made its own DTensor: tie them again
        model.lm_head.weight = model.tok.weight
    return model
# --- end of lesson ---
