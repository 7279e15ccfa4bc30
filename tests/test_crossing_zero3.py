# Run: .venv/bin/python -m pytest tests/test_crossing_zero3.py   (< 1 s; the sweep on
# ranks is tests/test_zero.py's test_the_zero3_sweep_runs_small_and_gives_its_crossings)
"""labsupport.zero.crossing, chapter 7's time beside bytes, from given timelines
(exact): the two curves, the formula's crossing from the link's own all-gathers
(not from the sweep's), the speed-ups and their bound."""
import pytest

from labsupport import overlap
from labsupport.zero import crossing

SIZES = [16, 64, 256, 1024]
FLOPS, ALPHA, BETA, PARAMS = 1e11, 2e-4, 1e9, 400_000
SHAPE, N = crossing.SHAPE, crossing.WORLD_SIZE
PER_TOKEN = overlap.decoder_flops(1, SHAPE["seq_len"], 1, SHAPE["hidden"], 0,
                                  4 * SHAPE["hidden"], backward=False)


def _run(compute, gather):
    return [dict(lane="comm", start=0.0, end=gather, block=True),
            dict(lane="compute", start=gather, end=gather + compute)]


def _by_rank(link_beta=BETA):
    """Two ranks, each block's forward at FLOPS and its all-gather at ALPHA + S/BETA,
    perfectly prefetched; the link's all-gathers at ALPHA + S/link_beta."""
    gather = ALPHA + 4 * PARAMS / BETA
    rows = []
    for t in SIZES:
        a, layers = t * PER_TOKEN / FLOPS, SHAPE["layers"]
        off, on = layers * (a + gather), gather + (layers - 1) * max(a, gather) + a
        rows.append(dict(seconds={False: [off] * 3, True: [on] * 3}, block_params=PARAMS,
                         events={o: [_run(a, gather)] * 3 for o in (False, True)}))
    link = [ALPHA + s / link_beta for s in crossing.LINK_BYTES]
    return [dict(rows=rows, link=link) for _ in range(N)]


def test_the_curves_and_the_formula_from_given_times():
    c = crossing.summarise(SIZES, _by_rank(), SHAPE, N)
    gather = ALPHA + 4 * PARAMS / BETA
    assert c.compute == [pytest.approx(t * PER_TOKEN / FLOPS) for t in SIZES]
    assert c.comm == [pytest.approx(gather)] * len(SIZES)
    assert c.extra["flops_per_s"] == pytest.approx(FLOPS)
    assert c.extra["alpha"] == pytest.approx(ALPHA, rel=1e-3)
    assert c.extra["beta"] == pytest.approx(BETA, rel=1e-3)
    assert c.formula == pytest.approx(gather * FLOPS / PER_TOKEN, rel=1e-3)
    assert c.measured == pytest.approx(c.formula, rel=1e-3)   # straight lines in log-log
    assert c.extra["speedup"] == [pytest.approx(b) for b in c.extra["bound"]]


def test_the_formula_comes_from_the_link_not_from_the_sweeps_all_gathers():
    slow = crossing.summarise(SIZES, _by_rank(link_beta=BETA / 4), SHAPE, N)
    assert slow.comm == crossing.summarise(SIZES, _by_rank(), SHAPE, N).comm
    assert slow.formula > 2 * slow.measured


@pytest.mark.parametrize("a, b, want", [(1.0, 1.0, 8 / 5), (3.0, 1.0, 16 / 13),
                                        (1.0, 3.0, 16 / 13)])
def test_the_bound_of_four_blocks(a, b, want):
    assert crossing.bound(a, b, blocks=4) == pytest.approx(want)
