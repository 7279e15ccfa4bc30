# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_ring.py
"""labsupport.ring.ring, the ring all-reduce chapter 2 teaches and later chapters reuse.

Parity through the launcher at world sizes 1, 2, 3 and 4 against
dist.all_reduce and a single-process sum (sizes that N does not divide,
sizes below N, many segments), exact payload bytes, the error for bad input,
and the notebook's copy of the code being the package's, character for
character.
"""

import pytest
import torch
import torch.distributed as dist

import labsupport as ls
from labsupport import traffic
from labsupport.ring import ring
from nbtools import assert_lesson_copy

SIZES = [1, 2, 3, 10, 1001, 65_537, 300_007]
RINGS = ("ring_allreduce_naive", "ring_allreduce_simple", "ring_allreduce")


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda n: f"world_size={n}")
def cluster(request):
    c = ls.start(world_size=request.param, backend="gloo")
    yield c
    c.shutdown()


def _input(rank, numel, dtype=torch.float32):
    """Integers in [-8, 8): sums are exact, so every order of additions agrees."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(-8, 8, (numel,), generator=g).to(dtype)


def _parity(sizes, segment_bytes, dtype):
    failures = []
    for numel in sizes:
        x = _input(dist.get_rank(), numel, dtype)
        want = x.clone()
        dist.all_reduce(want)
        got = {"ring_allreduce_naive": ring.ring_allreduce_naive(x.clone()),
               "ring_allreduce_simple": ring.ring_allreduce_simple(x.clone()),
               "ring_allreduce": ring.ring_allreduce(x.clone(), segment_bytes)}
        failures += [(name, numel) for name, t in got.items() if not torch.equal(t, want)]
    return failures


@pytest.mark.parametrize("segment_bytes", [ring.SEGMENT_BYTES, 4000],
                         ids=["default segments", "1000-float segments"])
def test_both_rings_equal_dist_all_reduce_bit_for_bit(cluster, segment_bytes):
    assert cluster.run(_parity, SIZES, segment_bytes, torch.float32) == \
        [[]] * cluster.world_size


def test_integer_tensors_and_the_single_process_sum(cluster):
    def run(numel):
        return ring.ring_allreduce(_input(dist.get_rank(), numel, torch.int64), 40)

    n = cluster.world_size
    want = sum(_input(r, 999, torch.int64) for r in range(n))
    for got in cluster.run(run, 999):
        assert torch.equal(got, want)


def test_random_floats_agree_to_rounding_and_shape_is_kept(cluster):
    def run():
        torch.manual_seed(dist.get_rank())
        x = torch.randn(37, 101)
        want = x.clone()
        dist.all_reduce(want)
        got = ring.ring_allreduce(x)
        assert got is x and got.shape == (37, 101)  # in place
        torch.testing.assert_close(got, want)

    cluster.run(run)


def _payload(numel):
    counts = {}
    for name in RINGS:
        x = torch.ones(numel)
        with traffic.count(settle=0) as t:
            getattr(ring, name)(x)
        counts[name] = (t.sent, t.received)
    return counts


def test_payload_bytes_are_the_formulas(cluster):
    n, numel = cluster.world_size, 12 * 1001  # divisible by 1, 2, 3 and 4
    s = 4 * numel
    for counts in cluster.run(_payload, numel):
        assert counts["ring_allreduce_naive"] == ((n - 1) * s,) * 2
        assert counts["ring_allreduce"] == (2 * (n - 1) * s // n,) * 2
        assert counts["ring_allreduce_simple"] == counts["ring_allreduce"]


def test_payload_when_n_does_not_divide_the_size(cluster):
    n, numel = cluster.world_size, 1001 * 4 + 1
    sizes = [c.numel() for c in torch.empty(numel).tensor_split(n)]
    for rank, counts in enumerate(cluster.run(_payload, numel)):
        # rank r sends every chunk but r (reduce-scatter), every one but r+1
        # (all-gather): 2S less those two chunks.
        skipped = sizes[rank] + sizes[(rank + 1) % n] if n > 1 else 2 * numel
        assert counts["ring_allreduce"][0] == 4 * (2 * numel - skipped)
        assert counts["ring_allreduce_simple"][0] == 4 * (2 * numel - skipped)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_last_reduce_scatter_step_completes_chunk_r_on_rank_r(world_size):
    """As dist.reduce_scatter_tensor leaves it: rank r finishes chunk r."""
    n, chunks = world_size, torch.arange(10 * world_size + 1).tensor_split(world_size)
    for rank in range(n):
        last = [part for step, part in ring.arrivals(chunks, rank, 3) if step == n - 2]
        assert torch.equal(torch.cat(last), chunks[rank]), rank


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_each_rank_receives_what_its_left_neighbour_sends_in_that_order(world_size):
    """What step s brings is what step s+1 sends on: the receives match the sends."""
    n, chunks = world_size, torch.arange(10 * world_size + 1).tensor_split(world_size)
    for rank in range(n):
        left = (rank - 1) % n
        sent = list(chunks[(left - 1) % n].split(3)) + \
            [part for step, part in ring.arrivals(chunks, left, 3) if step < 2 * n - 3]
        received = [part for _, part in ring.arrivals(chunks, rank, 3)]
        assert len(sent) == len(received)
        for s, r in zip(sent, received):
            assert s.data_ptr() == r.data_ptr() and s.numel() == r.numel()


def test_a_non_contiguous_tensor_is_refused_with_a_hint(cluster):
    with pytest.raises(ls.RankError, match=r"contiguous.*t\.contiguous\(\)"):
        cluster.run(lambda: ring.ring_allreduce(torch.ones(4, 6).T))


# -- the notebook's copy of the lesson is the package's ---------------------------

def test_the_notebook_copy_is_the_package_code():
    assert_lesson_copy(ring)
