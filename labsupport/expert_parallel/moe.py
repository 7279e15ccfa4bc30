"""Mixture of experts and expert parallelism, as chapter 9 writes them.

    layer = moe.MoE(hidden=16, ffn=32, num_experts=8, top_k=2,
                    capacity_factor=1.25)
    y = layer(x)                   # (..., h): one process, every expert here
    layer.aux_loss                 # Switch Transformer's load-balancing loss
    ep = moe.ExpertParallelMoE(layer)   # on a rank: router, E/N experts
    y_mine = ep(x_mine)            # all-to-all dispatch, experts, combine

Rank r of N holds experts r*E/N .. (r+1)*E/N - 1. Each rank routes its own
tokens, drops what its experts' capacity refuses (capacity per group of tokens:
the tokens one rank routes; ``MoE(groups=N)`` applies the same rule on one
process), sends each kept (token, expert) row to the expert's rank, and gets
the results back. Shapes: T tokens, h features, E experts, k choices each.

The code between the markers is chapter 9's, character for character
(tests/test_moe.py); the shared decoder (``models.GPT(cfg, moe=MoE)``) and the
benchmark use it.
"""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labsupport.context_parallel.ring_attention import timed

# --- lesson: notebooks/09_expert_parallel.ipynb (the notebook's copy must match) ---


def route(logits, top_k):
    """Softmax over the E experts, keep the k largest; for k > 1 renormalise.

    Returns the probabilities (T, E), which the load-balancing loss reads,
    the chosen experts (T, k) and their gates (T, k): for k > 1 they sum to
    1 (Mixtral); for k = 1 the gate is the probability itself (Switch
    Transformer, arXiv 2101.03961, §2.1), since a renormalised single gate
    is always 1 and gives the router no gradient.
    """
    probs = logits.softmax(dim=-1)                           # (T, E)
    gates, experts = probs.topk(top_k, dim=-1)               # (T, k) each
    if top_k > 1:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return probs, experts, gates


def capacity(num_tokens, top_k, num_experts, factor):
    """Rows one expert accepts from a group of tokens: ceil(c_f k T / E).

    Megatron-Core's definition (get_capacity(num_tokens * topk, ...) in
    megatron/core/transformer/moe/moe_utils.py); None: no limit (dropless).
    """
    if factor is None:
        return None
    return math.ceil(factor * top_k * num_tokens / num_experts)


def keep_mask(experts, num_experts, cap):
    """(T, k) True where the expert accepts the choice: its first ``cap``.

    The dropping rule: each expert keeps the choices that reach it first in
    token order (Megatron-Core's "position" policy); a token never picks an
    expert twice, so the order of its k choices does not matter.
    """
    if cap is None:
        return torch.ones_like(experts, dtype=torch.bool)
    flat = experts.flatten()                                 # (T k,)
    seen = F.one_hot(flat, num_experts).cumsum(dim=0)        # (T k, E)
    position = seen.gather(1, flat.unsqueeze(1)).squeeze(1) - 1
    return (position < cap).view_as(experts)


def load_balancing_loss(probs, experts, num_experts):
    """E * sum_i f_i P_i (Switch Transformer, arXiv 2101.03961, eq. 4-6).

    f_i: the fraction of the T k choices that picked expert i (for k > 1 as
    Megatron-Core's switch_load_balancing_loss_func); P_i: the mean
    probability the router gave expert i. 1 when both are uniform, E when
    every token goes to one expert. Only P carries a gradient.
    """
    chosen = F.one_hot(experts.flatten(), num_experts).to(probs.dtype)
    return num_experts * (chosen.mean(dim=0) * probs.mean(dim=0)).sum()


def expert_mlp(x, w1, w2):
    """One expert: Linear(h, f), GELU, Linear(f, h), without biases."""
    return F.gelu(x @ w1.t(), approximate="tanh") @ w2.t()   # (rows, h)


def grouped_mm_runs(x):
    """True where torch.nn.functional.grouped_mm can run: bf16, CUDA, SM 80+."""
    return (x.is_cuda and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (8, 0))


class Experts(nn.Module):
    """E expert MLPs, stacked: w1 (E, f, h), w2 (E, h, f).

    ``forward(x, counts)``: x holds the rows of expert 0, then expert 1, ...
    (``counts[e]`` rows each). Where grouped_mm_runs (GPUs, bf16) it takes
    ``grouped``, every expert in one call; elsewhere ``looped``.
    """

    def __init__(self, num_experts, hidden, ffn):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        nn.init.uniform_(self.w1, -hidden ** -0.5, hidden ** -0.5)  # as Linear
        nn.init.uniform_(self.w2, -ffn ** -0.5, ffn ** -0.5)

    def forward(self, x, counts):                            # (rows, h)
        return (self.grouped if grouped_mm_runs(x) else self.looped)(x, counts)

    def grouped(self, x, counts):
        """Every expert in one grouped_mm per matrix; no host sync."""
        ends = counts.cumsum(0).to(torch.int32)              # group ends
        w1, w2 = self.w1.to(x.dtype).mT, self.w2.to(x.dtype).mT
        hid = F.gelu(F.grouped_mm(x, w1, offs=ends), approximate="tanh")
        return F.grouped_mm(hid, w2, offs=ends)

    def looped(self, x, counts):
        """One expert after the other."""
        chunks = x.split(counts.tolist())                    # a host sync
        return torch.cat([expert_mlp(c, w1, w2) for c, w1, w2
                          in zip(chunks, self.w1, self.w2)])


def sort_by_expert(experts, gates, keep):
    """The kept (token, choice) pairs in expert order, token order within.

    Returns token index, expert index and gate of each row, (R,) each.
    """
    top_k = experts.shape[1]
    token = torch.arange(len(experts), device=experts.device)
    token = token.repeat_interleave(top_k)[keep.flatten()]   # (R,)
    expert = experts.flatten()[keep.flatten()]
    gate = gates.flatten()[keep.flatten()]
    order = torch.argsort(expert, stable=True)
    return token[order], expert[order], gate[order]


def combine(rows, token_index, gates, num_tokens):
    """y[t] = sum over t's kept rows of gate * row: the gate-weighted combine.

    rows (R, h) expert outputs; token_index, gates (R,); y (num_tokens, h),
    0 for a token whose every choice was dropped.
    """
    weighted = rows * gates.unsqueeze(-1)                    # (R, h)
    return rows.new_zeros(num_tokens, rows.shape[-1]).index_add(
        0, token_index, weighted)


class MoE(nn.Module):
    """A top-k mixture-of-experts MLP on one process (every expert here).

    Router Linear(h, E) without bias; ``capacity_factor`` c_f drops what each
    expert cannot take from each of ``groups`` equal groups of tokens (N:
    what N ranks would drop); None keeps every token. After each forward,
    ``aux_loss`` and ``tokens_per_expert`` (kept rows) describe the routing.
    ``route``: the routing rule, fn(logits, top_k) -> (probs, experts,
    gates); ``route`` unless replaced (the chapter's aux-loss-free routing).
    """

    def __init__(self, hidden, ffn, num_experts, top_k=2,
                 capacity_factor=None, groups=1):
        super().__init__()
        check_config(num_experts, top_k, capacity_factor)
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, ffn)
        self.top_k, self.capacity_factor = top_k, capacity_factor
        self.groups, self.route = groups, route
        self.aux_loss = self.tokens_per_expert = None

    def forward(self, x):                                    # (..., h)
        tokens = x.reshape(-1, x.shape[-1])                  # (T, h)
        num_experts = self.router.out_features
        probs, experts, gates = self.route(self.router(tokens), self.top_k)
        keep = torch.cat([keep_mask(e, num_experts, capacity(
            len(e), self.top_k, num_experts, self.capacity_factor))
            for e in experts.tensor_split(self.groups)])
        self.aux_loss = load_balancing_loss(probs, experts, num_experts)
        token, expert, gate = sort_by_expert(experts, gates, keep)
        counts = torch.bincount(expert, minlength=num_experts)
        self.tokens_per_expert = counts
        out = self.experts(tokens[token], counts)            # (R, h)
        return combine(out, token, gate, len(tokens)).view_as(x)


class AllToAll(torch.autograd.Function):
    """dist.all_to_all_single with split sizes, differentiable.

    Row block i of the input goes to rank i; row block j of the output came
    from rank j. The gradient of each received row belongs to the rank that
    sent it: the backward is the reverse all-to-all, split sizes swapped.
    """

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group=None):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty(sum(output_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_splits,
                               input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        back = grad.new_empty(sum(input_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), input_splits,
                               output_splits, group=ctx.group)
        return back, None, None, None


def exchange_counts(counts, group=None):
    """Rows this rank sends to each expert, (E,) -> the split sizes.

    One all-to-all of the counts: rank j gets, from every rank i, how many
    rows i sends to each of j's E/N experts. Returns input_split_sizes
    (rows to each rank), output_split_sizes (rows from each rank) and the
    received counts (N, E/N). ``.tolist()`` waits for the counts: on a GPU,
    a device-to-host copy that stalls the host until the GPU gets there.
    """
    world_size = dist.get_world_size(group)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    received = received.view(world_size, -1)                 # (N, E/N)
    input_splits = counts.view(world_size, -1).sum(dim=1).tolist()
    return input_splits, received.sum(dim=1).tolist(), received


def expert_major_order(received):
    """Indices that put rank-major rows (source, then expert) expert-major.

    ``received`` (N, E/N): rows from rank i for local expert e. The
    all-to-all delivers them source by source; the experts want them
    expert by expert (from every source, in source order).
    """
    sizes = received.flatten()                               # rank-major
    starts = (sizes.cumsum(0) - sizes).view_as(received).t().flatten()
    lengths = received.t().flatten()                         # expert-major
    first = lengths.cumsum(0) - lengths
    total = int(lengths.sum())
    within = torch.arange(total, device=received.device)
    within = within - first.repeat_interleave(lengths, output_size=total)
    return starts.repeat_interleave(lengths, output_size=total) + within


def check_config(num_experts, top_k, capacity_factor, world_size=1):
    """A clear error for a layer that cannot be built."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k}: each token picks 1 to {num_experts} "
                         "experts")
    if capacity_factor is not None and capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor}: use a positive "
                         "factor, or None to drop nothing")
    if num_experts % world_size:
        raise ValueError(f"{num_experts} experts over {world_size} ranks: use "
                         "a number of experts divisible by N")


class ExpertParallelMoE(nn.Module):
    """A rank's share of ``moe``: the router (replicated) and E/N experts.

    Every tensor stays on the rank's device; ``all_to_all`` is AllToAll.apply
    or torch's all_to_all_single_autograd (same arguments); ``tl`` a
    Timeline that records the dispatch, the experts and the combine.
    """

    def __init__(self, moe, group=None, all_to_all=AllToAll.apply):
        super().__init__()
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        num_experts = moe.router.out_features
        check_config(num_experts, moe.top_k, moe.capacity_factor, world_size)
        mine = slice(rank * num_experts // world_size,
                     (rank + 1) * num_experts // world_size)
        _, ffn, hidden = moe.experts.w1.shape
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(mine.stop - mine.start, hidden, ffn)
        self.to(moe.experts.w1)                              # dtype, device
        with torch.no_grad():          # the router replicated, my E/N experts
            self.router.weight.copy_(moe.router.weight)
            self.experts.w1.copy_(moe.experts.w1[mine])
            self.experts.w2.copy_(moe.experts.w2[mine])
        self.top_k, self.capacity_factor = moe.top_k, moe.capacity_factor
        self.route = moe.route                   # the layer's routing rule
        self.group, self.all_to_all, self.tl = group, all_to_all, None

    def forward(self, x):                                    # (..., h)
        tokens = x.reshape(-1, x.shape[-1])                  # (T, h)
        num_experts = self.router.out_features
        probs, experts, gates = self.route(self.router(tokens), self.top_k)
        keep = keep_mask(experts, num_experts, capacity(
            len(tokens), self.top_k, num_experts, self.capacity_factor))
        self.aux_loss = load_balancing_loss(probs, experts, num_experts)
        token, expert, gate = sort_by_expert(experts, gates, keep)
        counts = torch.bincount(expert, minlength=num_experts)
        with timed(self.tl, "comm", "dispatch"):
            splits_in, splits_out, received = exchange_counts(
                counts, self.group)
            rows = self.all_to_all(tokens[token], splits_out, splits_in,
                                   self.group)
        order = expert_major_order(received)                 # (rows,)
        self.tokens_per_expert = received.sum(dim=0)         # my experts
        with timed(self.tl, "compute", "experts", rows=len(order)):
            out = self.experts(rows[order], received.sum(dim=0))
        back = out[torch.argsort(order)]                     # rank-major again
        with timed(self.tl, "comm", "combine"):
            home = self.all_to_all(back, splits_in, splits_out, self.group)
        return combine(home, token, gate, len(tokens)).view_as(x)

# --- end of lesson ---
