"""Zig-zag ring attention, wrong, for tests/test_grading_zigzag_ring_attention.py.

A ring of the tests' own (``_ring``) over any layout and merge, so that each
wrong answer differs from a right one in one thing; the reference is the source
notebook's (tests/sources.py). ``zigzag_positions`` is the right layout, which
the wrong rings use.

In their own module, which imports only torch and labsupport.context_parallel.ring_attention:
the ranks import it to unpickle each function.
"""
import torch
import torch.distributed as dist

from labsupport.context_parallel.ring_attention import block_attention, lse_merge


def zigzag_positions(seq_len, rank, world_size):
    chunk = seq_len // (2 * world_size)
    last = 2 * world_size - 1 - rank
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange(last * chunk, (last + 1) * chunk)])


def contiguous_positions(seq_len, rank, world_size):
    c = seq_len // world_size
    return torch.arange(rank * c, (rank + 1) * c)


def overlapping_positions(seq_len, rank, world_size):
    return torch.arange(seq_len // world_size)  # every rank: the first block


def _ring(q, k, v, positions, plan, merge=lse_merge, blocking=False, extra=None):
    """A causal ring over any layout; plan(rank, src, half) -> (rows, keys) or None."""
    rank, n = dist.get_rank(), dist.get_world_size()
    seq_len, half = q.shape[-2] * n, q.shape[-2] // 2
    q_pos = positions(seq_len, rank, n)
    kv, out, lse = torch.stack([k, v]), None, None
    for step in range(n):
        src = (rank - step) % n
        incoming, requests = torch.empty_like(kv), []
        if step < n - 1:
            if blocking:  # every rank sends first: nobody receives
                dist.send(kv, (rank + 1) % n)
                dist.recv(incoming, (rank - 1) % n)
            else:
                ops = [dist.P2POp(dist.isend, kv, (rank + 1) % n),
                       dist.P2POp(dist.irecv, incoming, (rank - 1) % n)]
                if extra is not None:
                    ops.append(dist.P2POp(dist.isend, extra, (rank + 1) % n))
                    ops.append(dist.P2POp(dist.irecv, torch.empty_like(extra), (rank - 1) % n))
                requests = dist.batch_isend_irecv(ops)
        picked = plan(rank, src, half)
        if picked is not None:
            rows, keys = picked
            k_pos = positions(seq_len, src, n)[keys]
            mask = k_pos[None, :] <= q_pos[rows][:, None]
            o, o_lse = block_attention(q[..., rows, :], kv[0][..., keys, :],
                                       kv[1][..., keys, :], mask)
            if out is None:
                out, lse = o, o_lse
            else:
                out[..., rows, :], lse[..., rows, :] = merge(out[..., rows, :],
                                                             lse[..., rows, :], o, o_lse)
        for request in requests:
            request.wait()
        kv = incoming
    return out


def _zigzag_plan(rank, src, half):
    if src < rank:
        return slice(None), slice(0, half)
    if src > rank:
        return slice(half, None), slice(None)
    return slice(None), slice(None)


def _contiguous_plan(rank, src, half):
    return (slice(None), slice(None)) if src <= rank else None


def contiguous_ring_attention(q, k, v):
    """Correct causal attention with contiguous blocks: rank N-1 does N times rank 0's work."""
    return _ring(q, k, v, contiguous_positions, _contiguous_plan)


def average_merge(out, lse, block_out, block_lse):
    return (out + block_out) / 2, torch.logaddexp(lse, block_lse)


def wrong_merge_attention(q, k, v):
    return _ring(q, k, v, zigzag_positions, _zigzag_plan, merge=average_merge)


def blocking_attention(q, k, v):
    return _ring(q, k, v, zigzag_positions, _zigzag_plan, blocking=True)


def sends_q_too_attention(q, k, v):
    return _ring(q, k, v, zigzag_positions, _zigzag_plan, extra=q.contiguous())


def all_gather_attention(q, k, v):
    """Right output, but K and V gathered with a collective."""
    n = dist.get_world_size()
    ks, vs = [torch.empty_like(k) for _ in range(n)], [torch.empty_like(v) for _ in range(n)]
    dist.all_gather(ks, k)
    dist.all_gather(vs, v)
    seq_len = q.shape[-2] * n
    k_pos = torch.cat([zigzag_positions(seq_len, r, n) for r in range(n)])
    q_pos = zigzag_positions(seq_len, dist.get_rank(), n)
    out, _ = block_attention(q, torch.cat(ks, -2), torch.cat(vs, -2),
                             k_pos[None, :] <= q_pos[:, None])
    return out
