# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_crossing_context_parallel.py
"""labsupport.crossings.context_parallel, chapter 6's time beside bytes: the two
curves, the crossing and the speed-ups read from given timelines (exact), then
the small sweep on 2 ranks (its shape; no speed asserted: the speed-up is the
benchmark's, ``python -m labsupport.bench overlap``)."""
import pytest

import labsupport as ls
from labsupport import crossings
from labsupport.crossings import context_parallel as cp

SIZES = [16, 64, 256, 1024]
FLOPS, ALPHA, BETA = 1e10, 1e-4, 1e9
H, E = cp.HEADS * cp.HEAD_DIM, 4


def _run(compute, transfer, wait=0.0):
    return [dict(lane="compute", start=0.0, end=compute),
            dict(lane="comm", start=compute, end=compute + transfer + wait)]


def _rows():
    """Two ranks' rows: rank 1 waits 1 ms longer for each transfer (it came first)."""
    by_rank = []
    for wait in (0.0, 1e-3):
        rows = []
        for c in SIZES:
            compute, transfer = 4 * c * c * H / FLOPS, ALPHA + 2 * c * H * E / BETA
            off, on = compute * 2 + transfer, compute * 2
            rows.append(dict(seconds={False: [off] * 3, True: [on] * 3},
                             events={o: [_run(compute, transfer, wait)] * 3
                                     for o in (False, True)}))
        by_rank.append(rows)
    return by_rank


def test_the_curves_crossing_and_speedups_from_given_timelines():
    c = cp.summarise(SIZES, _rows())
    assert c.compute == [pytest.approx(4 * s * s * H / FLOPS) for s in SIZES]
    assert c.comm == [pytest.approx(ALPHA + 2 * s * H * E / BETA) for s in SIZES]
    assert c.extra["flops_per_s"] == pytest.approx(FLOPS)
    assert c.extra["alpha"] == pytest.approx(ALPHA, rel=1e-3)
    assert c.extra["bytes_per_s"] == pytest.approx(BETA, rel=1e-3)
    assert c.measured is not None and 16 < c.measured < 1024
    assert c.formula == pytest.approx(c.measured, rel=0.3)  # exact curves, log interpolation
    large = c.extra["large_block"]
    assert 4 * large * large * H / FLOPS >= 2 * (ALPHA + 2 * large * H * E / BETA)
    assert c.extra["overlap_speedup_large_block"] > 1


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="at least 2 positive block lengths"):
        cp.sweep(sizes=[0, 16])


def test_the_small_sweep_on_two_ranks():
    assert crossings.TECHNIQUES[6] == "context_parallel"
    try:
        c = crossings.run("context_parallel", small=True)
    finally:
        ls.shutdown()
    assert c.sizes == cp.SIZES[True] and len(c.compute) == len(c.comm) == len(c.sizes)
    assert all(t > 0 for t in c.compute + c.comm)
    assert c.compute[-1] > c.compute[0]                 # c² grows faster than c
    assert set(c.extra["events"][c.sizes[0]]) == {False, True}
