# Run: flock /tmp/heavy.lock .venv/bin/python -m pytest \
#          tests/test_crossing_expert_parallel.py
"""labsupport.expert_parallel.crossing, chapter 9's time beside bytes: the crossing
found from given times and a given link (exact), the forward-and-backward formula,
then the small sweep on 2 ranks (its shape; no speed asserted: the ratio is the
benchmark's, ``python -m labsupport.bench overlap``)."""
import pytest

from labsupport import overlap
from labsupport.expert_parallel import crossing

FFNS, TOKENS = [16, 64, 256, 1024], 512


def test_the_formula_meets_the_experts_where_the_step_s_all_to_alls_take_as_long():
    rows = TOKENS * crossing.TOP_K                            # a balanced router
    flops, alpha, beta = 1e10, 1e-4, 1e9                # 10 GFLOP/s; 100 us, 1 GB/s
    link = [alpha + s / beta for s in crossing.LINK_BYTES]
    step = 4 * (alpha + rows * crossing.HIDDEN * 4 / beta) + alpha + 8 * crossing.EXPERTS / beta
    compute = [12 * rows * crossing.HIDDEN * f / flops for f in FFNS]
    c = crossing.crossing(FFNS, TOKENS, compute, [step] * len(FFNS), [rows] * len(FFNS),
                    link, matmul_flops=4e10)
    assert c.extra["alpha"] == pytest.approx(alpha)
    assert c.extra["beta"] == pytest.approx(beta)
    assert c.extra["step_comm"] == pytest.approx(step)
    assert c.formula == pytest.approx(step * flops / (12 * rows * crossing.HIDDEN), rel=1e-6)
    assert c.measured == pytest.approx(c.formula, rel=1e-6)   # exact: straight lines
    assert c.extra["f_matmul"] == pytest.approx(4 * c.formula, rel=1e-6)
    assert c.extra["bandwidth_only"] == pytest.approx(4 / 3 * flops / beta)   # e/3 C/β
    assert c.extra["model"]["comm"] == [pytest.approx(step)] * len(FFNS)


def test_the_backward_lowers_the_crossing_by_a_third():
    h100 = overlap.HARDWARE["H100"]
    forward = overlap.ep_min_ffn(h100, 8)
    step = overlap.ep_min_ffn(h100, 8, backward=True)
    assert step == pytest.approx(forward * 2 / 3)


def test_the_least_waiting_rank_is_taken_call_by_call():
    # two ranks, one width, two runs of two calls: each call's least wait, summed
    def rank(comm):                                     # two widths, the same calls
        width = dict(compute=[1.0, 1.0], comm=comm, replay=comm, rows=1024)
        return dict(rows=[width, dict(width, compute=[4.0, 4.0])],
                    link=[1e-4 + s / 1e9 for s in crossing.LINK_BYTES], matmul_flops=1e10)
    by_rank = [rank([[1.0, 5.0], [2.0, 2.0]]), rank([[4.0, 1.0], [3.0, 1.0]])]
    c = crossing.summarise([64, 256], 512, by_rank)
    assert c.comm == [pytest.approx(2.5)] * 2              # runs: 1 + 1 = 2, 2 + 1 = 3
    assert c.compute == [1.0, 4.0]
    assert c.extra["comm_range"] == [(2.0, 3.0)] * 2
    slowest = c.extra["slowest_rank_comm"]
    assert slowest == [pytest.approx(5.0)] * 2            # max(6, 5), max(4, 4)
    assert c.extra["replay"] == [pytest.approx(2.5)] * 2  # taken the same way


def test_the_replay_makes_the_layers_five_calls_with_its_split_sizes():
    import labsupport as ls
    from labsupport import calls

    def on_rank():
        ep_layer, x = crossing._layer(32, 64)
        ep_layer(x).sum().backward()
        with calls.record() as step:
            ep_layer(x).sum().backward()
        with calls.record() as replay:
            seconds = crossing._replay(ep_layer.splits)
        return ([c["sizes"] for c in step.calls if c["op"] == "all_to_all_single"],
                [c["sizes"] for c in replay.calls if c["op"] == "all_to_all_single"],
                len(seconds))
    try:
        for step, replay, n in ls.run(on_rank, world_size=2):
            assert n == 5 and replay == step          # the same buffers, in order
    finally:
        ls.shutdown()
