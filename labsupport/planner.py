"""The layout planner of chapter 8: (dp, tp, pp, cp) layouts that fit, and their traffic.

    plan(memory_calc.PRESETS["7B"], seq=4096, global_batch=512, devices=64,
         device_bytes=80e9, gpus_per_node=8, intra_bw=450e9, inter_bw=50e9)

Memory per device is chapter 0's calculator (``labsupport.memory_calc``),
composed: the states of Ψ / (tp·pp) parameters, the activations of
tensor + sequence parallelism over tp, divided by cp (as ``training_memory``
divides them for "cp"), for L layers of one micro-batch (1F1B's first stage
holds pp micro-batches of L/pp layers). Plain data parallelism: no ZeRO.

Bytes each device sends per step, ring algorithms (chapter 2): an all-reduce
of S sends 2(n-1)/n·S. TP+SP (Korthikanti et al. 2022, arXiv 2205.05198,
§4.2.2): per layer and micro-batch, 2 all-gathers and 2 reduce-scatters of
b·s·h·e each way, the bytes of 4 all-reduces. DP: one all-reduce of the
gradients per step. PP: each micro-batch's activation out and its gradient
back, b·s·h·e each. CP (ring attention, chapter 6): K and V of the local
chunk passed cp-1 times forward, K, V and their gradients backward.
Dimensions are placed innermost first, tp, cp, pp, dp (Narayanan et al. 2021,
arXiv 2104.04473, §3.3: tensor parallelism inside a node); a dimension whose
groups span more than ``gpus_per_node`` devices runs at ``inter_bw``.
"""
from labsupport import memory_calc
from labsupport.memory import PRECISIONS


def layouts(devices):
    """Every (dp, tp, pp, cp) whose product is ``devices``."""
    divs = [d for d in range(1, devices + 1) if devices % d == 0]
    return [(devices // (t * p * c), t, p, c) for t in divs for p in divs for c in divs
            if devices % (t * p * c) == 0]


def device_memory(model, seq, micro, tp, pp, cp, precision, checkpointing) -> dict:
    """Bytes per device from memory_calc: states over tp·pp, activations as TP+SP over tp, / cp."""
    states = memory_calc.training_memory(model, seq, micro, precision, checkpointing,
                                         n=tp * pp, parallelism="pp")
    acts = memory_calc.training_memory(model, seq, micro, precision, checkpointing,
                                       n=tp, parallelism="tp+sp" if tp > 1 else "dp")
    out = {k: states[k] for k in ("params", "grads", "optimizer")}
    out["activations"] = acts["activations"] / cp
    out["total"] = sum(out.values())
    return out


def traffic(model, seq, global_batch, micro, layout, precision) -> dict:
    """Bytes one device sends per step on each dimension (ring formulas, see above)."""
    dp, tp, pp, cp = layout
    e, g = PRECISIONS[precision][0], PRECISIONS[precision][1]
    n_micro = global_batch // (dp * micro)
    act = micro * (seq // cp) * model.hidden * e               # one (b, s/cp, h) tensor
    layers = model.layers // pp
    return {"tp": n_micro * layers * 4 * 2 * (tp - 1) / tp * act,
            "dp": 2 * (dp - 1) / dp * g * model.psi / (tp * pp),
            "pp": n_micro * 2 * act / tp if pp > 1 else 0.0,
            "cp": n_micro * layers * 6 * (cp - 1) * act / tp}


def placement(layout, gpus_per_node) -> dict:
    """{dimension: True if its groups stay inside a node}, innermost tp, cp, pp, dp."""
    dp, tp, pp, cp = layout
    inside, span = {}, 1
    for name, size in (("tp", tp), ("cp", cp), ("pp", pp), ("dp", dp)):
        span *= size
        inside[name] = size == 1 or span <= gpus_per_node
    return inside


def plan(model, seq, global_batch, devices, device_bytes, gpus_per_node, intra_bw,
         inter_bw, micro=1, precision="mixed", checkpointing="selective") -> list:
    """The layouts that fit in ``device_bytes``, fastest communication first.

    Each row: layout, memory (dict), traffic (bytes per dimension), seconds
    (each dimension's traffic over the bandwidth of the link it uses), comm_s
    (their sum: no overlap), tp_across_nodes.
    """
    if devices < 1 or global_batch < 1 or micro < 1:
        raise ValueError("devices, global_batch and micro must be >= 1")
    rows = []
    for layout in layouts(devices):
        dp, tp, pp, cp = layout
        if (model.heads % tp or model.hidden % tp or model.layers % pp or seq % cp
                or global_batch % (dp * micro)):
            continue
        mem = device_memory(model, seq, micro, tp, pp, cp, precision, checkpointing)
        if mem["total"] > device_bytes:
            continue
        sent = traffic(model, seq, global_batch, micro, layout, precision)
        inside = placement(layout, gpus_per_node)
        seconds = {d: b / (intra_bw if inside[d] else inter_bw) for d, b in sent.items()}
        rows.append(dict(layout=layout, memory=mem, traffic=sent, seconds=seconds,
                         comm_s=sum(seconds.values()), tp_across_nodes=not inside["tp"]))
    return sorted(rows, key=lambda r: r["comm_s"])
