# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_ring_attention.py
"""labsupport.context_parallel.ring_attention, the context parallelism chapter 6 teaches.

Parity through the launcher at world sizes 2 and 4, causal and not, against
single-process float64 scaled_dot_product_attention: outputs and the
gradients of q, k and v, for ring attention and Ulysses, on lengths that N
divides and lengths it does not (padded, the padding masked); the bytes ring
attention sends; the score blocks it computes per rank; the errors for bad
input; and the notebook's copy of the code being the package's, character
for character.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import labsupport as ls
from labsupport import traffic
from labsupport.context_parallel import ring_attention as ra
from labsupport.timeline import Timeline
from nbtools import assert_lesson_copy

B, A, D = 2, 4, 8


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world_size={n}")
def cluster(request):
    c = ls.start(world_size=request.param, backend="gloo")
    yield c
    c.shutdown()


def _qkv(s, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, A, s, D, generator=g, dtype=torch.float64) for _ in range(4)]


def _distributed(name, s, causal):
    rank, n = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = _qkv(s)
    mine = [ra.shard_sequence(t, rank, n).clone().requires_grad_() for t in (q, k, v)]
    out = getattr(ra, name)(*mine, causal=causal, seq_len=s)
    out.backward(ra.shard_sequence(dout, rank, n))
    return out.detach(), [t.grad for t in mine]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", ["ring_attention", "ulysses_attention"])
def test_outputs_and_gradients_equal_sdpa(cluster, name, causal):
    for s in (16, 13, 3):  # 13 and 3: padded (3 < 4: a rank holds only padding)
        results = cluster.run(_distributed, name, s, causal)
        q, k, v, dout = _qkv(s)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        want.backward(dout)
        torch.testing.assert_close(ra.unshard([r[0] for r in results], s), want)
        for i, t in enumerate((q, k, v)):
            got = ra.unshard([r[1][i] for r in results], s)
            torch.testing.assert_close(got, t.grad, msg=f"d{'qkv'[i]}, s={s}")


def _forward_stats(s, causal, overlap):
    rank, n = dist.get_rank(), dist.get_world_size()
    q, k, v, _ = _qkv(s)
    mine = [ra.shard_sequence(t.float(), rank, n) for t in (q, k, v)]
    ra.reset_scores()
    tl = Timeline(rank)
    with traffic.count(settle=0) as t:
        out, lse = ra.ring_forward(*mine, causal=causal, overlap=overlap, tl=tl)
    return dict(out=out, sent=t.sent, scores=dict(ra.SCORES), events=tl.events)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no overlap"])
def test_forward_bytes_blocks_and_timeline(cluster, overlap):
    n, s = cluster.world_size, 32
    c = s // n
    block_bytes = 2 * B * A * c * D * 4  # k and v of one rank, float32
    for causal in (False, True):
        results = cluster.run(_forward_stats, s, causal, overlap)
        q, k, v, _ = (t.float() for t in _qkv(s))
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.testing.assert_close(ra.unshard([r["out"] for r in results], s), want)
        for rank, r in enumerate(results):
            assert r["sent"] == (n - 1) * block_bytes
            blocks = rank + 1 if causal else n  # contiguous causal: rank r does r + 1
            assert r["scores"]["elements"] == blocks * c * c
            assert r["scores"]["largest_bytes"] == B * A * c * c * 4
            lanes = [e["lane"] for e in r["events"]]
            assert lanes.count("compute") == blocks and lanes.count("comm") == n - 1


def _ring_in_group(s):
    """Two rings of 2 ranks on 4: ranks (0, 1) on sequence 0, (2, 3) on sequence 1."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    q, k, v, dout = _qkv(s, seed=rank // 2)
    mine = [ra.shard_sequence(t, rank % 2, 2).clone().requires_grad_() for t in (q, k, v)]
    out = ra.ring_attention(*mine, causal=True, seq_len=s, group=groups[rank // 2])
    out.backward(ra.shard_sequence(dout, rank % 2, 2))
    return out.detach(), [t.grad for t in mine]


def test_ring_attention_over_a_group(cluster):
    if cluster.world_size != 4:
        pytest.skip("two rings of 2 ranks need 4 ranks")
    results = cluster.run(_ring_in_group, 13)
    for seq in (0, 1):
        q, k, v, dout = (t.requires_grad_() for t in _qkv(13, seed=seq))
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        want.backward(dout)
        pair = results[2 * seq:2 * seq + 2]
        torch.testing.assert_close(ra.unshard([r[0] for r in pair], 13), want)
        for i, t in enumerate((q, k, v)):
            torch.testing.assert_close(ra.unshard([r[1][i] for r in pair], 13), t.grad)


def test_ulysses_refuses_heads_that_n_does_not_divide(cluster):
    def run():
        x = torch.zeros(1, 3, 4, 2)
        return ra.ulysses_attention(x, x, x)
    if cluster.world_size == 2:
        with pytest.raises(ls.RankError, match="3 heads over 2 ranks.*divisible by N"):
            cluster.run(run)


def test_shard_sequence_pads_and_unshard_cuts():
    x = torch.arange(7.0).reshape(1, 1, 7, 1)
    blocks = [ra.shard_sequence(x, r, 4) for r in range(4)]
    assert [b.flatten().tolist() for b in blocks] == [[0, 1], [2, 3], [4, 5], [6, 0]]
    assert torch.equal(ra.unshard(blocks, 7), x)
    with pytest.raises(ValueError, match="needs \\(..., s, d\\)"):
        ra.shard_sequence(torch.zeros(3), 0, 2)


def test_lse_merge_of_two_halves_is_the_whole_softmax():
    q, k, v, _ = _qkv(10)
    o1, l1 = ra.block_attention(q, k[..., :4, :], v[..., :4, :])
    o2, l2 = ra.block_attention(q, k[..., 4:, :], v[..., 4:, :])
    out, lse = ra.lse_merge(o1, l1, o2, l2)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))
    torch.testing.assert_close(lse, torch.logsumexp(q @ k.mT / D ** 0.5, -1, keepdim=True))


# -- the notebook's copy of the lesson is the package's ---------------------------

def test_the_notebook_copy_is_the_package_code():
    assert_lesson_copy(ra)
