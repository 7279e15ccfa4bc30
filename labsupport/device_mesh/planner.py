"""Chapter 8's layout planner: which (dp, tp, pp, cp, ep) layout, for this model on this cluster.

    job = planner.Job(memory_calc.PRESETS["7B"], seq=4096, global_batch=512)
    rows = planner.plan(job, devices=64, hw=overlap.HARDWARE["H100"], device_bytes=80e9)
    rows[0]["layout"], rows[0]["step_s"], rows[0]["mfu"]     # the fastest layout that fits

**Layouts** count as Megatron Core does (megatron/core/parallel_state.py,
``initialize_model_parallel``): dp·tp·pp·cp = devices. Expert parallelism
adds no ranks: it splits each MoE layer's experts over ep of the dp × cp
ranks (ep divides dp·cp), which replicate everything else; each expert is
then replicated on dp·cp/ep ranks (Megatron's expert data parallelism,
world / (etp·ep·pp), with the experts' tensor parallelism etp = tp, its
default). **Rank order**: tp fastest, then cp, ep, dp, and pp slowest,
Megatron Core's default ``order="tp-cp-ep-dp-pp"``: tensor parallelism on
neighbouring ranks (one node), pipeline stages farthest apart; the experts'
replicas (expert data parallelism) vary after tp and ep, as in Megatron's
expert decomposition. **Placement** then gives each dimension's members per
node (``members_per_node``), and its bandwidth is ``overlap.group_bandwidth``'s,
the book's one network model: a ring collective (tp, dp) across nodes gets
the NICs of the members each node holds, min(g, NICs) of them shared by its
g members (How to Scale Your Model, GPUs chapter); an all-to-all (ep) sends
the rows bound for other nodes, (M-1)/M of them with M nodes in the group,
through one NIC per member and the rest over NVLink, the two links at once;
a point-to-point send (cp's ring attention, pp) one NIC per member.

**Stages**: L layers split over pp as evenly as they go (the first L mod pp
stages one more); the embedding on the first stage, the final LayerNorm and
LM head on the last, as Megatron Core builds them (``GPTModel``'s
``pre_process`` and ``post_process``; a head tied to the embedding is a copy
of it on the last stage, ``LanguageModule.setup_embeddings_and_output_layer``,
its gradient all-reduced by the two stages, counted under pp). The ends
unbalance the pipeline: the head's matmul is 2·V·h FLOPs per token forward,
6·V·h with its backward (the logit layer's term of Narayanan et al. 2021,
arXiv 2104.04473, eq. 3), and its log-probabilities are b·s·V; Llama 3 takes
one layer off the first and last stages for this (arXiv 2407.21783, §3.3.2),
Megatron-LM has ``--account-for-embedding-in-pipeline-split`` and
``--account-for-loss-in-pipeline-split``; this planner does not rebalance.

**Memory** per device, on the fullest stage: chapter 0's states
(``memory.model_state_bytes``) of the stage's dense parameters (its layers'
share of Ψ less the vocabulary matrices, plus its embedding or head) over tp
and its experts over tp·ep, plain data parallelism unless ``Job.zero`` names
a ZeRO stage (over the dp·cp ranks, the experts' over dp·cp/ep); Korthikanti
et al.'s activations (arXiv 2205.05198, ``memory_calc``), TP (+SP) over tp,
/ cp, of the stage's in-flight micro-batches (1F1B: min(pp - i, m) on stage
i), an MoE layer's MLP terms scaled to k experts of width f; on the first
stage the embedding's dropout mask, on the last the final LayerNorm's and
head's inputs and the fp32 log-probabilities of one micro-batch
(``memory_calc.head_activation_bytes``' terms, the loss vocabulary-parallel).

**Bytes** one device of the slowest stage sends per step, ring algorithms (chapter 2: an
all-reduce of S sends 2(n-1)/n·S). TP(+SP): per layer the bytes of 4
all-reduces of b·s·h (Korthikanti §4.2.2; Megatron's memory-optimal SP
gathers again in backward, ~25% more, not counted), plus the embedding's and
the head's. CP, ring attention as chapter 6 measured it: K and V passed
cp-1 times forward, K, V, dK, dV cp-1 times backward, and dK, dV sent home:
6(cp-1)+2 chunks of b·(s/cp)·(h/tp) per layer. DP: one all-reduce of the
dense gradients over the dp × cp ranks (context parallelism replicates the
weights: picotron's ``cp_dp_group``, Megatron's dp-cp group), of the
experts' over their dp·cp/ep replicas (ZeRO-1/2 move the same bytes). PP:
each micro-batch's activation out, its gradient back. EP: 4 all-to-alls per
MoE layer (dispatch, combine; forward, backward) of the rank's routed rows.

**Step time** = compute + pipeline bubble + exposed communication. FLOPs:
6 per token for each parameter a matmul uses and 12·s·h of attention per
layer (PaLM, arXiv 2204.02311, appendix B: 6N + 12·L·s·h; the attention term
is ``overlap.decoder_flops``'), the head's 6·V·h on the last stage, none for
the embedding, a lookup (torchtitan counts 6·(N - embedding): torchtitan/
models/utils.py, ``get_dense_model_nparams_and_flops``; for a tied head N
counts the matrix once, which the head uses). Each stage takes t_i per
micro-batch at the device's peak; with the slowest stage k, compute is
m·t_k and the bubble the other stages' t_j once each (filling and draining
the pipeline): 1F1B's length exactly when the last stage is the slowest (the
head's case), an upper bound otherwise (tests/test_planner.py against
chapter 5's ideal schedule), and (pp-1)/m of compute for equal stages
(Narayanan et al. 2021, §2.2). Each dimension's time, the slowest stage's,
is bytes / bandwidth + calls · ``alpha``. A dimension in ``overlapped``
hides behind the compute its condition in ``labsupport.overlap`` names (dp:
the last micro-batch's backward, where gradient accumulation lets the
reduction start; cp: attention; tp: the layers' matmuls; pp: the other
micro-batches; ep: the experts); what it cannot hide is exposed. MFU = step
FLOPs / (devices · peak · step time).
"""
import dataclasses
import math
from typing import NamedTuple

from labsupport.memory import calc as memory_calc
from labsupport.memory.tally import PRECISIONS, model_state_bytes
from labsupport.overlap import group_bandwidth, ring

ORDER = ("tp", "cp", "ep", "dp", "pp")      # Megatron Core's default, fastest-varying first
# How each dimension communicates (overlap.PATTERNS): tp's all-gathers and
# reduce-scatters and dp's all-reduce are rings; ep all-to-all; cp and pp send
# to one neighbour.
PATTERN = {"tp": "ring", "cp": "p2p", "ep": "all_to_all", "dp": "ring", "pp": "p2p"}
# Hidden where their conditions allow: DDP's buckets (chapter 3), 1F1B's other
# micro-batches (chapter 5), the ring's next block (chapter 6). TP and EP wait on
# their collectives unless asked (chapter 4's f and g; chapter 9's all-to-alls).
OVERLAPPED = ("dp", "pp", "cp")


class Layout(NamedTuple):
    """Degrees of the five dimensions; dp·tp·pp·cp ranks, ep among the dp·cp."""
    dp: int
    tp: int
    pp: int
    cp: int = 1
    ep: int = 1


@dataclasses.dataclass(frozen=True)
class Experts:
    """The routed experts of a mixture-of-experts model (chapter 9)."""
    count: int          # E experts per MoE layer
    top_k: int          # k of them per token
    params: float       # Ψ_E: every routed expert's parameters, all layers
    ffn: int            # f: an expert's hidden width
    layers: int         # MoE layers

    def __post_init__(self):
        if not 1 <= self.top_k <= self.count or self.params < 0 or self.layers < 1:
            raise ValueError(f"{self}: need 1 <= top_k <= count, params, layers >= 1")


@dataclasses.dataclass(frozen=True)
class Job:
    """What to train: ``global_batch`` sequences of ``seq`` tokens per step."""
    model: memory_calc.Model
    seq: int
    global_batch: int
    micro: int = 1                   # sequences per micro-batch
    precision: str = "mixed"
    checkpointing: str = "selective"
    experts: Experts | None = None
    zero: int = 0                    # 0: plain data parallelism; 1, 2: ZeRO's stages
    sequence_parallel: bool = True   # with tp > 1

    def __post_init__(self):
        if min(self.seq, self.global_batch, self.micro) < 1:
            raise ValueError("seq, global_batch and micro must be >= 1")
        if self.zero not in (0, 1, 2):
            raise ValueError(f"zero={self.zero}: use 0 (plain data parallel), 1 or 2 "
                             "(ZeRO-3 also gathers weights, chapter 7: not modelled)")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}: use one of {sorted(PRECISIONS)}")
        if self.experts and self.experts.layers > self.model.layers:
            raise ValueError("the model has fewer layers than MoE layers")


# Chapter 9's two models. Mixtral 8x7B: Jiang et al. 2024 (arXiv 2401.04088),
# Table 1, 46.7B parameters (Mistral AI). DeepSeek-V3: DeepSeek-AI 2024 (arXiv
# 2412.19437) §4.2 and its config.json: 61 layers (58 MoE), 671B parameters.
# Neither ties its head to its embedding (their config.json files:
# "tie_word_embeddings": false).
MOE_PRESETS = {
    "Mixtral 8x7B": (memory_calc.Model(46_700_000_000, 32, 4096, 32, 32000, tied=False),
                     Experts(8, 2, 32 * 8 * 3 * 4096 * 14336, 14336, 32)),
    "DeepSeek-V3": (memory_calc.Model(671_000_000_000, 61, 7168, 128, 129280,
                                      tied=False),
                    Experts(256, 8, 58 * 256 * 3 * 7168 * 2048, 2048, 58)),
}


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(devices, experts=None) -> list:
    """Every Layout with dp·tp·pp·cp = devices (and ep dividing dp·cp and E)."""
    out = []
    for tp in _divisors(devices):
        for pp in _divisors(devices // tp):
            for cp in _divisors(devices // (tp * pp)):
                dp = devices // (tp * pp * cp)
                eps = [e for e in _divisors(dp * cp) if experts.count % e == 0] \
                    if experts else [1]
                out += [Layout(dp, tp, pp, cp, ep) for ep in eps]
    return out


def problem(job, layout) -> str | None:
    """Why ``layout`` cannot run ``job``, or None."""
    m, (dp, tp, pp, cp, ep) = job.model, layout
    if m.heads % tp or m.hidden % tp:
        return f"tp={tp} does not divide {m.heads} heads and hidden {m.hidden}"
    if pp > m.layers or job.seq % cp:
        return f"pp={pp} > {m.layers} layers or cp={cp} does not divide seq={job.seq}"
    if job.global_batch % (dp * job.micro):
        return f"{job.global_batch} sequences do not split into dp={dp} x micro={job.micro}"
    if (dp * cp) % ep:
        return f"ep={ep} does not divide dp x cp = {dp * cp}"
    return None


def micro_batches(job, layout) -> int:
    """m: micro-batches each pipeline runs per step."""
    return job.global_batch // (layout.dp * job.micro)


class Stage(NamedTuple):
    """One pipeline stage: its layers, whether it holds the embedding (first)
    or the final LayerNorm and LM head (last), and how many micro-batches'
    activations it keeps at once (1F1B: min(pp - index, m), chapter 5)."""
    index: int
    layers: int
    first: bool
    last: bool
    in_flight: int


def stages(job, layout) -> list:
    """The pipeline's stages: L layers split as evenly as they go, the first
    L mod pp stages one more (``torch.tensor_split``'s rule); the embedding on
    the first stage, the head on the last (Megatron, module docstring)."""
    n_mb, pp, L = micro_batches(job, layout), layout.pp, job.model.layers
    return [Stage(i, L // pp + (i < L % pp), i == 0, i == pp - 1, min(pp - i, n_mb))
            for i in range(pp)]


def _vocab_params(model) -> float:
    """Ψ's V x h matrices: the embedding, and the head's own unless tied."""
    return model.vocab * model.hidden * (1 if model.tied else 2)


def _layer_params(job) -> float:
    """A layer's dense parameters: Ψ less the experts and the vocabulary
    matrices, over L (none when Ψ is smaller than those)."""
    m, psi_e = job.model, job.experts.params if job.experts else 0
    return max(0.0, m.psi - psi_e - _vocab_params(m)) / m.layers


def _stage_params(job, stage) -> tuple:
    """(dense, experts) parameters of a stage: its layers' share, plus the
    embedding (first) and the head (last; tied, with pp > 1 a copy of the
    embedding, Megatron's)."""
    m, psi_e = job.model, job.experts.params if job.experts else 0
    ends = stage.first + (stage.last and not (stage.first and m.tied))
    return (stage.layers * _layer_params(job) + ends * m.vocab * m.hidden,
            psi_e * stage.layers / m.layers)


def _stage_flops(job, stage) -> tuple:
    """(FLOPs per token, attention's share, the routed experts' share) of a stage:
    6 per token for each weight a matmul uses, 12·s·h of attention per layer,
    the head's 6·V·h; the embedding, a lookup, none (module docstring)."""
    m, ex = job.model, job.experts
    routed = _stage_params(job, stage)[1]
    experts = 6 * routed * ex.top_k / ex.count if ex else 0
    attention = 12 * stage.layers * job.seq * m.hidden
    head = 6 * m.vocab * m.hidden * stage.last
    total = 6 * stage.layers * _layer_params(job) + experts + attention + head
    return total, attention / total, experts / total


def device_memory(job, layout) -> dict:
    """Bytes per device on the fullest stage: params, grads, optimizer, activations, total."""
    return max(stage_memory(job, layout), key=lambda r: r["total"])


def stage_memory(job, layout) -> list:
    """Each stage's bytes per device, as ``device_memory`` (module docstring)."""
    dp, tp, pp, cp, ep = layout
    rows = []
    for stage in stages(job, layout):
        dense_psi, experts_psi = _stage_params(job, stage)
        dense = model_state_bytes(dense_psi / tp, job.precision, job.zero, dp * cp)
        experts = model_state_bytes(experts_psi / (tp * ep), job.precision, job.zero,
                                    dp * cp // ep)
        out = {k: dense[k] + experts[k] for k in ("params", "grads", "optimizer")}
        out["activations"] = _activations(job, layout, stage)
        out["total"] = sum(out.values())
        rows.append(out)
    return rows


def activation_bytes(job, layout) -> float:
    """The fullest stage's activations (``_activations``)."""
    return device_memory(job, layout)["activations"]


def _activations(job, layout, stage) -> float:
    """Korthikanti's activations (TP, TP+SP over tp; / cp) of the stage's layers,
    its in-flight micro-batches of them; an MoE layer's MLP terms for k experts
    of width f. The ends (``memory_calc.head_activation_bytes``' terms): the
    embedding's dropout mask m·sbh on the first stage, per micro-batch in
    flight; on the last, the final LayerNorm's and head's inputs 2e·sbh and the
    fp32 log-probabilities 4·sbV (the vocabulary-parallel loss: / tp)."""
    dp, tp, pp, cp, ep = layout
    m, e = job.model, PRECISIONS[job.precision][0]
    sp = job.sequence_parallel and tp > 1
    layer = memory_calc.activation_bytes_per_layer(
        job.seq, job.micro, m.hidden, m.heads, e, recompute=job.checkpointing, t=tp, sp=sp)
    total = stage.layers * layer
    ex, sbh = job.experts, job.seq * job.micro * m.hidden
    if ex and job.checkpointing != "full":
        # k copies of the MLP input instead of 1; GELU's and fc2's inputs k·f wide, not 4h
        extra = (ex.top_k - 1) / (tp if sp else 1) + 8 * (ex.top_k * ex.ffn / (4 * m.hidden)
                                                          - 1) / tp
        total += ex.layers * stage.layers / m.layers * e * sbh * extra
    total += stage.first * 1 * sbh / (tp if sp else 1)       # embedding dropout mask
    head = 2 * e * sbh / (tp if sp else 1) + 4 * job.seq * job.micro * m.vocab / tp
    # the last stage runs each micro-batch's backward right after its forward
    return (stage.in_flight * total + stage.last * head) / cp


def slowest(job, layout) -> Stage:
    """The stage with the most FLOPs per token, which sets the pipeline's pace."""
    return max(stages(job, layout), key=lambda s: _stage_flops(job, s)[0])


def traffic(job, layout, stage=None) -> dict:
    """Bytes one device of ``stage`` (the slowest, by default) sends per step on
    each dimension (module docstring)."""
    dp, tp, pp, cp, ep = layout
    m, ex, e = job.model, job.experts, PRECISIONS[job.precision][0]
    stage = stage or slowest(job, layout)
    n_mb, layers = micro_batches(job, layout), stage.layers
    act = job.micro * job.seq / cp * m.hidden * e            # one (b, s/cp, h) tensor
    k = ex.top_k if ex else 0
    moe_layers = ex.layers * layers / m.layers if ex else 0
    routed = job.micro * job.seq / (cp * tp) * k * m.hidden * e  # this rank's T·k rows
    ends = stage.first + stage.last                           # embedding, head
    return {"tp": n_mb * (4 * layers + ends) * 2 * ring(tp) * act,
            "cp": n_mb * layers * (6 * (cp - 1) + 2) * act / tp if cp > 1 else 0.0,
            "ep": n_mb * moe_layers * 4 * ring(ep) * routed,
            "dp": sum(_dp_bytes(job, layout, stage)),
            "pp": (n_mb * 2 * act / tp + _tied_bytes(job, layout, stage)
                   if pp > 1 else 0.0)}


def _tied_bytes(job, layout, stage):
    """A tied embedding's gradient, all-reduced by the first and last stages
    (Megatron's embedding group, finalize_model_grads.py), per device."""
    tied = job.model.tied and layout.pp > 1 and (stage.first or stage.last)
    g = PRECISIONS[job.precision][1]
    if not tied:
        return 0.0
    return 2 * ring(2) * g * job.model.vocab * job.model.hidden / layout.tp


def _dp_bytes(job, layout, stage=None):
    """(dense, experts): the gradient all-reduce's bytes per device of ``stage``
    (the slowest), the dense weights' over the dp·cp ranks, the experts' over
    their dp·cp/ep replicas."""
    dp, tp, pp, cp, ep = layout
    g = PRECISIONS[job.precision][1]
    dense, experts = _stage_params(job, stage or slowest(job, layout))
    return (2 * g / tp * ring(dp * cp) * dense,
            2 * g / tp * ring(dp * cp // ep) * experts / ep)


def calls(job, layout, dp_buckets=1, stage=None) -> dict:
    """Collective (or send/receive) calls per step of a device of ``stage`` (the
    slowest) on each dimension, each paying α."""
    dp, tp, pp, cp, ep = layout
    stage = stage or slowest(job, layout)
    n_mb, layers = micro_batches(job, layout), stage.layers
    per_layer = 8 if job.sequence_parallel else 4             # AG + RS, or all-reduces
    moe_layers = job.experts.layers * layers / job.model.layers if job.experts else 0
    return {"tp": n_mb * (per_layer * layers + stage.first + stage.last) * (tp > 1),
            "cp": n_mb * layers * (2 * cp - 1) * (cp > 1),
            "ep": n_mb * moe_layers * 4 * (ep > 1),
            "dp": dp_buckets * (dp * cp > 1),
            "pp": (n_mb * 2 + (_tied_bytes(job, layout, stage) > 0)) * (pp > 1)}


def placement(layout, gpus_per_node) -> dict:
    """{dimension: True if its groups stay inside a node}, ranks in ``ORDER``."""
    dp, tp, pp, cp, ep = layout
    spans = {"tp": (tp, tp), "cp": (cp, tp * cp), "ep": (ep, tp * ep),
             "dp": (dp * cp, tp * cp * dp), "pp": (pp, tp * cp * dp * pp)}
    return {d: size == 1 or span <= gpus_per_node for d, (size, span) in spans.items()}


def _groups(layout) -> dict:
    """{name: (ranks in one group, stride between its members)} in ``ORDER``;
    "edp" is the experts' replicas (Megatron's expert data parallelism)."""
    dp, tp, pp, cp, ep = layout
    return {"tp": (tp, 1), "cp": (cp, tp), "ep": (ep, tp), "dp": (dp * cp, tp),
            "edp": (dp * cp // ep, tp * ep), "pp": (pp, tp * cp * dp)}


def members_per_node(layout, gpus_per_node) -> dict:
    """{group: members of one of its groups in each node}: ranks numbered in
    ``ORDER``, a group of n members a stride s apart holds gcd(n, node // s)
    of them in a node (min(n, node // s) when the sizes are powers of 2)."""
    return {d: math.gcd(n, max(1, gpus_per_node // stride))
            for d, (n, stride) in _groups(layout).items()}


def group_sizes(layout) -> dict:
    """Ranks in one call of each dimension (a ring attention step and a
    pipeline send each talk to one neighbour: 2)."""
    dp, tp, pp, cp, ep = layout
    return {"tp": tp, "cp": 2, "ep": ep, "dp": dp * cp, "pp": 2}


def bandwidths(layout, hw) -> dict:
    """{group: bytes/s each member sends at} (``overlap.group_bandwidth`` for
    the group's size, its members per node and its pattern)."""
    g = members_per_node(layout, hw.gpus_per_node)
    return {d: group_bandwidth(hw, n, g[d], PATTERN["dp" if d == "edp" else d])
            for d, (n, _) in _groups(layout).items()}


def step_flops(job) -> float:
    """FLOPs of a training step: (6·Ψ_active + 12·L·s·h) per token (PaLM, appendix
    B), the embedding's lookup left out of Ψ (torchtitan's count, module docstring)."""
    whole = Stage(0, job.model.layers, True, True, 1)
    return job.global_batch * job.seq * _stage_flops(job, whole)[0]


def step_time(job, layout, hw, overlapped=OVERLAPPED, alpha=0.0, dp_buckets=1) -> dict:
    """Seconds of one step on ``hw`` (an ``overlap.Hardware``): compute_s (the
    slowest stage's), bubble_s, comm_s and exposed_s (by dimension, the slowest
    stage's), step_s, mfu, and stage_s (each stage's seconds per micro-batch)
    and slowest (its index) (module docstring)."""
    if set(overlapped) - set(ORDER):
        raise ValueError(f"overlapped={overlapped}: the dimensions are {ORDER}")
    devices, flops = layout.dp * layout.tp * layout.pp * layout.cp, step_flops(job)
    n_mb, tokens = micro_batches(job, layout), job.micro * job.seq
    per_stage = [_stage_flops(job, s) for s in stages(job, layout)]
    stage_s = [tokens * f / (layout.tp * layout.cp * hw.flops) for f, _, _ in per_stage]
    k = max(range(layout.pp), key=lambda i: per_stage[i][0])
    compute, bubble = n_mb * stage_s[k], sum(stage_s) - stage_s[k]
    stage = stages(job, layout)[k]
    sent, n_calls = traffic(job, layout, stage), calls(job, layout, dp_buckets, stage)
    latency = alpha if callable(alpha) else (lambda n: alpha)
    w = bandwidths(layout, hw)
    dense, experts = _dp_bytes(job, layout, stage)
    seconds = {d: sent[d] / w[d] for d in ORDER if d != "dp"}
    seconds["dp"] = dense / w["dp"] + experts / w["edp"]
    comm = {d: seconds[d] + n_calls[d] * latency(size)
            for d, size in group_sizes(layout).items()}
    _, attention, experts = per_stage[k]
    behind = {"dp": compute * 2 / 3 / n_mb, "cp": compute * attention,
              "tp": compute * (1 - attention), "pp": compute, "ep": compute * experts}
    exposed = {d: max(0.0, comm[d] - behind[d]) if d in overlapped else comm[d]
               for d in comm}
    step = compute + bubble + sum(exposed.values())
    return dict(compute_s=compute, bubble_s=bubble, comm_s=comm, exposed_s=exposed,
                step_s=step, mfu=flops / (devices * hw.flops * step), stage_s=stage_s,
                slowest=k)


def over_budget(job, devices, device_bytes) -> list:
    """The layouts that could run ``job`` on ``devices`` but do not fit in
    ``device_bytes`` per device, the ones ``plan`` removes before ranking by
    step time: [(layout, device_memory)], the largest first."""
    if devices < 1 or device_bytes <= 0:
        raise ValueError(f"devices={devices} and device_bytes={device_bytes} must be > 0")
    rows = [(layout, device_memory(job, layout)) for layout in layouts(devices, job.experts)
            if not problem(job, layout)]
    return sorted([(lay, mem) for lay, mem in rows if mem["total"] > device_bytes],
                  key=lambda r: -r[1]["total"])


def plan(job, devices, hw, device_bytes, overlapped=OVERLAPPED, alpha=0.0,
         dp_buckets=1) -> list:
    """Every layout that runs ``job`` on ``devices`` and fits in ``device_bytes``,
    fastest step first. Each row: layout, memory, traffic (bytes by dimension),
    inside (by dimension: within a node), per_node (members per node), bandwidth
    (bytes/s per member, by group) and ``step_time``'s keys."""
    if devices < 1 or device_bytes <= 0:
        raise ValueError(f"devices={devices} and device_bytes={device_bytes} must be > 0")
    rows = []
    for layout in layouts(devices, job.experts):
        if problem(job, layout):
            continue
        memory = device_memory(job, layout)
        if memory["total"] <= device_bytes:
            rows.append(dict(layout=layout, memory=memory, traffic=traffic(job, layout),
                             inside=placement(layout, hw.gpus_per_node),
                             per_node=members_per_node(layout, hw.gpus_per_node),
                             bandwidth=bandwidths(layout, hw),
                             **step_time(job, layout, hw, overlapped, alpha, dp_buckets)))
    return sorted(rows, key=lambda r: r["step_s"])
