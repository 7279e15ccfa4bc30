"""The memory calculator: bytes per device of a transformer's training step, from formulas.

Plain functions of (model size, sequence, batch, dtype, checkpointing, N and
parallelism), shared by the memory chapter's widget and the DeviceMesh
chapter's layout planner:

    ls.memory.calc.training_memory(PRESETS["Llama-2 7B"], seq=4096, batch=1,
                                   precision="mixed", checkpointing="selective",
                                   n=8, parallelism="tp+sp")

States follow the ZeRO paper (``labsupport.memory.tally.model_state_bytes``);
activations follow Korthikanti et al. 2022 (arXiv 2205.05198), Section 4 and
Table 2, written for any value size ``e`` and dropout-mask size ``m`` (the
paper's numbers are e = 2, m = 1). Only the transformer layers' activations
are counted, plus, where asked, the LM head's (:func:`head_activation_bytes`).
"""
import dataclasses

from labsupport.memory.tally import PRECISIONS, model_state_bytes

RECOMPUTE = ("none", "selective", "full")
PARALLELISMS = ("dp", "zero1", "zero2", "zero3", "tp", "tp+sp", "pp", "cp")


@dataclasses.dataclass(frozen=True)
class Model:
    """A decoder's sizes: L layers, hidden h, a heads, vocabulary V; Ψ = ``psi``.

    ``tied``: the LM head multiplies by the embedding's own V x h matrix, which
    ``psi`` counts once (GPT-2's and this course's ``models.GPT``); untied, the
    head is a second V x h matrix (Llama 2, Mixtral, DeepSeek-V3).
    """
    psi: int
    layers: int
    hidden: int
    heads: int
    vocab: int
    tied: bool = True


def gpt_params(layers, hidden, vocab, seq_len, ffn=0, tie_weights=True) -> int:
    """Ψ of ``labsupport.models.GPT`` (biases everywhere but the LM head).

    Per layer: attention 4h² + 4h, MLP 2hf + f + h, two LayerNorms 4h; then
    token and position embeddings (V + s)h, the final LayerNorm 2h and, when
    not tied, the head Vh. With f = 4h a layer holds 12h² + 13h.
    """
    f = ffn or 4 * hidden
    layer = 4 * hidden**2 + 4 * hidden + 2 * hidden * f + f + hidden + 4 * hidden
    head = 0 if tie_weights else vocab * hidden
    return layers * layer + (vocab + seq_len) * hidden + 2 * hidden + head


# Published models (hidden sizes and heads from their papers).
PRESETS = {
    "GPT-2 124M": Model(124_439_808, 12, 768, 12, 50257),      # Radford et al. 2019
    # Llama-2 7B's shape, untied: its 6.74B parameters are 32 layers of
    # 4h² + 3·h·11008 and two 32000 x 4096 matrices, embedding and head
    "7B": Model(7_000_000_000, 32, 4096, 32, 32000, tied=False),
    # GPT-3: Brown et al. 2020, Table 2.1; GPT-2's model (§2.1), whose head is the
    # embedding's matrix (openai/gpt-2, src/model.py: logits = h · wte^T)
    "GPT-3 175B": Model(175_000_000_000, 96, 12288, 96, 50257),
}


def activation_bytes_per_layer(s, b, h, a, e=2, dropout=True, m=1, recompute="none",
                               t=1, sp=False, flash=False) -> float:
    """Bytes one transformer layer saves for backward (Korthikanti et al. 2022, §4, Table 2).

    The book's one activation formula. ``e`` bytes per activation value, ``m``
    bytes per dropout-mask element, ``t`` the TP degree. Not split by tensor
    parallelism (without sequence parallelism): the two LayerNorm inputs 2e,
    the QKV and fc1 inputs 2e, two dropout masks 2m. Split over t: Q, K, V
    3e, the out-projection input e, GELU's input and fc2's input 8e;
    attention scores: softmax output e, with dropout its mask m and output e,
    per score (a·s² of them per sequence).
    ``recompute="selective"`` drops the scores (recomputed in backward);
    ``"full"`` keeps only the layer's input, e·sbh (Table 2 keeps it unsplit).
    ``flash=True``: attention's core is one FlashAttention kernel (Dao et al.
    2022, arXiv 2205.14135; torch's SDPA), which keeps no scores, only each
    row's fp32 log-sum-exp, 4 bytes per head and token: 4as·b (its output is
    the out-projection's input, counted already).
    With e = 2, m = 1: sbh(34 + 5as/h), sbh(10 + 24/t + 5as/(ht)), sbh/t·(34 + 5as/h).
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: use one of {RECOMPUTE}")
    if t < 1 or h % t or a % t:
        raise ValueError(f"t={t} must be >= 1 and divide hidden={h} and heads={a}")
    if recompute == "full":
        return e * s * b * h
    mask = m if dropout else 0
    unsplit, split = 4 * e + 2 * mask, 12 * e
    scores = (e + (mask + e if dropout else 0)) * a * s * s * b / t
    if flash:
        scores = 4 * a * s * b / t
    if recompute == "selective":
        scores = 0
    if sp:
        return s * b * h * (unsplit + split) / t + scores
    return s * b * h * (unsplit + split / t) + scores


def head_activation_bytes(s, b, h, vocab, e=2, dropout=True, m=1) -> float:
    """Bytes saved outside the layers: the final LayerNorm's and LM head's inputs, 2e·sbh,
    the cross-entropy's fp32 log-probabilities 4·sbV, and the embedding dropout mask m·sbh."""
    return s * b * (2 * e * h + 4 * vocab + (m * h if dropout else 0))


def training_memory(model: Model, seq, batch, precision="mixed", checkpointing="none",
                    n=1, parallelism="dp", dropout=True, flash=False) -> dict:
    """Bytes per device of one training step with Adam: states and activations.

    ``batch`` is the micro-batch each device runs at once. ``parallelism`` over
    ``n`` devices: "dp" replicates everything; "zero1/2/3" shard the states
    (ZeRO paper); "tp" and "tp+sp" split the states and the activations as
    Korthikanti's Table 2; "pp" keeps L/n layers' states, and with 1F1B the
    first stage holds n micro-batches of L/n layers: L layers' activations;
    "cp" splits the sequence, so every activation term, scores included
    (local queries x all keys), is divided by n. ``flash``: attention through
    FlashAttention (no scores kept). Returns {"params", "grads",
    "optimizer", "activations", "total"}; activations of the layers only.
    """
    if parallelism not in PARALLELISMS:
        raise ValueError(f"parallelism={parallelism!r}: use one of {PARALLELISMS}")
    if n < 1:
        raise ValueError(f"n={n}: the number of devices must be >= 1")
    e = 4 if precision == "fp32" else 2
    stage = int(parallelism[-1]) if parallelism.startswith("zero") else 0
    shards = n if parallelism in ("tp", "tp+sp", "pp") else 1
    out = model_state_bytes(model.psi / shards, precision, stage, n if stage else 1)
    del out["total"]
    t = n if parallelism.startswith("tp") else 1
    layer = activation_bytes_per_layer(seq, batch, model.hidden, model.heads, e, dropout,
                                       recompute=checkpointing, t=t, sp=parallelism == "tp+sp",
                                       flash=flash)
    out["activations"] = model.layers * layer / (n if parallelism == "cp" else 1)
    out["total"] = sum(out.values())
    return out


def max_params(device_bytes, precision="mixed") -> float:
    """The largest Ψ whose states fit in ``device_bytes`` (80 GB / 16 B = 5B),
    activations aside."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: use one of {sorted(PRECISIONS)}")
    return device_bytes / sum(PRECISIONS[precision])
