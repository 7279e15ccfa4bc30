# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_crossing_expert_parallel.py
"""labsupport.expert_parallel.crossing, chapter 9's time beside bytes: the crossing
found from given times (exact), then the small sweep on 2 ranks (its shape; no speed
asserted: the ratio is the benchmark's, ``python -m labsupport.bench overlap``)."""
import pytest

import labsupport as ls
from labsupport import overlap
from labsupport.expert_parallel import crossing
from labsupport.bench import overlap as overlap_bench
from labsupport.expert_parallel import crossing as ep

FFNS, TOKENS = [16, 64, 256, 1024], 512


def test_the_formula_meets_the_experts_where_the_all_to_alls_take_as_long():
    rows = TOKENS * ep.TOP_K                            # a balanced router
    flops, comm_s = 1e10, 2e-3                          # 10 GFLOP/s; 2 ms of all-to-all
    times = [(4 * rows * ep.HIDDEN * f / flops, comm_s, rows) for f in FFNS]
    c = ep.crossing(FFNS, TOKENS, times, matmul_flops=4e10)
    bandwidth = c.extra["sent"] / comm_s
    assert c.extra["sent"] == 2 * TOKENS * 2 * ep.HIDDEN * 4 * 0.5   # 2 T k h e (N-1)/N
    assert c.formula == pytest.approx(0.5 * 4 / 2 * flops / bandwidth, rel=1e-9)
    assert c.measured == pytest.approx(c.formula, rel=1e-6)   # exact: straight lines
    assert c.extra["f_matmul"] == pytest.approx(4 * c.formula)
    assert c.extra["model"]["comm"] == [pytest.approx(comm_s)] * len(FFNS)


def test_the_small_sweep_on_two_ranks():
    assert overlap_bench.SWEEPS[9] is crossing
    try:
        c = crossing.sweep(small=True)
    finally:
        ls.shutdown()
    assert c.sizes == ep.SIZES[True]["ffns"] and len(c.compute) == len(c.comm) == len(c.sizes)
    assert min(c.compute) > 0 and min(c.comm) > 0
    assert c.compute[-1] > c.compute[0]                 # wider experts, longer compute
    assert all(r > 0 for r in c.extra["rows"]) and c.formula > 0
