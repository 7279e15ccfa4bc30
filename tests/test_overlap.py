# Run: .venv/bin/python -m pytest tests/test_overlap.py
"""labsupport.overlap: the cited crossings, FLOPs of the shared decoder, the crossing finders."""
import dataclasses
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
    assert overlap.dp_min_tokens(H100, n=8) / overlap.ring(8) == pytest.approx(2200)
    assert overlap.dp_min_tokens(H100, n=8) == pytest.approx(2200 * 7 / 8)
    assert overlap.dp_min_tokens(H100, n=8, grad_bytes=4) == pytest.approx(2 * 2200 * 7 / 8)
    # Beyond a node, a group on whole nodes: "BS > 990e12 / 400e9 = 2475" (the spine).
    assert overlap.dp_min_tokens(H100, n=8 * 2**20) == pytest.approx(2475, rel=1e-5)
    # One member per node (tp fills the node): each member behind its own NIC.
    assert overlap.dp_min_tokens(H100, n=64, per_node=1) == pytest.approx(
        63 / 64 * 990e12 / 50e9)
    # TP stops paying near F·W/C (their F = 28,000: about 11-way at W = 400 GB/s).
    assert overlap.tp_max_degree(H100, 28000) == pytest.approx(1 + 28000 * 450e9 / 990e12)
    assert overlap.zero3_min_tokens(H100, 8) == overlap.dp_min_tokens(H100, 8)
    assert overlap.cp_min_block(H100) == pytest.approx(2200)
    # causal zig-zag: half a block's FLOPs for the whole block's bytes, twice the tokens
    assert overlap.cp_min_block(H100, causal_zigzag=True) == pytest.approx(4400)
    assert overlap.ep_min_ffn(H100, 8) == pytest.approx(2200 * 7 / 8)
    assert overlap.pp_min_hidden(H100, 4) == pytest.approx(2 * 990e12 / (24 * 4 * 450e9))


def test_a_group_inside_one_node_runs_on_nvlink():
    for n in (2, 4, 8):
        assert overlap.group_bandwidth(H100, n) == H100.intra_bw
        for pattern in overlap.PATTERNS:
            assert overlap.group_bandwidth(H100, n, pattern=pattern) == H100.intra_bw


def test_ring_collectives_across_nodes_use_every_nic_the_group_sits_behind():
    # 64 ranks on 8 whole nodes: the node's 8 NICs (400 GB/s) carry its (M-1)/M
    # share, NVLink the (g-1)/g inside; whichever level is slower sets the time.
    def seconds(n, g, nbytes, hw=H100):        # a ring all-gather of nbytes
        return overlap.ring(n) * nbytes / overlap.group_bandwidth(hw, n, g)

    s = 1e9
    assert seconds(64, 8, s) == pytest.approx(s * 7 / 8 / 400e9)       # NICs bind
    # 2 nodes: the NICs carry half the buffer, B/800e9, and NVLink's B·7/(8·450e9)
    # binds (How to Scale Your Model, GPUs, quiz 4, question 5)
    assert seconds(16, 8, s) == pytest.approx(s * 7 / 8 / 450e9)
    # many nodes: the ring's per-member bandwidth tends to the node's egress
    assert overlap.group_bandwidth(H100, 8 * 4096) == pytest.approx(400e9, rel=1e-3)
    # one member per node: one NIC each, whatever n
    for n in (2, 8, 64):
        assert overlap.group_bandwidth(H100, n, per_node=1) == pytest.approx(50e9)
        assert seconds(n, 1, s) == pytest.approx((n - 1) / n * s / 50e9)
    # 4 per node (tp = 2 fills the rest): 4 NICs, 200 GB/s out of the node
    assert seconds(32, 4, s) == pytest.approx(s * max(3 / 4 / 450e9, 7 / 8 / 200e9))
    # fewer NICs than members (chapter 2's A100 nodes: 8 GPUs, 4 NICs): 4 x NIC
    a100 = overlap.Hardware("A100", 312e12, 300e9, 25e9, 8, "test", nics_per_node=4)
    assert seconds(64, 8, s, a100) == pytest.approx(s * 7 / 8 / 100e9)
    assert seconds(64, 2, s, a100) == pytest.approx(
        s * max(1 / 2 / 300e9, 31 / 32 / 50e9))


def test_the_7b_all_reduce_of_chapter_3_and_its_crossing():
    # 7B bf16 gradients all-reduced over 64 H100s on 8 nodes: about 0.06 s, not
    # the 0.55 s of 50 GB/s per GPU; T* = 7/8 x 2,475, about 2,170 tokens per GPU.
    sent = 2 * overlap.ring(64) * 7e9 * 2
    assert sent / overlap.group_bandwidth(H100, 64) == pytest.approx(0.06125)
    assert sent / overlap.group_bandwidth(H100, 64, per_node=1) == pytest.approx(
        sent / 50e9)
    assert overlap.dp_min_tokens(H100, 64) == pytest.approx(7 / 8 * 990e12 / 400e9)
    assert overlap.zero3_min_tokens(H100, 8, per_node=1) == pytest.approx(17325)


def test_point_to_point_keeps_one_nic_per_member():
    for n, g in ((16, 8), (64, 8), (64, 1), (2, 1)):
        assert overlap.group_bandwidth(H100, n, g, "p2p") == H100.inter_bw


def test_an_all_to_all_sends_only_the_rows_for_other_nodes_through_the_nic():
    # a member's S bytes of rows: (M-1)/M to other nodes, one NIC each, and
    # (g-1)/n to its node's other members over NVLink, both links at once
    def seconds(n, g, nbytes, hw=H100):
        return overlap.ring(n) * nbytes / overlap.group_bandwidth(hw, n, g, "all_to_all")

    s = 1e9
    assert seconds(16, 8, s) == pytest.approx(s / 2 / 50e9)          # 2 nodes: half
    assert s * 15 / 16 / 50e9 / seconds(16, 8, s) == pytest.approx(1.875)
    assert seconds(64, 8, s) == pytest.approx(s * 7 / 8 / 50e9)      # 8 nodes
    assert s * 63 / 64 / 50e9 / seconds(64, 8, s) == pytest.approx(1.125)
    # one member a node: every off-rank row crosses, one NIC each
    for n in (2, 8, 64):
        assert overlap.group_bandwidth(H100, n, 1, "all_to_all") == H100.inter_bw
    # where NVLink is slow enough to bind, it sets the time
    slow = overlap.Hardware("slow NVLink", 1e15, 30e9, 50e9, 8, "test")
    assert seconds(16, 8, s, slow) == pytest.approx(s * 7 / 16 / 30e9)


def test_a_flat_ring_across_nodes_pays_more_than_the_hierarchical_model():
    # NCCL's flat ring sends (n-1)/n of the buffer out of each node's NICs, the
    # model (M-1)/M (overlap's docstring): x1.21 on 2 nodes of 8, x1.13 on 8
    def flat_over_model(n, hw=H100, g=8):
        flat = overlap.ring(n) / (min(g, hw.nics) * hw.inter_bw)
        return flat / (overlap.ring(n) / overlap.group_bandwidth(hw, n, g))

    assert flat_over_model(16) == pytest.approx(1.205, abs=1e-3)
    assert flat_over_model(64) == pytest.approx(1.125)
    # chapter 2's 3-node row: 24 A100s, 4 NICs of 25 GB/s a node; busbw of an
    # all-reduce = 2(n-1)/n·S / t: the model's 144 GB/s, a flat ring's 100
    a100 = overlap.Hardware("A100", 312e12, 300e9, 25e9, 8, "test", nics_per_node=4)
    model_busbw = overlap.group_bandwidth(a100, 24, 8)
    assert model_busbw == pytest.approx(143.75e9)
    assert model_busbw / flat_over_model(24, a100) == pytest.approx(100e9)


def test_group_bandwidth_refuses_placements_that_cannot_be():
    with pytest.raises(ValueError, match="per_node=16"):
        overlap.group_bandwidth(H100, 64, per_node=16)      # 8 GPUs a node
    with pytest.raises(ValueError, match="do not fill"):
        overlap.group_bandwidth(H100, 12, per_node=8)
    with pytest.raises(ValueError, match="pattern"):
        overlap.group_bandwidth(H100, 8, pattern="tree")


def test_tp_across_whole_nodes_solves_for_its_own_placement():
    # Only the NICs binding (NVLink taken as unlimited): t* = 8 + F/2475, How to
    # Scale Your Model's "F > 2475·(Y - 8)" for bf16 activations.
    fast = dataclasses.replace(H100, intra_bw=1e18)
    assert overlap.tp_max_degree(fast, 28000, inside_node=False) == pytest.approx(
        8 + 28000 * 400e9 / 990e12, rel=1e-6)
    # H100: for F = 28,672 the NVLink level of the 2-node ring binds first:
    # 2F/(t·C) = e·(7/8)/450e9, t = 2F·450e9/(e·C·7/8)
    t = overlap.tp_max_degree(H100, 28672, inside_node=False)
    assert t == pytest.approx(2 * 28672 * 450e9 / (2 * 990e12 * 7 / 8), rel=1e-6)
    assert 8 < t < 16
    # a narrow MLP is communication-bound inside the node already: the same answer
    assert overlap.tp_max_degree(H100, 4096, inside_node=False) == pytest.approx(
        overlap.tp_max_degree(H100, 4096), rel=1e-6)


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
