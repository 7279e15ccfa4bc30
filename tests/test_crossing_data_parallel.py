# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_crossing_data_parallel.py
"""labsupport.data_parallel.crossing, chapter 3's time beside bytes: the crossing found
from given times (exact), then the small sweep on 2 ranks (its shape; no speed asserted:
the ratio is the benchmark's, ``python -m labsupport.bench overlap``)."""
import pytest

from labsupport import overlap
from labsupport.data_parallel import crossing

TOKENS = [4, 32, 256, 2048]


def _link_seconds(alpha, beta):
    return [alpha + n / beta for n in crossing.LINK_BYTES]


def test_the_formula_meets_the_backward_where_the_all_reduce_takes_as_long():
    per_token, flops, grads = 1e6, 1e10, 4e6         # the backward at 10 GFLOP/s
    alpha, beta = 1e-3, 1e9
    reduce_s = alpha + grads / beta
    compute = [t * per_token / flops for t in TOKENS]
    c = crossing.crossing(TOKENS, compute, [reduce_s] * len(TOKENS), per_token,
                               grads, _link_seconds(alpha, beta))
    assert c.extra["flops_per_s"] == pytest.approx(flops)
    assert c.extra["reduce_s"] == pytest.approx(reduce_s, rel=1e-6)
    assert c.formula == pytest.approx(reduce_s * flops / per_token, rel=1e-6)
    assert c.measured == pytest.approx(c.formula, rel=1e-6)   # exact: straight lines
    here = overlap.Hardware("", flops, 2 * beta * 0.5, 0, 2, "")
    assert c.extra["bandwidth_only"] == pytest.approx(
        overlap.dp_min_tokens(here, 2, grad_bytes=4))


def test_no_crossing_when_the_backward_never_catches_up():
    compute = [1e-9 * t for t in TOKENS]
    c = crossing.crossing(TOKENS, compute, [1.0] * 4, 1.0, 4e6,
                               _link_seconds(1e-3, 1e9))
    assert c.measured is None and c.ratio is None


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="must be positive"):
        crossing.sweep(sizes=[0, 4])
