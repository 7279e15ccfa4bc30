# Run: .venv/bin/python -m pytest tests/test_overlap.py
"""labsupport.overlap: the cited crossings, FLOPs of the shared decoder, the crossing finders."""
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from labsupport import models, overlap
from labsupport.sweep import Row

H100 = overlap.HARDWARE["H100"]


def test_the_cited_thresholds_come_out_of_the_formulas():
    # How to Scale Your Model: T > C/W, 990e12 / 450e9 = 2,200 tokens inside an
    # H100 node and 990e12 / 400e9 = 2,475 at the spine (n large, bf16 gradients).
    assert overlap.dp_min_tokens(H100, n=10**9) == pytest.approx(2200, rel=1e-6)
    assert overlap.dp_min_tokens(H100, n=8) == pytest.approx(2200 * 7 / 8)
    assert overlap.dp_min_tokens(H100, n=8, grad_bytes=4) == pytest.approx(2 * 2200 * 7 / 8)
    across = overlap.dp_min_tokens(H100, n=10**9, inside_node=False)
    assert across == pytest.approx(990e12 / 50e9)  # one GPU's share of the node's 400 GB/s
    # TP stops paying near F·W/C (their F = 28,000: about 11-way at W = 400 GB/s).
    assert overlap.tp_max_degree(H100, 28000) == pytest.approx(1 + 28000 * 450e9 / 990e12)
    assert overlap.zero3_min_tokens(H100, 8) == overlap.dp_min_tokens(H100, 8)
    assert overlap.cp_min_block(H100) == pytest.approx(2200)
    # causal zig-zag: half a block's FLOPs for the whole block's bytes, twice the tokens
    assert overlap.cp_min_block(H100, causal_zigzag=True) == pytest.approx(4400)
    assert overlap.ep_min_ffn(H100, 8) == pytest.approx(2200 * 7 / 8)
    assert overlap.pp_min_hidden(H100, 4) == pytest.approx(2 * 990e12 / (24 * 4 * 450e9))


def test_each_crossing_is_where_its_two_times_meet():
    # DP: backward 4·T·Ψ/C against 2(n-1)/n·Ψ·g/W at T = dp_min_tokens.
    psi, n, g = 7e9, 8, 2
    t = overlap.dp_min_tokens(H100, n, g)
    assert 4 * t * psi / H100.flops == pytest.approx(2 * (n - 1) / n * psi * g / H100.intra_bw)
    # TP: 4·T·h·F/t FLOPs against 2(t-1)/t·T·h·e bytes at t = tp_max_degree.
    f, e = 16384, 2
    deg = overlap.tp_max_degree(H100, f, e)
    assert 4 * f / deg / H100.flops == pytest.approx(2 * (deg - 1) / deg * e / H100.intra_bw)


def test_decoder_flops_equal_torchs_own_count_of_the_shared_decoder():
    for cfg in (models.GPTConfig(), models.GPTConfig(hidden=96, heads=4, layers=3, seq_len=32,
                                                     vocab_size=128, ffn=200)):
        model = models.GPT(cfg)
        ids, targets = models.toy_tokens(4, cfg.seq_len, cfg.vocab_size)
        with FlopCounterMode(display=False) as counter:
            model(ids, targets).backward()
        assert counter.get_total_flops() == overlap.decoder_flops(
            ids.numel(), cfg.seq_len, cfg.layers, cfg.hidden, cfg.vocab_size, cfg.ffn_hidden)


def test_crossing_of_two_models_and_none_when_they_do_not_meet():
    compute = lambda x: 2e-6 * x          # noqa: E731
    comm = lambda x: 1e-3 + 1e-8 * x      # noqa: E731
    x = overlap.crossing(compute, comm, 1, 1e6)
    assert compute(x) == pytest.approx(comm(x), rel=1e-9)
    assert overlap.crossing(compute, comm, 1, 10) is None
    with pytest.raises(ValueError, match="0 < lo < hi"):
        overlap.crossing(compute, comm, 0, 10)


def test_measured_crossing_interpolates_in_log_log():
    sizes = [2 ** k for k in range(4, 14)]
    compute = [3e-7 * s ** 2 for s in sizes]      # grows faster
    comm = [1e-4 * s for s in sizes]
    x = overlap.measured_crossing(sizes, compute, comm)
    assert x == pytest.approx(1e-4 / 3e-7, rel=1e-9)  # exact for power laws
    assert overlap.measured_crossing(sizes, comm, [10 * c for c in comm]) is None
    with pytest.raises(ValueError, match="same length"):
        overlap.measured_crossing(sizes, compute, comm[:-1])


def test_link_fit_recovers_alpha_and_beta_and_refuses_mixed_rows():
    rows = [Row("all_reduce", 2, s, 5e-5 + s / 2e9, 0, 0) for s in (1 << 10, 1 << 16, 1 << 22)]
    link = overlap.Link.fit(rows)
    assert link.alpha == pytest.approx(5e-5) and link.beta == pytest.approx(2e9)
    assert link.seconds(1 << 20) == pytest.approx(5e-5 + (1 << 20) / 2e9)
    with pytest.raises(ValueError, match="one op at one world size"):
        overlap.Link.fit(rows + [Row("all_reduce", 4, 1024, 1e-4, 0, 0)])


def test_matmul_flops_is_a_positive_rate_and_timed_takes_the_median():
    assert overlap.matmul_flops(64, 64, 64, repeats=3) > 0
    calls = []
    assert overlap.median_seconds(lambda: calls.append(1), repeats=4, warmup=2) >= 0
    assert len(calls) == 6


def test_figure_has_measured_model_and_crossing_lines():
    sizes = [1, 10, 100]
    fig = overlap.figure(sizes, [1e-3, 1e-2, 1e-1], [1e-2, 1e-2, 1e-2], title="t",
                         size_label="tokens", model={"compute": [1e-3] * 3, "comm": [1e-2] * 3},
                         crossings={"measured": 10.0, "formula": 12.0})
    assert [t.name for t in fig.data] == ["compute, measured", "communication, measured",
                                          "compute, formula", "communication, formula"]
    assert len(fig.layout.shapes) == 2 and math.isclose(fig.layout.shapes[1].x0, 12.0)
    assert torch.tensor(fig.data[0].y).tolist() == pytest.approx([1, 10, 100])


def test_a_causal_zigzag_step_computes_half_a_block_for_the_whole_blocks_bytes():
    # Zig-zag: rank r holds chunks r and 2N-1-r of 2N; a visiting block from rank j != r
    # is seen by c·c/2 of the (query, key) pairs whichever side of r it comes from.
    n, c = 4, 8
    half = c // 2
    positions = lambda r: [*range(r * half, (r + 1) * half),              # noqa: E731
                           *range((2 * n - 1 - r) * half, (2 * n - r) * half)]
    for r in range(n):
        for j in range(n):
            pairs = sum(k <= q for q in positions(r) for k in positions(j))
            if j != r:
                assert pairs == c * c // 2
    e, h = 2, 4096
    c_star = overlap.cp_min_block(H100, act_bytes=e, causal_zigzag=True)
    flops = 4 * c_star**2 * h / 2                  # half of QKᵀ and PV over the block
    assert flops / H100.flops == pytest.approx(2 * c_star * h * e / H100.intra_bw)
