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
g members (How to Scale Your Model, GPUs chapter); an all-to-all (ep) and a
point-to-point send (cp's ring attention, pp) one NIC per member.

**Memory** per device, on the fullest stage (ceil(L/pp) layers): chapter 0's
states (``memory.model_state_bytes``) of its dense parameters over tp and its
experts over tp·ep, plain data parallelism unless ``Job.zero`` names a ZeRO
stage (over the dp·cp ranks, the experts' over dp·cp/ep); Korthikanti et
al.'s activations (arXiv 2205.05198, ``memory_calc``), TP (+SP) over tp, / cp,
of min(pp, m) micro-batches (1F1B's first stage), an MoE layer's MLP terms
scaled to k experts of width f.

**Bytes** one device sends per step, ring algorithms (chapter 2: an
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

**Step time** = compute + pipeline bubble + exposed communication. Compute:
6·Ψ_active + 12·L·s·h FLOPs per token (PaLM, arXiv 2204.02311, appendix B;
the attention term is ``overlap.decoder_flops``') at the device's peak, the
fullest stage's share; bubble (pp-1)/m of it (1F1B, chapter 5). Each
dimension's time is bytes / bandwidth + calls · ``alpha``. A dimension in
``overlapped`` hides behind the compute its condition in
``labsupport.overlap`` names (dp: the last micro-batch's backward, where
gradient accumulation lets the reduction start; cp: attention; tp: the
layers' matmuls; pp: the other micro-batches; ep: the experts); what it
cannot hide is exposed. MFU = step FLOPs / (devices · peak · step time).
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
MOE_PRESETS = {
    "Mixtral 8x7B": (memory_calc.Model(46_700_000_000, 32, 4096, 32, 32000),
                     Experts(8, 2, 32 * 8 * 3 * 4096 * 14336, 14336, 32)),
    "DeepSeek-V3": (memory_calc.Model(671_000_000_000, 61, 7168, 128, 129280),
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


def _stage(job, layout):
    """(layers on the fullest stage, its share of the model's layers)."""
    layers = math.ceil(job.model.layers / layout.pp)
    return layers, layers / job.model.layers


def device_memory(job, layout) -> dict:
    """Bytes per device on the fullest stage: params, grads, optimizer, activations, total."""
    dp, tp, pp, cp, ep = layout
    share, psi_e = _stage(job, layout)[1], job.experts.params if job.experts else 0
    dense = model_state_bytes((job.model.psi - psi_e) * share / tp, job.precision,
                              job.zero, dp * cp)
    experts = model_state_bytes(psi_e * share / (tp * ep), job.precision, job.zero,
                                dp * cp // ep)
    out = {k: dense[k] + experts[k] for k in ("params", "grads", "optimizer")}
    out["activations"] = activation_bytes(job, layout)
    out["total"] = sum(out.values())
    return out


def activation_bytes(job, layout) -> float:
    """Korthikanti's activations (TP, TP+SP over tp; / cp) of min(pp, m) micro-batches
    of the fullest stage; an MoE layer's MLP terms for k experts of width f."""
    dp, tp, pp, cp, ep = layout
    m, e = job.model, PRECISIONS[job.precision][0]
    sp = job.sequence_parallel and tp > 1
    layer = memory_calc.activation_bytes_per_layer(
        job.seq, job.micro, m.hidden, m.heads, e, recompute=job.checkpointing, t=tp, sp=sp)
    layers, share = _stage(job, layout)
    total = layers * layer
    ex = job.experts
    if ex and job.checkpointing != "full":
        # k copies of the MLP input instead of 1; GELU's and fc2's inputs k·f wide, not 4h
        extra = (ex.top_k - 1) / (tp if sp else 1) + 8 * (ex.top_k * ex.ffn / (4 * m.hidden)
                                                          - 1) / tp
        total += ex.layers * share * e * job.seq * job.micro * m.hidden * extra
    return min(pp, micro_batches(job, layout)) * total / cp


def traffic(job, layout) -> dict:
    """Bytes one device sends per step on each dimension (module docstring)."""
    dp, tp, pp, cp, ep = layout
    m, ex, e = job.model, job.experts, PRECISIONS[job.precision][0]
    n_mb, (layers, share) = micro_batches(job, layout), _stage(job, layout)
    act = job.micro * job.seq / cp * m.hidden * e            # one (b, s/cp, h) tensor
    k = ex.top_k if ex else 0
    moe_layers = ex.layers * share if ex else 0
    routed = job.micro * job.seq / (cp * tp) * k * m.hidden * e  # this rank's T·k rows
    ends = 2 if pp == 1 else 1                                # embedding, head
    return {"tp": n_mb * (4 * layers + ends) * 2 * ring(tp) * act,
            "cp": n_mb * layers * (6 * (cp - 1) + 2) * act / tp if cp > 1 else 0.0,
            "ep": n_mb * moe_layers * 4 * ring(ep) * routed,
            "dp": sum(_dp_bytes(job, layout)),
            "pp": n_mb * 2 * act / tp if pp > 1 else 0.0}


def _dp_bytes(job, layout):
    """(dense, experts): the gradient all-reduce's bytes per device, the dense
    weights' over the dp·cp ranks, the experts' over their dp·cp/ep replicas."""
    dp, tp, pp, cp, ep = layout
    g, share = PRECISIONS[job.precision][1], _stage(job, layout)[1]
    psi_e = job.experts.params if job.experts else 0
    return (2 * g * share / tp * ring(dp * cp) * (job.model.psi - psi_e),
            2 * g * share / tp * ring(dp * cp // ep) * psi_e / ep)


def calls(job, layout, dp_buckets=1) -> dict:
    """Collective (or send/receive) calls per step on each dimension, each paying α."""
    dp, tp, pp, cp, ep = layout
    n_mb, (layers, share) = micro_batches(job, layout), _stage(job, layout)
    per_layer = 8 if job.sequence_parallel else 4             # AG + RS, or all-reduces
    moe_layers = job.experts.layers * share if job.experts else 0
    return {"tp": n_mb * (per_layer * layers + (2 if pp == 1 else 1)) * (tp > 1),
            "cp": n_mb * layers * (2 * cp - 1) * (cp > 1),
            "ep": n_mb * moe_layers * 4 * (ep > 1),
            "dp": dp_buckets * (dp * cp > 1),
            "pp": n_mb * 2 * (pp > 1)}


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
    """FLOPs of a training step: (6·Ψ_active + 12·L·s·h) per token (PaLM, appendix B)."""
    return job.global_batch * job.seq * _per_token(job)[0]


def _per_token(job):
    """(FLOPs per token, attention's share, the routed experts' share)."""
    m, ex = job.model, job.experts
    active = m.psi - (ex.params * (1 - ex.top_k / ex.count) if ex else 0)
    attention = 12 * m.layers * job.seq * m.hidden
    experts = 6 * ex.params * ex.top_k / ex.count if ex else 0
    total = 6 * active + attention
    return total, attention / total, experts / total


def step_time(job, layout, hw, overlapped=OVERLAPPED, alpha=0.0, dp_buckets=1) -> dict:
    """Seconds of one step on ``hw`` (an ``overlap.Hardware``): compute_s, bubble_s,
    comm_s and exposed_s (by dimension), step_s, and mfu (module docstring)."""
    if set(overlapped) - set(ORDER):
        raise ValueError(f"overlapped={overlapped}: the dimensions are {ORDER}")
    devices, flops = layout.dp * layout.tp * layout.pp * layout.cp, step_flops(job)
    compute = flops / (devices * hw.flops) * _stage(job, layout)[1] * layout.pp
    n_mb = micro_batches(job, layout)
    sent, n_calls = traffic(job, layout), calls(job, layout, dp_buckets)
    latency = alpha if callable(alpha) else (lambda n: alpha)
    w = bandwidths(layout, hw)
    dense, experts = _dp_bytes(job, layout)
    seconds = {d: sent[d] / w[d] for d in ORDER if d != "dp"}
    seconds["dp"] = dense / w["dp"] + experts / w["edp"]
    comm = {d: seconds[d] + n_calls[d] * latency(size)
            for d, size in group_sizes(layout).items()}
    _, attention, experts = _per_token(job)
    behind = {"dp": compute * 2 / 3 / n_mb, "cp": compute * attention,
              "tp": compute * (1 - attention), "pp": compute, "ep": compute * experts}
    exposed = {d: max(0.0, comm[d] - behind[d]) if d in overlapped else comm[d]
               for d in comm}
    step = compute * (1 + (layout.pp - 1) / n_mb) + sum(exposed.values())
    return dict(compute_s=compute, bubble_s=compute * (layout.pp - 1) / n_mb, comm_s=comm,
                exposed_s=exposed, step_s=step, mfu=flops / (devices * hw.flops * step))


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
