# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest \
#   tests/test_crossing_context_parallel.py
"""labsupport.context_parallel.crossing, chapter 6's time beside bytes: the two
curves, the crossing, the formula's from an independent link, the speed-ups
and their bound read from given timelines (exact), then the small sweep on 2
ranks (its shape; no speed asserted: the speed-up is the benchmark's,
``python -m labsupport.bench overlap``)."""
import pytest

from labsupport.context_parallel import crossing

SIZES = [16, 64, 256, 1024]
FLOPS, ALPHA, BETA = 1e10, 1e-4, 1e9
H, E = crossing.HEADS * crossing.HEAD_DIM, 4


def _run(compute, transfer, wait=0.0):
    """One rank's forward without overlap on 2 ranks: step 0's compute and wait,
    step 1's compute."""
    return [dict(lane="compute", start=0.0, end=compute, step=0),
            dict(lane="comm", start=compute, end=compute + transfer + wait, step=0),
            dict(lane="compute", start=compute + transfer + wait,
                 end=2 * compute + transfer + wait, step=1)]


def _rows(link_beta=BETA, late=0.0, wait=1e-3):
    """Two ranks' rows: rank 1 waits 1 ms longer for each transfer (it came first)
    and leaves each barrier ``late`` seconds after rank 0. The link's exchanges
    take ALPHA + S/link_beta."""
    by_rank = []
    for rank, extra in enumerate((0.0, wait)):
        rows = []
        for c in SIZES:
            compute, transfer = 4 * c * c * H / FLOPS, ALPHA + 2 * c * H * E / BETA
            start = rank * late
            off, on = 2 * compute + transfer, compute + max(compute, transfer)
            rows.append(dict(start={o: [start] * 3 for o in (False, True)},
                             end={False: [late + off] * 3, True: [late + on] * 3},
                             events={o: [_run(compute, transfer, extra)] * 3
                                     for o in (False, True)}))
        by_rank.append(dict(rows=rows, link=[ALPHA + s / link_beta for s in crossing.LINK_BYTES]))
    return by_rank


def test_the_curves_crossing_and_speedups_from_given_timelines():
    c = crossing.summarise(SIZES, _rows())
    assert c.compute == [pytest.approx(4 * s * s * H / FLOPS) for s in SIZES]
    assert c.comm == [pytest.approx(ALPHA + 2 * s * H * E / BETA) for s in SIZES]
    assert c.extra["flops_per_s"] == pytest.approx(FLOPS)
    assert c.extra["alpha"] == pytest.approx(ALPHA, rel=1e-3)
    assert c.extra["bytes_per_s"] == pytest.approx(BETA, rel=1e-3)
    assert c.measured is not None and 16 < c.measured < 1024
    assert c.formula == pytest.approx(c.measured, rel=0.3)  # exact curves, log interpolation
    large = c.extra["large_block"]                         # the first block past the crossing
    assert large == min(s for s in SIZES if s > c.measured)
    # perfect overlap: every measured speed-up is (2a + b) / (a + max(a, b)); rank 1's
    # wait, 1 ms longer (a late peer), could hide more: its pair's bound is higher
    for a, b, up, most in zip(c.compute, c.comm, c.extra["speedup"], c.extra["bound"]):
        assert up == pytest.approx(crossing.bound(a, b)) and most >= up
    same = crossing.summarise(SIZES, _rows(wait=0.0))                # both ranks wait alike
    assert same.extra["bound"] == [pytest.approx(crossing.bound(a, b))
                                   for a, b in zip(same.compute, same.comm)]
    assert c.extra["overlap_speedup_large_block"] == c.extra["speedup"][SIZES.index(large)]
    assert c.extra["speedup_range"] == [(pytest.approx(s), pytest.approx(s))
                                        for s in c.extra["speedup"]]


def test_the_formula_comes_from_the_link_not_from_the_sweeps_transfers():
    slow = crossing.summarise(SIZES, _rows(link_beta=BETA / 4))   # a link 4x slower than the ring
    assert slow.extra["bytes_per_s"] == pytest.approx(BETA / 4, rel=1e-3)
    assert slow.comm == crossing.summarise(SIZES, _rows()).comm  # the measured curve is unchanged
    assert slow.formula > 2 * slow.measured                 # the formula moves on its own


def test_a_rank_leaving_the_barrier_late_does_not_count_as_ring_time():
    on_time, late = crossing.summarise(SIZES, _rows()), crossing.summarise(SIZES, _rows(late=5e-3))
    assert late.extra["speedup"] == [pytest.approx(s) for s in on_time.extra["speedup"]]


@pytest.mark.parametrize("a, b, n, want", [
    (1.0, 1.0, 2, 1.5), (2.0, 1.0, 2, 1.25), (1.0, 4.0, 2, 1.2), (1.0, 1.0, 4, 1.75),
    (100.0, 1.0, 2, 201 / 200)])
def test_the_bound(a, b, n, want):
    assert crossing.bound(a, b, n) == pytest.approx(want)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="at least 2 positive block lengths"):
        crossing.sweep(sizes=[0, 16])
