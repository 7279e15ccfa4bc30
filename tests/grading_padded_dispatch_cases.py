"""Expert-parallel dispatches, right and wrong, for tests/test_grading_padded_expert_dispatch.py.

Each function has assignment 7's signature and uses only the names the
assignment's import cell gives (torch, dist, F, moe, all_to_all_single_autograd),
so that the nbgrader test can paste its source into a submission as
``padded_moe``. In their own module, which imports only torch and
labsupport.moe: the ranks import it to unpickle each function.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import (  # noqa: F401 (pasted sources)
    all_gather_single_autograd, all_to_all_single_autograd, reduce_scatter_single_autograd)

from labsupport import moe


def padded(x, router, experts, top_k, capacity_factor, group=None):
    """The reference: every expert padded to its capacity, two fixed all-to-alls."""
    group = group or dist.group.WORLD
    world_size = dist.get_world_size(group)
    num_tokens, hidden = x.shape
    num_experts = router.out_features
    local = num_experts // world_size
    _, chosen, gates = moe.route(router(x), top_k)
    cap = moe.capacity(num_tokens, top_k, num_experts, capacity_factor)
    flat = chosen.flatten()
    arrivals = F.one_hot(flat, num_experts).cumsum(dim=0)
    slot = arrivals.gather(1, flat.unsqueeze(1)).squeeze(1) - 1
    kept = slot < cap
    place = flat[kept] * cap + slot[kept]
    token = torch.arange(num_tokens).repeat_interleave(top_k)[kept]
    send = x.new_zeros(num_experts * cap, hidden).index_copy(0, place, x[token])
    got = all_to_all_single_autograd(send, None, None, group)
    rows = got.view(world_size, local, cap, hidden).transpose(0, 1)
    out = experts(rows.reshape(-1, hidden), torch.full((local,), world_size * cap))
    back = out.view(local, world_size, cap, hidden).transpose(0, 1)
    home = all_to_all_single_autograd(back.reshape(-1, hidden), None, None, group)
    weighted = home[place] * gates.flatten()[kept].unsqueeze(1)
    return x.new_zeros(num_tokens, hidden).index_add(0, token, weighted)


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
    """Every token to every rank (all-gather), partial outputs summed back. Right, too many bytes."""
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


def drop_by_prob(x, router, experts, top_k, capacity_factor, group=None):
    """Padded, but each expert keeps its rows of largest gate (not the first in token order)."""
    group = group or dist.group.WORLD
    world_size = dist.get_world_size(group)
    num_tokens, hidden = x.shape
    num_experts = router.out_features
    local = num_experts // world_size
    _, chosen, gates = moe.route(router(x), top_k)
    cap = moe.capacity(num_tokens, top_k, num_experts, capacity_factor)
    flat, score = chosen.flatten(), gates.flatten().detach()
    order = torch.argsort(-score, stable=True)
    arrivals = F.one_hot(flat[order], num_experts).cumsum(dim=0)
    rank_in_order = arrivals.gather(1, flat[order].unsqueeze(1)).squeeze(1) - 1
    slot = torch.empty_like(rank_in_order).scatter_(0, order, rank_in_order)
    kept = slot < cap
    place = flat[kept] * cap + slot[kept]
    token = torch.arange(num_tokens).repeat_interleave(top_k)[kept]
    send = x.new_zeros(num_experts * cap, hidden).index_copy(0, place, x[token])
    got = all_to_all_single_autograd(send, None, None, group)
    rows = got.view(world_size, local, cap, hidden).transpose(0, 1)
    out = experts(rows.reshape(-1, hidden), torch.full((local,), world_size * cap))
    back = out.view(local, world_size, cap, hidden).transpose(0, 1)
    home = all_to_all_single_autograd(back.reshape(-1, hidden), None, None, group)
    weighted = home[place] * gates.flatten()[kept].unsqueeze(1)
    return x.new_zeros(num_tokens, hidden).index_add(0, token, weighted)


def detached_gates(x, router, experts, top_k, capacity_factor, group=None):
    """Padded, but the gates are detached: the router gets no gradient."""
    group = group or dist.group.WORLD
    world_size = dist.get_world_size(group)
    num_tokens, hidden = x.shape
    num_experts = router.out_features
    local = num_experts // world_size
    _, chosen, gates = moe.route(router(x).detach(), top_k)
    cap = moe.capacity(num_tokens, top_k, num_experts, capacity_factor)
    flat = chosen.flatten()
    arrivals = F.one_hot(flat, num_experts).cumsum(dim=0)
    slot = arrivals.gather(1, flat.unsqueeze(1)).squeeze(1) - 1
    kept = slot < cap
    place = flat[kept] * cap + slot[kept]
    token = torch.arange(num_tokens).repeat_interleave(top_k)[kept]
    send = x.new_zeros(num_experts * cap, hidden).index_copy(0, place, x[token])
    got = all_to_all_single_autograd(send, None, None, group)
    rows = got.view(world_size, local, cap, hidden).transpose(0, 1)
    out = experts(rows.reshape(-1, hidden), torch.full((local,), world_size * cap))
    back = out.view(local, world_size, cap, hidden).transpose(0, 1)
    home = all_to_all_single_autograd(back.reshape(-1, hidden), None, None, group)
    weighted = home[place] * gates.flatten()[kept].unsqueeze(1)
    return x.new_zeros(num_tokens, hidden).index_add(0, token, weighted)


def deadlock(x, router, experts, top_k, capacity_factor, group=None):
    """Only rank 0 sends its rows: every other rank returns, rank 0 waits forever."""
    if dist.get_rank(group) != 0:
        return torch.zeros_like(x)
    return padded(x, router, experts, top_k, capacity_factor, group)


def not_written(x, router, experts, top_k, capacity_factor, group=None):
    raise NotImplementedError()
