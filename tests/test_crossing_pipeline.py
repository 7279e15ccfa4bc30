# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_crossing_pipeline.py
"""labsupport.pipeline.crossing, chapter 5's time beside bytes: the crossing found from
given times (exact), the ping-pong's calls under NCCL's rules, then the small sweep on 2
ranks (its shape; the ratio is the benchmark's, ``python -m labsupport.bench overlap``)."""
import pytest
import torch

import labsupport as ls
from labsupport.pipeline import crossing

HIDDEN = [32, 256, 1024, 4096]


def _model(h, flops, alpha, beta, tokens=crossing.TOKENS, blocks=crossing.STAGE_BLOCKS):
    return 2 * tokens * blocks * h * h / flops, alpha + tokens * h * 4 / beta


def test_the_formula_meets_the_forward_where_the_send_takes_as_long():
    flops, alpha, beta = 1e10, 2e-4, 1e9
    times = [_model(h, flops, alpha, beta) for h in HIDDEN]
    link = [alpha + n / beta for n in crossing.LINK_BYTES]
    c = crossing.crossing(HIDDEN, [t for t, _ in times], [m for _, m in times], link)
    assert c.extra["flops_per_s"] == pytest.approx(flops)
    assert (c.extra["alpha"], c.extra["beta"]) == (pytest.approx(alpha), pytest.approx(beta))
    compute, comm = _model(c.formula, flops, alpha, beta)
    assert compute == pytest.approx(comm, rel=1e-6)
    assert c.extra["bandwidth_only"] == pytest.approx(4 * flops / (2 * 2 * beta))
    assert c.measured == pytest.approx(c.formula, rel=0.2)   # log-log interpolation


def test_the_stage_is_the_chapters_blocks():
    stage = crossing.stage(64, 2)
    linears = [m for m in stage.modules() if isinstance(m, torch.nn.Linear)]
    assert [tuple(m.weight.shape) for m in linears] == [(64, 64), (64, 64)]


def test_one_message_each_way_in_its_own_batch():
    try:
        calls = ls.start(world_size=2).run(lambda: crossing.ping_pong(torch.ones(8))[0])
    finally:
        ls.shutdown()
    for rank, log in enumerate(calls):
        kinds = [c["op"] for c in log]
        assert kinds == (["isend", "irecv"] if rank == 0 else ["irecv", "isend"]), kinds
