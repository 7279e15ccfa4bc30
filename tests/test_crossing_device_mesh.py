# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_crossing_device_mesh.py
"""labsupport.device_mesh.crossing, chapter 8's time beside bytes: the crossing found from
given times (exact), then the small sweep on 4 ranks (its shape; no speed asserted: the
ratio is the benchmark's, ``python -m labsupport.bench overlap``)."""
import pytest

from labsupport import overlap
from labsupport.device_mesh import crossing

TOKENS = [64, 256, 1024, 4096]


def test_the_formula_meets_the_backward_where_the_reduction_takes_as_long():
    per_token = 2 / 3 * overlap.decoder_flops(1, 32, 2, 128, 128) / 2
    flops = 1e10                                     # the backward at 10 GFLOP/s
    compute = [t * per_token / flops for t in TOKENS]
    alpha, beta, grads = 1e-3, 1e9, [4096] * 10      # 10 all-reduces of 4 KiB
    reduce_s = 10 * (alpha + 4096 / beta)
    times = [(c, reduce_s) for c in compute]
    c = crossing.crossing(TOKENS, times, (alpha, beta), grads)
    assert c.formula == pytest.approx(reduce_s * flops / per_token, rel=1e-6)
    assert c.measured == pytest.approx(c.formula, rel=1e-6)   # exact: straight lines
    assert c.extra["flops"] == pytest.approx(flops)
    assert c.extra["model"]["comm"] == [pytest.approx(reduce_s)] * len(TOKENS)
    assert c.extra["bandwidth_only"] == pytest.approx(overlap.dp_min_tokens(
        overlap.Hardware("", flops, beta, beta, 4, ""), 2, grad_bytes=4))


def test_no_crossing_when_the_backward_never_catches_up():
    times = [(1e-6 * t, 1.0) for t in TOKENS]
    c = crossing.crossing(TOKENS, times, (1e-3, 1e9), [4096])
    assert c.measured is None and c.ratio is None
