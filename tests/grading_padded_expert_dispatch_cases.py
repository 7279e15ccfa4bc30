"""Expert-parallel dispatches that are right but not padded, for
tests/test_grading_padded_expert_dispatch.py.

The reference is the source notebook's (tests/sources.py), and the wrong
answers that differ from it in one thing are written there as edits of it;
these two are other designs altogether. Each has assignment 7's signature
and uses only torch and labsupport.expert_parallel.moe (``variable_splits`` only the names
the assignment's import cell gives, so that the nbgrader test can paste its
source into a submission as ``padded_moe``). In their own module, which
imports only torch and labsupport.expert_parallel.moe: the ranks import it to unpickle each
function.
"""
import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import (
    all_gather_single_autograd,
    reduce_scatter_single_autograd,
)

from labsupport.expert_parallel import moe


def variable_splits(x, router, experts, top_k, capacity_factor, group=None):
    """Chapter 9's dispatch: only the routed rows, with a counts exchange. Right, not padded."""
    num_experts = router.out_features
    _, chosen, gates = moe.route(router(x), top_k)
    keep = moe.keep_mask(chosen, num_experts, moe.capacity(
        len(x), top_k, num_experts, capacity_factor))
    token, expert, gate = moe.sort_by_expert(chosen, gates, keep)
    splits_in, splits_out, received = moe.exchange_counts(
        torch.bincount(expert, minlength=num_experts), group)
    rows = moe.AllToAll.apply(x[token], splits_out, splits_in, group)
    order = moe.expert_major_order(received)
    out = experts(rows[order], received.sum(dim=0))[torch.argsort(order)]
    home = moe.AllToAll.apply(out, splits_in, splits_out, group)
    return moe.combine(home, token, gate, len(x))


def gather_all(x, router, experts, top_k, capacity_factor, group=None):
    """Every token to every rank (all-gather), partial outputs summed back. Right, too many
    bytes."""
    group = group or dist.group.WORLD
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    num_tokens, num_experts = len(x), router.out_features
    local = num_experts // world_size
    every = all_gather_single_autograd(x, 0, group)
    parts = []
    for xs in every.split(num_tokens):
        _, chosen, gates = moe.route(router(xs), top_k)
        keep = moe.keep_mask(chosen, num_experts, moe.capacity(
            num_tokens, top_k, num_experts, capacity_factor))
        token, expert, gate = moe.sort_by_expert(chosen, gates, keep)
        mine = expert // local == rank
        counts = torch.bincount(expert[mine] - rank * local, minlength=local)
        out = experts(xs[token[mine]], counts)
        parts.append(moe.combine(out, token[mine], gate[mine], num_tokens))
    return reduce_scatter_single_autograd(torch.cat(parts), "sum", 0, group)
