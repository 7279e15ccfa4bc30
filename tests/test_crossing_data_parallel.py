# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_crossing_data_parallel.py
"""labsupport.data_parallel.crossing, chapter 3's time beside bytes: the crossing found
from given times (exact), then the small sweep on 2 ranks (its shape; no speed asserted:
the ratio is the benchmark's, ``python -m labsupport.bench overlap``)."""
import pytest

import labsupport as ls
from labsupport import overlap
from labsupport.bench import overlap as overlap_bench
from labsupport.data_parallel import crossing
from labsupport.data_parallel import crossing as data_parallel

TOKENS = [4, 32, 256, 2048]


def _link_seconds(alpha, beta):
    return [alpha + n / beta for n in data_parallel.LINK_BYTES]


def test_the_formula_meets_the_backward_where_the_all_reduce_takes_as_long():
    per_token, flops, grads = 1e6, 1e10, 4e6         # the backward at 10 GFLOP/s
    alpha, beta = 1e-3, 1e9
    reduce_s = alpha + grads / beta
    compute = [t * per_token / flops for t in TOKENS]
    c = data_parallel.crossing(TOKENS, compute, [reduce_s] * len(TOKENS), per_token,
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
    c = data_parallel.crossing(TOKENS, compute, [1.0] * 4, 1.0, 4e6,
                               _link_seconds(1e-3, 1e9))
    assert c.measured is None and c.ratio is None


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="must be positive"):
        data_parallel.sweep(sizes=[0, 4])


def test_the_small_sweep_on_two_ranks():
    assert overlap_bench.SWEEPS[3] is crossing
    try:
        c = crossing.sweep(small=True)
    finally:
        ls.shutdown()
    assert c.sizes == data_parallel.SIZES[True]
    assert len(c.compute) == len(c.comm) == len(c.extra["speedup"]) == len(c.sizes)
    assert min(c.compute) > 0 and min(c.comm) > 0 and min(c.extra["speedup"]) > 0
    assert c.compute[-1] > c.compute[0]                 # more tokens, longer backward
    assert c.extra["grad_bytes"] == 4 * sum(
        p.numel() for p in ls.models.DeepMLP(**data_parallel.SHAPE).parameters())
    assert c.extra["beta"] > 0 and c.formula is not None and c.formula > 0
