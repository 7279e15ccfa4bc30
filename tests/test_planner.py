# Run: .venv/bin/python -m pytest tests/test_planner.py
"""labsupport.device_mesh.planner: layouts, memory from chapter 0's calculator, bytes, placement in
Megatron Core's order, step time with the overlap conditions, MFU, experts; the
pipeline's stages, the embedding on the first and the LM head on the last, the
slowest stage setting the step (1F1B's length, against chapter 5's schedule)
and the fullest the memory.

(The context-parallel bytes against ring attention's own sends: tests/test_mesh.py.)
"""

import pytest

from labsupport import overlap
from labsupport.device_mesh import planner
from labsupport.device_mesh.planner import Job, Layout
from labsupport.memory import calc as memory_calc
from labsupport.memory import tally

M = memory_calc.PRESETS["7B"]
JOB = Job(M, seq=4096, global_batch=512)
H100 = overlap.HARDWARE["H100"]
MIXTRAL, MIXTRAL_EXPERTS = planner.MOE_PRESETS["Mixtral 8x7B"]


def test_layouts_multiply_to_the_device_count():
    rows = planner.layouts(8)
    assert all(dp * tp * pp * cp == 8 and ep == 1 for dp, tp, pp, cp, ep in rows)
    assert len(rows) == len(set(rows)) == 20   # 8 = 2^3 into 4 ordered factors: C(6, 3)
    moe = planner.layouts(8, MIXTRAL_EXPERTS)
    assert all((dp * cp) % ep == 0 and 8 % ep == 0 for dp, tp, pp, cp, ep in moe)
    assert Layout(8, 1, 1, 1, 8) in moe and Layout(1, 8, 1, 1, 2) not in moe


def test_memory_is_the_calculators_for_a_single_dimension():
    # the calculator counts the layers' activations; the planner's one stage
    # also holds the head's and the embedding's (all split over tp under SP)
    head = memory_calc.head_activation_bytes(4096, 1, M.hidden, M.vocab)
    want = memory_calc.training_memory(M, 4096, 1, "mixed", "selective", n=8,
                                       parallelism="tp+sp")
    for key in ("activations", "total"):
        want[key] += head / 8
    assert planner.device_memory(JOB, Layout(1, 8, 1)) == pytest.approx(want)
    plain = Job(M, 4096, 512, checkpointing="none")
    want = memory_calc.training_memory(M, 4096, 1, "mixed", "none")
    for key in ("activations", "total"):
        want[key] += head
    assert planner.device_memory(plain, Layout(64, 1, 1)) == pytest.approx(want)


def test_memory_is_plain_data_parallel_unless_a_zero_stage_is_named():
    layout = Layout(dp=8, tp=1, pp=1, cp=2)
    plain = planner.device_memory(JOB, layout)
    zero1 = planner.device_memory(Job(M, 4096, 512, zero=1), layout)
    assert plain["optimizer"] == pytest.approx(12 * M.psi)
    assert zero1["optimizer"] == pytest.approx(12 * M.psi / 16)   # over dp x cp
    assert zero1["params"] == plain["params"] and zero1["grads"] == plain["grads"]
    with pytest.raises(ValueError, match="ZeRO-3"):
        Job(M, 4096, 512, zero=3)


def test_traffic_zero_on_size_one_dimensions_and_the_dp_all_reduce():
    sent = planner.traffic(JOB, Layout(64, 1, 1))
    assert sent["tp"] == sent["pp"] == sent["cp"] == sent["ep"] == 0
    assert sent["dp"] == pytest.approx(2 * 63 / 64 * 2 * M.psi)


def test_gradients_are_reduced_over_the_dp_and_cp_ranks():
    sent = planner.traffic(JOB, Layout(dp=4, tp=1, pp=1, cp=2))
    assert sent["dp"] == pytest.approx(2 * overlap.ring(8) * 2 * M.psi)


def test_context_parallel_bytes_are_six_cp_minus_one_plus_two_chunks():
    for cp in (2, 4, 8):
        sent = planner.traffic(JOB, Layout(dp=64 // cp, tp=1, pp=1, cp=cp))
        chunk = 1 * 4096 // cp * M.hidden * 2            # K (or V) of the local chunk
        micro_batches = 512 // (64 // cp)
        assert sent["cp"] == pytest.approx(micro_batches * M.layers * (6 * (cp - 1) + 2) * chunk)


def test_placement_follows_megatrons_order_tp_cp_ep_dp_pp():
    assert planner.ORDER == ("tp", "cp", "ep", "dp", "pp")
    inside = planner.placement(Layout(dp=2, tp=4, pp=4, cp=2), gpus_per_node=8)
    assert inside == dict(tp=True, cp=True, ep=True, dp=False, pp=False)
    inside = planner.placement(Layout(dp=8, tp=1, pp=2, cp=1, ep=8), gpus_per_node=8)
    assert inside["ep"] and inside["dp"] and not inside["pp"]
    assert not planner.placement(Layout(1, 16, 1), 8)["tp"]


def test_members_per_node_follow_the_rank_order():
    # tp fills the node: every other group has one member per node
    g = planner.members_per_node(Layout(dp=16, tp=8, pp=8), 8)
    assert g == dict(tp=8, cp=1, ep=1, dp=1, edp=1, pp=1)
    # pure data parallelism: 8 dp ranks in each node
    assert planner.members_per_node(Layout(64, 1, 1), 8)["dp"] == 8
    # tp = 2, cp = 2 inside; the dp x cp group strides by 2: 4 of its members a node
    g = planner.members_per_node(Layout(dp=4, tp=2, pp=4, cp=2), 8)
    assert (g["tp"], g["cp"], g["dp"], g["pp"]) == (2, 2, 4, 1)
    # experts: ep after tp, their replicas after ep (Megatron's expert order)
    g = planner.members_per_node(Layout(dp=128, tp=1, pp=16, cp=1, ep=64), 8)
    assert (g["ep"], g["dp"], g["edp"]) == (8, 8, 1)


def test_each_dimension_runs_at_its_groups_bandwidth():
    # (16, 1, 2, 2): the dp x cp group of 32 sits 8 to a node on 4 nodes: all 8 NICs
    layout = Layout(dp=16, tp=1, pp=2, cp=2)
    r = planner.step_time(JOB, layout, H100)
    sent = planner.traffic(JOB, layout)
    w = overlap.group_bandwidth(H100, 32, per_node=8)
    assert w == pytest.approx(31 / 32 / (7 / 8 / 450e9))      # NVLink's level binds
    assert r["comm_s"]["dp"] == pytest.approx(sent["dp"] / w)
    assert r["comm_s"]["dp"] < sent["dp"] / H100.inter_bw / 8  # not 50 GB/s per GPU
    # a pipeline send and ring attention's hop: one NIC (pp) or NVLink (cp)
    assert r["comm_s"]["pp"] == pytest.approx(sent["pp"] / H100.inter_bw)
    assert r["comm_s"]["cp"] == pytest.approx(sent["cp"] / H100.intra_bw)
    # DeepSeek-V3's layout: dense gradients over 128 ranks on whole nodes, the
    # experts' over 2 replicas 64 ranks apart (one NIC each), all-to-all one NIC
    model, experts = planner.MOE_PRESETS["DeepSeek-V3"]
    job = Job(model, 4096, 15360, experts=experts, zero=1, checkpointing="full")
    ds = Layout(dp=128, tp=1, pp=16, cp=1, ep=64)
    dense, routed = planner._dp_bytes(job, ds)
    assert dense + routed == pytest.approx(planner.traffic(job, ds)["dp"])
    got = planner.step_time(job, ds, H100)["comm_s"]
    assert got["dp"] == pytest.approx(dense / overlap.group_bandwidth(H100, 128)
                                      + routed / H100.inter_bw)
    # 64 ranks on 8 nodes: 7/8 of the rows leave through the NIC
    assert got["ep"] == pytest.approx(planner.traffic(job, ds)["ep"] / overlap.ring(64)
                                      * 7 / 8 / H100.inter_bw)


def test_an_all_to_all_over_two_nodes_charges_the_nic_only_for_the_other_node():
    # ep = 16 on 2 nodes of 8: of a rank's rows, 15/16 go to other ranks (the
    # bytes traffic counts), 1/2 to the other node (its NIC, 50 GB/s), 7/16 to
    # its own node's other 7 ranks (NVLink, at the same time)
    model, experts = planner.MOE_PRESETS["DeepSeek-V3"]
    job = Job(model, 4096, 512, experts=experts, zero=1, checkpointing="full")
    layout = Layout(dp=16, tp=1, pp=16, cp=1, ep=16)
    assert planner.members_per_node(layout, 8)["ep"] == 8
    assert not planner.placement(layout, 8)["ep"]
    sent = planner.traffic(job, layout)["ep"]                  # 15/16 of the rows
    rows = sent / overlap.ring(16)
    got = planner.step_time(job, layout, H100, overlapped=())["comm_s"]["ep"]
    assert got == pytest.approx(max(rows / 2 / H100.inter_bw,
                                    rows * 7 / 16 / H100.intra_bw))
    assert got == pytest.approx(rows / 2 / H100.inter_bw)      # the NIC binds
    assert sent / H100.inter_bw / got == pytest.approx(1.875)  # every row at the NIC
    # inside one node (ep = 8) all on NVLink
    inside = Layout(dp=16, tp=1, pp=16, cp=1, ep=8)
    assert planner.bandwidths(inside, H100)["ep"] == H100.intra_bw


def test_the_7b_ranking_on_64_h100s():
    # With dp's all-reduce on whole nodes' NICs it hides behind the last
    # micro-batch's backward, so the shallower pipelines (smaller bubble) lead;
    # charged 50 GB/s per GPU, (4, 1, 8, 2) led and pp = 2 came nowhere near.
    rows = planner.plan(JOB, 64, H100, 80e9)
    order = [r["layout"] for r in rows]
    assert order[0] == Layout(dp=16, tp=1, pp=2, cp=2)
    assert order.index(Layout(dp=16, tp=1, pp=2, cp=2)) < order.index(
        Layout(dp=4, tp=1, pp=8, cp=2))
    first = rows[0]
    assert first["exposed_s"]["dp"] == 0 and first["per_node"]["dp"] == 8
    # the same layout charged one NIC per GPU: the reduction would show
    last_backward = first["compute_s"] * 2 / 3 / planner.micro_batches(JOB, order[0])
    assert first["traffic"]["dp"] / H100.inter_bw > last_backward
    # one layer a stage, the last one also the head: the deepest pipelines,
    # 2nd to 5th when stages were even, fall behind every pp <= 4 layout
    deep = [i for i, r in enumerate(rows) if r["layout"].pp >= 16]
    shallow = [i for i, r in enumerate(rows) if r["layout"].pp <= 4]
    assert min(deep) > max(shallow[:10])
    assert all(rows[i]["slowest"] == rows[i]["layout"].pp - 1 for i in deep)


def test_every_planned_layout_fits_and_the_fastest_step_comes_first():
    rows = planner.plan(JOB, 64, H100, 80e9)
    assert rows and all(r["memory"]["total"] <= 80e9 for r in rows)
    assert [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    assert {r["inside"]["tp"] for r in rows} == {True, False}
    assert planner.plan(JOB, 64, H100, 1e6) == []
    with pytest.raises(ValueError, match="must be > 0"):
        planner.plan(JOB, 0, H100, 80e9)


def test_the_attention_flops_are_decoder_flops_and_the_rest_six_psi_t():
    tokens = 512 * 4096
    attention = (overlap.decoder_flops(tokens, 4096, M.layers, M.hidden, M.vocab)
                 - overlap.decoder_flops(tokens, 0, M.layers, M.hidden, M.vocab))
    # Llama 2's embedding is a lookup, its own matrix beside the head's:
    # 6 FLOPs per token for every other parameter (torchtitan's count)
    embedding = M.vocab * M.hidden
    assert not M.tied
    assert planner.step_flops(JOB) == pytest.approx(6 * (M.psi - embedding) * tokens
                                                    + attention)
    # tied (GPT-3): Ψ counts the matrix once, and the head's matmul uses it
    gpt3 = memory_calc.PRESETS["GPT-3 175B"]
    job = Job(gpt3, 2048, 1536)
    attention = 12 * gpt3.layers * 2048 * gpt3.hidden
    assert planner.step_flops(job) == pytest.approx(
        1536 * 2048 * (6 * gpt3.psi + attention))


def test_step_time_is_compute_bubble_and_the_communication_not_hidden():
    layout = Layout(dp=4, tp=8, pp=2)
    r = planner.step_time(JOB, layout, H100)
    m = 512 // 4
    # 16 layers a stage; the last stage also runs the head's 6·V·h per token
    layer = 6 * (M.psi - 2 * M.vocab * M.hidden) / M.layers + 12 * 4096 * M.hidden
    first, last = (4096 * f / (8 * H100.flops)
                   for f in (16 * layer, 16 * layer + 6 * M.vocab * M.hidden))
    assert r["stage_s"] == pytest.approx([first, last]) and r["slowest"] == 1
    assert r["compute_s"] == pytest.approx(m * last)
    assert r["bubble_s"] == pytest.approx(first)
    sent = planner.traffic(JOB, layout)
    assert r["comm_s"]["tp"] == pytest.approx(sent["tp"] / H100.intra_bw)
    assert r["comm_s"]["dp"] == pytest.approx(sent["dp"] / H100.inter_bw)
    assert r["exposed_s"]["tp"] == r["comm_s"]["tp"]              # on the critical path
    last_backward = r["compute_s"] * 2 / 3 / m
    assert r["exposed_s"]["dp"] == pytest.approx(max(0, r["comm_s"]["dp"] - last_backward))
    assert r["step_s"] == pytest.approx(r["compute_s"] + r["bubble_s"]
                                        + sum(r["exposed_s"].values()))
    assert r["mfu"] == pytest.approx(planner.step_flops(JOB) / (64 * H100.flops * r["step_s"]))
    bare = planner.step_time(JOB, layout, H100, overlapped=())
    assert bare["exposed_s"] == bare["comm_s"] and bare["step_s"] > r["step_s"]
    with pytest.raises(ValueError, match="the dimensions are"):
        planner.step_time(JOB, layout, H100, overlapped=("zero",))


def test_latency_per_call_by_group_size():
    layout = Layout(dp=4, tp=2, pp=1)
    calls = planner.calls(JOB, layout, dp_buckets=10)
    assert calls["dp"] == 10 and calls["tp"] == 128 * (8 * M.layers + 2)
    r0 = planner.step_time(JOB, layout, H100, overlapped=())
    r1 = planner.step_time(JOB, layout, H100, overlapped=(), dp_buckets=10,
                           alpha=lambda n: 1e-3 * n)
    assert r1["comm_s"]["dp"] - r0["comm_s"]["dp"] == pytest.approx(10 * 4e-3)
    assert r1["comm_s"]["tp"] - r0["comm_s"]["tp"] == pytest.approx(calls["tp"] * 2e-3)


def test_experts_split_over_ep_and_the_e_over_k_penalty():
    job = Job(MIXTRAL, 4096, 1024, experts=MIXTRAL_EXPERTS, zero=1)
    dense_share = MIXTRAL.psi - MIXTRAL_EXPERTS.params
    replicated = planner.traffic(job, Layout(dp=32, tp=1, pp=8, ep=1))
    split = planner.traffic(job, Layout(dp=32, tp=1, pp=8, ep=8))
    # the last of 8 stages (the slowest): 4 layers and the head, bf16 gradients
    head = MIXTRAL.vocab * MIXTRAL.hidden
    dense_last = (dense_share - 2 * head) / 8 + head
    assert replicated["dp"] == pytest.approx(
        2 * 2 * overlap.ring(32) * (dense_last + MIXTRAL_EXPERTS.params / 8))
    assert split["dp"] == pytest.approx(2 * 2 * (
        overlap.ring(32) * dense_last
        + overlap.ring(4) * MIXTRAL_EXPERTS.params / 8 / 8))
    tokens = 4096 * 2                                    # T k rows per rank, 4 all-to-alls
    assert split["ep"] == pytest.approx(32 * 4 * 4 * overlap.ring(8) * tokens * 4096 * 2)
    # a token's FLOPs grow k-fold, the weights E-fold: the active parameters
    # (less the embedding's lookup)
    active = MIXTRAL.psi - MIXTRAL_EXPERTS.params * (1 - 2 / 8) - head
    assert planner.step_flops(job) == pytest.approx(
        1024 * 4096 * (6 * active + 12 * 32 * 4096 * 4096))
    # the fullest stage is the first: the embedding and 8 micro-batches in flight
    states = planner.stage_memory(job, Layout(dp=32, tp=1, pp=8, ep=8))
    assert planner.device_memory(job, Layout(dp=32, tp=1, pp=8, ep=8)) == states[0]
    want = [tally.model_state_bytes(dense_last, "mixed", 1, 32)["optimizer"],
            tally.model_state_bytes(MIXTRAL_EXPERTS.params / 64, "mixed", 1, 4)["optimizer"]]
    assert states[0]["optimizer"] == states[-1]["optimizer"] == pytest.approx(sum(want))


def test_deepseek_v3s_layout_and_its_all_to_all():
    # arXiv 2412.19437: 2048 H800s, PP 16, EP 64 over 8 nodes, ZeRO-1, no TP
    model, experts = planner.MOE_PRESETS["DeepSeek-V3"]
    assert experts.params == pytest.approx(654e9, rel=1e-3)    # chapter 9's count
    layout = Layout(dp=128, tp=1, pp=16, cp=1, ep=64)
    h800 = overlap.Hardware("H800", H100.flops, 160e9, 50e9, 8, "DeepSeek-V3, 3.2.2")
    full = Job(model, 4096, 15360, experts=experts, zero=1, checkpointing="full")
    assert planner.problem(full, layout) is None
    assert planner.device_memory(full, layout)["total"] < 80e9
    assert not planner.placement(layout, 8)["ep"]                # 64 ranks span 8 nodes
    # a stage of 4 layers and no head (the first): its all-to-all, compute
    r, first = planner.step_time(full, layout, h800), planner.stages(full, layout)[0]
    a2a = (planner.traffic(full, layout, first)["ep"]
           / planner.bandwidths(layout, h800)["ep"])
    compute = planner.micro_batches(full, layout) * r["stage_s"][0]
    assert 1.5 < a2a / compute < 3                              # 8 copies; 4 give ~1:1
    assert layout in [row["layout"] for row in planner.plan(full, 2048, h800, 80e9)]


def test_uneven_stages_and_the_head_the_slowest_sets_the_pace():
    # DeepSeek-V3's 61 layers on 16 stages: 13 of 4 layers, then 3 of 3; the
    # last one's head (6·V·h, V = 129,280) outweighs the fourth layer
    model, experts = planner.MOE_PRESETS["DeepSeek-V3"]
    job = Job(model, 4096, 15360, experts=experts)
    layout = Layout(8, 1, 16, 1, 1)
    assert [s.layers for s in planner.stages(job, layout)] == [4] * 13 + [3] * 3
    per_layer = planner.step_time(job, Layout(128, 1, 1, 1, 1), H100)
    head = 6 * model.vocab * model.hidden
    layer = (planner.step_flops(job) / (15360 * 4096) - head) / 61
    assert head > layer
    r = planner.step_time(job, layout, H100)
    assert r["slowest"] == 15
    n_mb, tokens = 15360 // 8, 4096
    seconds = tokens / H100.flops
    assert r["compute_s"] == pytest.approx(n_mb * (3 * layer + head) * seconds)
    assert r["bubble_s"] == pytest.approx((13 * 4 + 2 * 3) * layer * seconds)
    assert per_layer["slowest"] == 0


def test_bad_jobs_are_refused_with_the_reason():
    with pytest.raises(ValueError, match=">= 1"):
        Job(M, 0, 512)
    with pytest.raises(ValueError, match="precision"):
        Job(M, 4096, 512, precision="fp8")
    with pytest.raises(ValueError, match="top_k"):
        planner.Experts(8, 9, 1e9, 1024, 4)
    assert "does not divide" in planner.problem(JOB, Layout(1, 3, 1))
    assert "sequences do not split" in planner.problem(JOB, Layout(1024, 1, 1))


def test_the_embedding_goes_to_the_first_stage_and_the_head_to_the_last():
    # Megatron: embedding on the first stage, final LayerNorm and output layer
    # on the last; a tied head there is a copy of the embedding
    for model in (M, memory_calc.PRESETS["GPT-3 175B"]):
        job = Job(model, 4096, 512)
        vocab = model.vocab * model.hidden
        layer = (model.psi - vocab * (1 if model.tied else 2)) / model.layers
        for pp in (1, 2, 8):
            rows = planner.stages(job, Layout(64 // pp, 1, pp))
            params = [planner._stage_params(job, s)[0] for s in rows]
            copy = vocab if model.tied and pp > 1 else 0
            assert sum(params) == pytest.approx(model.psi + copy)
            if pp > 1:
                ends = model.layers / pp * layer + vocab
                assert params[0] == params[-1] == pytest.approx(ends)
                assert all(p == pytest.approx(model.layers / pp * layer)
                           for p in params[1:-1])
            # the stages' FLOPs add up to the model's, the head's on the last
            flops = [planner._stage_flops(job, s)[0] for s in rows]
            assert sum(flops) * 512 * 4096 == pytest.approx(planner.step_flops(job))
            assert flops[-1] - flops[0] == pytest.approx(6 * vocab if pp > 1 else 0)


def test_the_head_makes_the_last_stage_the_bottleneck():
    # 32 stages of one layer: the last also multiplies by the 32000 x 4096
    # head, 6·V·h = 0.79 GFLOP a token beside a layer's 1.4: it sets the pace
    layout = Layout(dp=2, tp=1, pp=32, cp=1)
    r = planner.step_time(JOB, layout, H100)
    t = r["stage_s"]
    assert r["slowest"] == 31 and t[-1] / t[0] > 1.5
    m = planner.micro_batches(JOB, layout)
    assert r["compute_s"] == pytest.approx(m * t[-1])
    # stages even (the old planner: every stage 1/32 of the FLOPs) the step
    # would be a third shorter
    even = planner.step_flops(JOB) / (64 * H100.flops) * (1 + 31 / m)
    assert r["compute_s"] + r["bubble_s"] > 1.4 * even
    # the ends' gradients and parameters: the dp reduction of the last stage
    # carries the head's V·h beside its layer
    head = M.vocab * M.hidden
    layer = (M.psi - 2 * head) / M.layers
    assert r["comm_s"]["dp"] * H100.inter_bw == pytest.approx(
        2 * 2 * overlap.ring(2) * (layer + head) * H100.inter_bw
        / overlap.group_bandwidth(H100, 2, planner.members_per_node(layout, 8)["dp"]))


def test_the_step_is_1f1bs_on_stages_of_unequal_time():
    # chapter 5's ideal 1F1B, each stage's backward twice its forward: with
    # the last stage slowest, m·t_last + the other stages' t once is its
    # length exactly; with an inner stage slowest the formula is an upper bound
    from labsupport.pipeline import sim
    from labsupport.pipeline.pipeline import train_step_1f1b
    cases = (([1, 1, 1, 1.56], 8), ([1.4, 1, 1, 1.56], 16), ([1, 1.2, 1, 1.1], 6))
    for times, m in cases:
        p = len(times)
        durations = {(kind, s, i): times[s] * share for s in range(p) for i in range(m)
                     for kind, share in (("F", 1 / 3), ("B", 2 / 3))}
        events = sim.ideal_events(train_step_1f1b, p, m, durations=durations)
        length = max(e["end"] for e in events)
        k = max(range(p), key=lambda i: times[i])
        formula = m * times[k] + sum(times) - times[k]
        if k == p - 1:
            assert length == pytest.approx(formula)
        else:
            assert length <= formula


def test_the_logits_and_the_head_can_leave_only_the_last_stage_out_of_memory():
    # A 256k vocabulary on a 3B model (2B in its 16 layers): the last stage
    # holds the head's 0.5B parameters (16 B each with Adam) and the fp32
    # log-probabilities of a micro-batch, 4·s·V = 8.4 GB
    model = memory_calc.Model(3_000_000_000, 16, 2048, 16, 256_000, tied=False)
    job = Job(model, 8192, 64, checkpointing="full")
    layout = Layout(dp=8, tp=1, pp=8)
    rows = planner.stage_memory(job, layout)
    head = model.vocab * model.hidden
    # full recomputation: each of its 2 layers keeps its input, e·sbh; then the
    # final LayerNorm's and head's inputs and the log-probabilities
    sbh = 8192 * 2048
    assert rows[-1]["activations"] == pytest.approx(2 * 2 * sbh + 2 * 2 * sbh
                                                    + 4 * 8192 * model.vocab)
    assert rows[-1]["params"] - rows[-2]["params"] == pytest.approx(2 * head)
    fullest = planner.device_memory(job, layout)
    assert fullest == rows[-1]
    # spread evenly (the old planner's Ψ/pp a stage) it would fit in 16 GB,
    # and so does the first stage (embedding, 8 micro-batches); the last does not
    even = (tally.model_state_bytes(model.psi / 8, "mixed")["total"]
            + rows[1]["activations"])
    assert even < rows[0]["total"] < 16e9 < fullest["total"]
    assert layout not in [r["layout"] for r in planner.plan(job, 64, H100, 16e9)]


def test_a_memory_budget_removes_the_layouts_that_do_not_fit_before_ranking():
    budget = 40e9                                # half an H100's 80 GB
    kept = planner.plan(JOB, 64, H100, budget)
    removed = planner.over_budget(JOB, 64, budget)
    runnable = [lay for lay in planner.layouts(64) if not planner.problem(JOB, lay)]
    assert removed and kept                      # the budget decides something
    assert {r["layout"] for r in kept} | {lay for lay, _ in removed} == set(runnable)
    assert not {r["layout"] for r in kept} & {lay for lay, _ in removed}
    for lay, memory in removed:                  # each over the budget by the formula
        assert memory == planner.device_memory(JOB, lay) and memory["total"] > budget
    assert [m["total"] for _, m in removed] == sorted((m["total"] for _, m in removed),
                                                      reverse=True)
    # plain dp holds all 7B's states on every device: 16 bytes x 7e9 = 112 GB
    assert removed[0][0] == Layout(64, 1, 1, 1)
    assert removed[0][1]["params"] + removed[0][1]["grads"] + removed[0][1]["optimizer"] \
        == pytest.approx(16 * M.psi)
    assert planner.over_budget(JOB, 64, 1e15) == []       # everything fits a huge device
    with pytest.raises(ValueError, match="device_bytes"):
        planner.over_budget(JOB, 64, 0)
