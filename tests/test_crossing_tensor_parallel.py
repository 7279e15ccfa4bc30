# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest \
#   tests/test_crossing_tensor_parallel.py
"""labsupport.tensor_parallel.crossing, chapter 4's time beside bytes: the crossing found
from given times (exact), then the small sweep on 2 ranks (its shape; no speed asserted:
the ratio is the benchmark's, ``python -m labsupport.bench overlap``)."""
import pytest

from labsupport.tensor_parallel import crossing

HIDDENS = [16, 64, 256, 1024]


def test_the_formula_meets_the_matmuls_where_the_all_reduce_takes_as_long():
    flops, alpha, beta = 1e10, 1e-3, 1e9
    compute = [crossing.mlp_flops(h) / flops for h in HIDDENS]   # exact h² curve
    comm = [alpha + crossing.TOKENS * h * 4 / beta for h in HIDDENS]
    c = crossing.crossing(HIDDENS, list(zip(compute, comm)), (alpha, beta))
    h = c.formula
    assert crossing.mlp_flops(h) / flops == pytest.approx(
        alpha + crossing.TOKENS * h * 4 / beta, rel=1e-6)
    assert c.extra["flops"] == pytest.approx(flops)
    assert c.measured == pytest.approx(c.formula, rel=0.2)   # log-log interpolation
    assert crossing.mlp_flops(64) == 4 * 256 * 64 * 256 / 2


def test_no_crossing_when_the_matmuls_never_catch_up():
    c = crossing.crossing(HIDDENS, [(1e-6, 1.0)] * len(HIDDENS), (1e-3, 1e9))
    assert c.measured is None and c.ratio is None
