"""The checks of chapter 6 (context parallelism): merging partial attentions, Ulysses' reshape.

    ls.run(context_parallel.check_merge, lse_merge, world_size=2)
    ls.run(context_parallel.check_seq_to_heads, seq_to_heads, world_size=n)

Each runs on every rank and raises an AssertionError that says what is
wrong: the case, what came back, what was expected and the likely reason.
"""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labsupport.context_parallel.ring_attention import block_attention, shard_sequence

HEADS, HEAD_DIM, SEQ = 4, 16, 13


def _qkv(s, dtype, scale=1.0, heads=HEADS, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, heads, s, HEAD_DIM, generator=g, dtype=dtype)
               for _ in range(3))
    return q * scale, k, v


def check_merge(merge):
    """``merge(out, lse, block_out, block_lse)`` against attention over all keys:
    float64 with the keys cut after 1 + rank of them, then float32 with
    scores near 100 (e^100 overflows float32: only a merge in logs passes)."""
    cut = 1 + dist.get_rank()
    for dtype, scale in ((torch.float64, 1.0), (torch.float32, 40.0)):
        q, k, v = _qkv(SEQ, dtype, scale)
        o1, l1 = block_attention(q, k[..., :cut, :], v[..., :cut, :])
        o2, l2 = block_attention(q, k[..., cut:, :], v[..., cut:, :])
        got = merge(o1, l1, o2, l2)
        case = f"{dtype}, keys [0, {cut}) and [{cut}, {SEQ})"
        if not isinstance(got, tuple) or len(got) != 2:
            raise AssertionError(f"{case}: return the pair (out, lse), got {type(got)}")
        out, lse = got
        want_lse = torch.logsumexp(q @ k.mT / math.sqrt(HEAD_DIM), -1, keepdim=True)
        _check_lse(case, lse, want_lse, l1, l2)
        want = F.scaled_dot_product_attention(q, k, v)
        if not torch.isfinite(out).all():
            raise AssertionError(f"{case}: the output holds inf or nan: e^lse overflowed. "
                                 "Weigh each part by exp(its lse - merged lse)")
        if torch.allclose(out, (o1 + o2) / 2):
            raise AssertionError(f"{case}: the output is the plain mean of the two parts; "
                                 "weigh each by its share of the normaliser, Z_A/(Z_A+Z_B)")
        torch.testing.assert_close(out, want, msg=lambda m, case=case: (
            f"{case}: the merged output is not attention over all keys (SDPA): {m}"))


def _check_lse(case, lse, want, l1, l2):
    if not torch.isfinite(lse).all():
        raise AssertionError(f"{case}: lse holds inf or nan: e^lse overflowed (scores "
                             "near 100 here); add the normalisers in logs, torch.logaddexp")
    if lse.shape != want.shape:
        raise AssertionError(f"{case}: lse has shape {tuple(lse.shape)}, expected "
                             f"{tuple(want.shape)} (one per query)")
    for wrong, why in ((torch.maximum(l1, l2), "the larger of the two lse"),
                       (l1 + l2, "lse_A + lse_B = log(Z_A·Z_B)")):
        if torch.allclose(lse, wrong) and not torch.allclose(wrong, want):
            raise AssertionError(f"{case}: the merged lse is {why}; it must be "
                                 "log(Z_A + Z_B) = logaddexp(lse_A, lse_B)")
    torch.testing.assert_close(lse, want, msg=lambda m: (
        f"{case}: the merged lse is not log Z over all keys: {m}"))


def check_seq_to_heads(to_heads):
    """``to_heads`` turns this rank's sequence block (b, a, s/N, d) into the whole
    sequence of its a/N heads, on 3N tokens and on 2N heads (2 a rank)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    x = _qkv(3 * n, torch.float64, heads=2 * n)[0]  # (1, a, s, d)
    got = to_heads(shard_sequence(x, rank, n))
    want = x[:, 2 * rank:2 * rank + 2]  # my heads, the whole sequence
    assert got.shape == want.shape, (f"rank {rank}: shape {tuple(got.shape)}, expected "
                                     f"{tuple(want.shape)}: (b, a/N, s, d)")
    bad = (got != want).any(-1).nonzero().tolist()
    if bad:
        _, head, pos = bad[0]
        rows = (x[0] == got[0, head, pos]).all(-1).nonzero().tolist()
        found = (f"it holds head {rows[0][0]} at position {rows[0][1]}" if rows
                 else "it holds no row of the input")
        raise AssertionError(f"rank {rank}, N={n}: at (head {head}, position {pos}) "
                             f"expected head {2 * rank + head} of the full sequence at "
                             f"position {pos}; {found}")
