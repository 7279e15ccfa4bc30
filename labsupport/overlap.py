"""Time beside bytes: when does a step's communication hide behind its compute?

    hw = overlap.HARDWARE["H100"]                 # cited peak numbers
    overlap.group_bandwidth(hw, n=64)             # 64 ranks on 8 whole nodes: 450e9
    overlap.group_bandwidth(hw, n=8, per_node=1)  # 8 ranks, one per node: 50e9
    overlap.dp_min_tokens(hw, n=8)                # ~1,925 tokens per GPU (2,200 as n grows)
    link = overlap.Link.fit(rows)                 # this machine: α, β from a sweep
    flops = overlap.matmul_flops(256, 256, 256)   # this machine: FLOP/s, measured
    x = overlap.crossing(compute_s, comm_s, lo, hi)       # where two models meet
    x = overlap.measured_crossing(sizes, compute, comm)   # where two measured curves meet
    overlap.figure(sizes, compute, comm, ...)     # the chapters' time-beside-bytes plot

Every technique sets two times side by side: compute, FLOPs / FLOP/s, and
communication, the α-β model of chapter 2, α + bytes / β. Communication
can hide behind compute (overlap) only where it is the shorter of the two,
so the interesting number is the size at which they are equal: the
*crossing*. The conditions below are those of the Ultra-Scale Playbook's
appendix A3 ("Math for compute/communication overlap", Tazi et al. 2025,
huggingface.co/spaces/nanotron/ultrascale-playbook) and of "How to Scale
Your Model", chapter "How to Think About GPUs" (Austin et al. 2025,
jax-ml.github.io/scaling-book/gpus), written with the element size ``e``
(bytes) explicit and with the ring's (n-1)/n kept, which both sources drop
for large n. Each returns the crossing size: communication-bound below it
(above it, for the TP degree), compute-bound beyond.

**The network model, once for the book** (``group_bandwidth``). A
collective's time is the bytes each member sends over the bandwidth W at
which it can send them, and W depends on where the group's members sit.
How to Scale Your Model, GPUs chapter, sections "Beyond the node level" and
"Cross-node collectives" (an 8-GPU H100 node: 450 GB/s of NVLink out of
each GPU, and 8 InfiniBand NICs of 400 Gb/s, 400 GB/s out of the node):

- *Ring collectives* (all-reduce, all-gather, reduce-scatter) of a group of
  n members, g of them in each of M = n/g nodes: reduced inside each node
  over NVLink, then across the nodes over the NICs the group's members sit
  behind, min(g, NICs per node) of them, the two levels pipelined. An
  all-gather or reduce-scatter of a buffer of S bytes takes
  S · max((g-1)/(g·W_gpu), (M-1)/(M·W_node)), W_node = min(g, NICs) × one
  NIC's bandwidth shared by the g members (the chapter's "more precise
  derivation", bytes · max_i (D_i-1)/(D_i·W_i) over the levels of the
  tree; its takeaway: "beyond the node level, the cost of an AllGather or
  ReduceScatter on B bytes is roughly B / W_node egress"; an all-reduce is
  twice that). A data-parallel or FSDP group that holds all 8 GPUs of
  several nodes drives all 8 NICs at once; a group with one member per node
  (data parallelism when tensor parallelism fills the node) gets one NIC
  per member.
- *All-to-all and point-to-point* (expert dispatch, a pipeline send, a ring
  attention hop) are not hierarchical: each member's bytes to another node
  leave through its own NIC, one NIC per member ("AllToAlls ... effectively
  ha[ve] 50GB/s rather than 400GB/s of bandwidth"). An all-to-all of n
  members, g in each of M = n/g nodes, sends (M-1)/M of a member's rows to
  other nodes through its NIC and (g-1)/n to the other members of its node
  over NVLink, the two links at once: S · max((M-1)/M / W_NIC,
  (g-1)/n / W_gpu) for S bytes of rows (at ep = 16 on 2 nodes half the rows
  cross, not 15/16 of them).
- *Ring collectives across nodes* take the hierarchical ideal above: the
  bytes cross the NICs once per level. NCCL's flat ring over all n ranks
  sends (n-1)/n of the buffer through each NIC instead of (M-1)/M, ×1.21
  more at 2 nodes of 8 (15/16 against 1/2, NVLink then no longer binding:
  1/2 / 400 GB/s against 7/8 / 450 GB/s) and ×1.13 at 8 nodes
  ((63/64)/(7/8)); chapter 2's 3-node ring measured 85–96 GB/s against the
  model's 144.

``group_bandwidth`` returns W per member such that time = (bytes one member
sends in a ring, (n-1)/n·S per pass) / W, so the crossings and the planner
keep their per-rank byte counts. Not modelled: in-network reduction (SHARP),
latency, and the bandwidth real kernels reach (the chapter measures about
370 of NVLink's 450 GB/s on large all-reduces); the group is assumed alone
on its NICs.
"""
import dataclasses
import math
import statistics
import time


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Peak numbers of one accelerator and its node: dense bf16 FLOP/s, bytes/s."""
    name: str
    flops: float        # dense bf16 matmul FLOP/s
    intra_bw: float     # one GPU's egress inside its node (NVLink), bytes/s
    inter_bw: float     # one NIC's egress between nodes (InfiniBand), bytes/s
    gpus_per_node: int
    source: str
    nics_per_node: int = 0      # 0: one NIC per GPU, as in a DGX H100 or B200

    @property
    def nics(self) -> int:
        return self.nics_per_node or self.gpus_per_node


_SCALING_BOOK = "How to Scale Your Model, 'How to Think About GPUs' (Austin et al. 2025)"
HARDWARE = {
    # 990e12 bf16 FLOP/s; 18 NVLink 4 links x 25 GB/s = 450 GB/s per GPU; 8 NICs of
    # 400 Gb/s (50 GB/s), 400 GB/s out of an 8-GPU node (the chapter's tables).
    "H100": Hardware("H100 SXM", 990e12, 450e9, 400e9 / 8, 8, _SCALING_BOOK),
    # 2250e12 bf16 FLOP/s; NVLink 5, 18 x 50 GB/s = 900 GB/s; 8 x 50 GB/s per node.
    "B200": Hardware("B200", 2250e12, 900e9, 400e9 / 8, 8, _SCALING_BOOK),
}


def bandwidth(hw: Hardware, inside_node: bool = True) -> float:
    """One member's own link: NVLink inside a node, its NIC across nodes (the
    rule for all-to-all and point-to-point; ``group_bandwidth``)."""
    return hw.intra_bw if inside_node else hw.inter_bw


PATTERNS = ("ring", "all_to_all", "p2p")


def group_bandwidth(hw: Hardware, n, per_node=None, pattern="ring") -> float:
    """Bytes/s at which each of a group's ``n`` members sends its share of a
    collective, ``per_node`` of them in each node (default: as many as fit,
    the group packed onto whole nodes); the module docstring gives the model
    and its source. For ``pattern="ring"``, time = (n-1)/n·S / W for a buffer
    of S bytes (an all-reduce twice that); for ``"all_to_all"`` and ``"p2p"``,
    time = the bytes a member sends / W."""
    if pattern not in PATTERNS:
        raise ValueError(f"pattern={pattern!r}: use one of {PATTERNS}")
    per_node = min(n, hw.gpus_per_node) if per_node is None else per_node
    if not 1 <= per_node <= min(n, hw.gpus_per_node):
        raise ValueError(f"per_node={per_node}: between 1 and min(n={n}, "
                         f"{hw.gpus_per_node} GPUs per node)")
    if n % per_node:
        raise ValueError(f"n={n} ranks do not fill nodes of per_node={per_node}")
    if per_node == n or pattern == "p2p":
        return bandwidth(hw, inside_node=per_node == n)
    if pattern == "all_to_all":
        return ring(n) * _all_to_all_bytes_per_second(hw, n, per_node)
    return ring(n) * _ring_bytes_per_second(hw, n, per_node)


def _all_to_all_bytes_per_second(hw, n, per_node) -> float:
    """1 / (seconds per byte of a member's rows) of an all-to-all of n members,
    per_node to a node: (M-1)/M of the rows leave through the member's NIC,
    (per_node-1)/n go over NVLink to its node's other members, both at once."""
    nodes = n / per_node
    across = ring(nodes) / hw.inter_bw
    inside = (per_node - 1) / n / hw.intra_bw
    return 1 / max(across, inside)


def _ring_bytes_per_second(hw, n, per_node) -> float:
    """1 / (seconds per byte of buffer) of a hierarchical ring collective of
    n members, per_node to a node (real n allowed: ``tp_max_degree``)."""
    nodes, node_egress = n / per_node, min(per_node, hw.nics) * hw.inter_bw
    if nodes <= 1:
        return hw.intra_bw / ring(n)
    inside = ring(per_node) / hw.intra_bw if per_node > 1 else 0.0
    return 1 / max(inside, ring(nodes) / node_egress)


def ring(n: int) -> float:
    """(n-1)/n: the share of a buffer each rank sends in a ring reduce-scatter or all-gather."""
    if n < 1:
        raise ValueError(f"n={n}: a group has at least one rank")
    return (n - 1) / n


# -- the crossing sizes, one per technique (formulas: see each docstring) ---------

def dp_min_tokens(hw, n, grad_bytes=2, per_node=None) -> float:
    """Tokens per GPU above which the backward (4·T·Ψ FLOPs) outlasts the gradients'
    all-reduce (2·(n-1)/n·Ψ·g bytes from each rank at ``group_bandwidth`` W):
    T* = (n-1)/n · g/2 · C/W (Playbook A3; How to Scale Your Model's T > C/W:
    about 2,200 inside an H100 node, 2,475 across whole nodes). ``per_node``:
    the group's members in each node (default: packed onto whole nodes)."""
    w = group_bandwidth(hw, n, per_node)
    return ring(n) * grad_bytes / 2 * hw.flops / w


def zero3_min_tokens(hw, n, param_bytes=2, per_node=None) -> float:
    """Tokens per GPU above which a unit's forward (2·T·P FLOPs) outlasts the
    all-gather of its P parameters ((n-1)/n·P·e bytes from each rank at
    ``group_bandwidth`` W), so prefetching the next unit's gather hides it:
    T* = (n-1)/n · e/2 · C/W (Playbook A3, ZeRO-3)."""
    w = group_bandwidth(hw, n, per_node)
    return ring(n) * param_bytes / 2 * hw.flops / w


def tp_max_degree(hw, ffn, act_bytes=2, inside_node=True) -> float:
    """The TP degree t below which an MLP's matmuls (4·T·h·F/t FLOPs) outlast its
    all-gather and reduce-scatter (2·(t-1)/t·T·h·e bytes): t* = 1 + 2·F·W/(e·C)
    with W = NVLink (How to Scale Your Model: t < F·W/C, "about F/2200" in an
    H100 node). ``inside_node=False``: the t ranks packed onto whole nodes at
    ``group_bandwidth``, where W depends on t and t* solves the same equality,
    4·T·h·F/(t·C) = 2·(t-1)/t·T·h·e/W(t): about 8 + F/2,475 when the NICs bind
    (the chapter's "F > 2475·(Y - 8)")."""
    if inside_node:
        return 1 + 2 * ffn * hw.intra_bw / (act_bytes * hw.flops)
    node = hw.gpus_per_node
    seconds_per_byte = lambda t: 1 / _ring_bytes_per_second(  # noqa: E731
        hw, t, min(t, node))
    return crossing(lambda t: 2 * ffn / (t * hw.flops),
                    lambda t: act_bytes * seconds_per_byte(t), 1 + 1e-9, 1e6)


def cp_min_block(hw, act_bytes=2, inside_node=True, causal_zigzag=False) -> float:
    """Tokens per ring-attention block above which one step's attention (4·c²·h
    FLOPs for QKᵀ and PV) outlasts passing K and V on (2·c·h·e bytes):
    c* = e/2 · C/W (Liu et al. 2023, Ring Attention, arXiv 2310.01889, §3).
    ``causal_zigzag``: a causal mask in the zig-zag layout, where every step but
    the diagonal one computes half a block (2·c²·h) for the same bytes: c* = e·C/W."""
    half = 2 if causal_zigzag else 1
    return half * act_bytes / 2 * hw.flops / bandwidth(hw, inside_node)


def pp_min_hidden(hw, layers_per_stage, act_bytes=2, inside_node=True,
                  layer_weights=12) -> float:
    """Hidden size above which a stage's forward (2·k·T·h²·L FLOPs for k·h² weights
    a layer: k = 12 in a transformer layer, 1 in a Linear(h, h)) outlasts sending
    its output (T·h·e bytes): h* = e·C/(2·k·L·W), e·C/(24·L·W) for transformer
    layers (Playbook A3)."""
    return act_bytes * hw.flops / (2 * layer_weights * layers_per_stage
                                   * bandwidth(hw, inside_node))


def ep_min_ffn(hw, n, act_bytes=2, inside_node=True, backward=False) -> float:
    """Expert hidden size above which the experts' forward matmuls (4·T·k·h·F
    FLOPs on a rank's share of T·k routed tokens) outlast dispatching those
    tokens and combining them back (2·(n-1)/n·T·k·h·e bytes):
    F* = (n-1)/n · e/2 · C/W, for a balanced router (chapter 9's derivation;
    How to Scale Your Model, GPUs, sizes expert parallelism by the same two
    terms). ``backward``: a training step, forward and backward: the experts
    compute 3x (12·T·k·h·F) and the backward's two all-to-alls send the same
    bytes again (4·(n-1)/n·T·k·h·e), so F* = (n-1)/n · e/3 · C/W."""
    per = 3 if backward else 2
    return ring(n) * act_bytes / per * hw.flops / bandwidth(hw, inside_node)


# -- FLOPs of the shared decoder ----------------------------------------------------

def decoder_flops(tokens, seq, layers, hidden, vocab, ffn=None, backward=True,
                  causal=False) -> float:
    """FLOPs of ``labsupport.models.GPT`` on ``tokens`` tokens of sequences of ``seq``.

    Forward: 2 FLOPs per multiply-add of every matmul, 2·(4h² + 2hF)·L per
    token in the layers plus 2·h·V in the LM head, and attention's QKᵀ and PV,
    2·2·s·h per token per layer (the full s×s scores: what SDPA computes on
    the CPU; causal kernels skip about half). A training step is forward plus
    backward, 3x the forward (Kaplan et al. 2020, arXiv 2001.08361, §2.1;
    Narayanan et al. 2021, arXiv 2104.04473, appendix). Per token and step:
    6N + 12·L·h·s, N the matmul weights (the blocks' and the head's): the
    count of PaLM (arXiv 2204.02311, appendix B), nanoGPT's ``estimate_mfu``
    and torchtitan's ``quadratic_attention_flops_per_token``
    (``torchtitan/models/utils.py``), which charge the full s×s scores. With
    ``causal``, 6N + 6·L·h·s: only the scores at or below the diagonal, which
    a causal kernel computes, as FlashAttention's benchmarks count
    (``benchmarks/benchmark_flash_attention.py``: ``// (2 if causal else
    1)``), Megatron-LM's ``num_floating_point_operations`` does (its
    ``transformer_flops``: "causal mask (only half of the mask is non-zero)")
    and NVIDIA's Megatron-Bridge does with ``causal_tflops``.
    """
    ffn = ffn or 4 * hidden
    scores = seq / 2 if causal else seq
    per_token = 2 * layers * (4 * hidden**2 + 2 * hidden * ffn + 2 * scores * hidden)
    per_token += 2 * hidden * vocab
    return (3 if backward else 1) * tokens * per_token


# -- this machine: measured FLOP/s and link ---------------------------------------

def median_seconds(fn, repeats=5, warmup=1) -> float:
    """Median seconds of ``fn()``; on a GPU the queued work is waited for."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_flops(m, k, n, dtype=None, device="cpu", repeats=5) -> float:
    """FLOP/s of an (m, k) @ (k, n) matmul here, 2·m·k·n FLOPs per product."""
    import torch

    a = torch.randn(m, k, dtype=dtype or torch.float32, device=device)
    b = torch.randn(k, n, dtype=dtype or torch.float32, device=device)
    return 2 * m * k * n / median_seconds(lambda: a @ b, repeats)


@dataclasses.dataclass(frozen=True)
class Link:
    """t(S) = α + S/β for one collective at one world size (Hockney's α-β model)."""
    alpha: float    # seconds
    beta: float     # bytes/s of the buffer S (algbw at large S), not busbw

    @classmethod
    def fit(cls, rows):
        """From ``sweep.run`` rows of one op (``sweep.fit_alpha_beta``)."""
        from labsupport.sweep import fit_alpha_beta

        if len({(r.label, r.world_size) for r in rows}) != 1:
            raise ValueError("fit one op at one world size at a time (filter the rows)")
        return cls(*fit_alpha_beta([r.nbytes for r in rows], [r.seconds for r in rows]))

    def seconds(self, nbytes):
        return self.alpha + nbytes / self.beta


# -- crossings ----------------------------------------------------------------------

def crossing(first, second, lo, hi, steps=80):
    """The size x in [lo, hi] where first(x) = second(x), by bisection on log x;
    None if their difference has the same sign at both ends."""
    if not 0 < lo < hi:
        raise ValueError(f"need 0 < lo < hi, got lo={lo}, hi={hi}")
    diff = lambda x: first(x) - second(x)  # noqa: E731
    if diff(lo) == 0:
        return lo
    if (diff(lo) > 0) == (diff(hi) > 0):
        return None
    a, b = math.log(lo), math.log(hi)
    for _ in range(steps):
        mid = (a + b) / 2
        if (diff(math.exp(mid)) > 0) == (diff(lo) > 0):
            a = mid
        else:
            b = mid
    return math.exp((a + b) / 2)


def measured_crossing(sizes, first, second):
    """Where two measured curves first cross, interpolated linearly in log-log
    between the two sizes around the sign change; None if they never cross."""
    if not len(sizes) == len(first) == len(second) >= 2:
        raise ValueError("need sizes and two curves of the same length, at least 2")
    points = sorted(zip(sizes, first, second))
    for (x0, a0, b0), (x1, a1, b1) in zip(points, points[1:]):
        d0, d1 = math.log(a0 / b0), math.log(a1 / b1)
        if d0 == 0:
            return x0
        if (d0 > 0) != (d1 > 0):
            w = d0 / (d0 - d1)
            return math.exp(math.log(x0) + w * (math.log(x1) - math.log(x0)))
    return None


# -- the chapters' plot --------------------------------------------------------------

def figure(sizes, compute, comm, *, title, size_label, model=None, crossings=None):
    """Measured compute and communication times against size (log-log), with the
    model's lines (``model``: {"compute": [...], "comm": [...]} at ``sizes``) and
    vertical lines at the crossings ({"measured": x, "formula": x})."""
    import plotly.graph_objects as go

    from labsupport.plots import PALETTE

    fig = go.Figure()
    for name, ys, colour in (("compute", compute, 0), ("communication", comm, 1)):
        fig.add_scatter(x=list(sizes), y=[y * 1e3 for y in ys], mode="markers+lines",
                        name=f"{name}, measured", marker_color=PALETTE[colour])
    for key, colour in (("compute", 0), ("comm", 1)):
        if model and key in model:
            fig.add_scatter(x=list(sizes), y=[y * 1e3 for y in model[key]], mode="lines",
                            name=f"{'compute' if key == 'compute' else 'communication'}, "
                                 "formula", line=dict(color=PALETTE[colour], dash="dot"))
    for (label, x), dash in zip((crossings or {}).items(), ("solid", "dash")):
        if x is not None:
            fig.add_vline(x=x, line=dict(color=PALETTE[7], dash=dash, width=1),
                          annotation_text=f"{label}: {x:.3g}",
                          annotation_position="top left" if dash == "solid" else "bottom right")
    fig.update_layout(title=title, xaxis=dict(type="log", title=size_label),
                      yaxis=dict(type="log", title="time (ms)"), height=420)
    return fig
