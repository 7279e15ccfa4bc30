"""Memory per rank of the composed trainer, measured from real tensors, beside the formulas.

    rows = ls.run(footprint.measure, (2, 2, 2, 2), world_size=16)   # one dict per rank
    rows = ls.run(footprint.measure, (2, 1, 2, 1), zero=2, world_size=4)
    footprint.formula((2, 2, 2, 2), coords, TrainConfig())           # the same keys, from sizes

On each rank ``measure`` builds its stage (``trainer.build``), takes one
training step (``trainer.step``: chapter 5's 1F1B, the sync, the optimizer)
and counts, with chapter 0's tally (``labsupport.memory.tally``):

- parameters, gradients and optimizer state: the distinct storages of the
  stage's parameters, of their gradients after the step (ZeRO-2: the shard
  kept) and of the optimizer's state (AdamW: m, v and its step count);
- activations: the PEAK of the bytes autograd holds saved for backward
  (``torch.autograd.graph.saved_tensors_hooks``) while the step runs: each
  saved tensor is counted from its packing until autograd drops it after its
  micro-batch's backward, so under 1F1B the peak holds the micro-batches in
  flight on that stage (min(pp - stage, m)), not all m.

``formula`` gives the same keys from the sizes alone: Ψ of the rank's stage
counted from the decoder's shapes (each TP-split matrix and bias / tp, the
LayerNorms, row-parallel biases and position embedding whole), its bytes by
``memory.tally.model_state_bytes`` (fp32: 4 + 4 + 8 bytes per parameter,
ZeRO's shares over dp·cp), and the activations by chapter 0's Korthikanti
formula (``memory.calc.activation_bytes_per_layer`` with e = 4 bytes, no
dropout, TP/SP over tp, ring attention keeping no scores, like
FlashAttention) per block and micro-batch in flight, plus the last stage's
``head_activation_bytes``.

Where measured and formula part, and why: the state bytes agree to AdamW's
step counters (4 bytes a tensor) and ZeRO's padding to N equal shards
(``STATE_RTOL``). Under sequence parallelism this code keeps the inputs of
QKV and fc1 all-gathered, as saved by the column-parallel linears, where
Megatron-SP (Korthikanti §4.2.2) keeps its shard and gathers it again in
backward: ``formula`` adds those 2e·sbh(1 - 1/tp) per block. What is left is
what the formula does not count: LayerNorm's mean and 1/σ, the token ids and
masks the embedding keeps, ring attention's log-sum-exp beside its output;
``ACTIVATION_RTOL`` bounds it, and ``table`` prints the ratio per rank. The
total per rank (states and activations) is within ``TOTAL_RTOL``.
"""
import collections
import weakref

import torch
import torch.distributed as dist

from labsupport.capstone import trainer
from labsupport.capstone import zero as capzero
from labsupport.capstone.layout import Layout
from labsupport.capstone.model import stage_blocks, validate
from labsupport.memory import calc as memory_calc
from labsupport.memory import tally

STATES = ("params", "grads", "optimizer")
KEYS = STATES + ("activations",)
STATE_RTOL = 0.01          # step counters and padding: far below 1% here
ACTIVATION_RTOL = 0.15     # what the formula leaves out (module docstring): 0.97 to 1.08 measured
TOTAL_RTOL = 0.05          # states and activations together


class PeakSaved:
    """Bytes autograd holds saved for backward, now (``live``) and at most (``peak``).

    A pack hook counts a tensor's storage when autograd saves it (once, however
    many operations save it) and a finaliser releases it when autograd drops
    the packed object; storages shared with ``exclude`` (the parameters) are
    weights, not activations.
    """

    def __init__(self, exclude=()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._refs = collections.Counter()
        self.live = self.peak = 0

    class _Packed:
        __slots__ = ("tensor", "__weakref__")

        def __init__(self, tensor):
            self.tensor = tensor

    def pack(self, tensor):
        tensor = tensor.detach()      # no cycle through the graph (tally.SavedTensors)
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._exclude or not storage.nbytes():
            return tensor
        if self._refs[key] == 0:
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self._refs[key] += 1
        packed = self._Packed(tensor)
        weakref.finalize(packed, self._release, key, storage.nbytes())
        return packed

    def _release(self, key, nbytes):
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= nbytes

    @staticmethod
    def unpack(packed):
        return packed.tensor if isinstance(packed, PeakSaved._Packed) else packed

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def measure(layout, config=None, **fields) -> dict:
    """On every rank of ``layout``: one training step of ``TrainConfig.of(config,
    **fields)``, and this rank's bytes (``KEYS``) with what it holds."""
    cfg, layout = trainer.TrainConfig.of(config, **fields), Layout(*layout)
    gpt_cfg = cfg.gpt_config()
    validate(gpt_cfg, layout, cfg.seq_len, cfg.sequence_parallel)
    stage, groups, coords = trainer.build(layout, gpt_cfg, cfg.seed, cfg.sequence_parallel,
                                          cfg.dtype)
    with trainer._default_dtype(cfg.dtype):
        sync = trainer.sync_gradients
        if cfg.zero:
            opt = capzero.ShardedOptimizer(stage, groups, cfg.make_optimizer, cfg.zero)
            sync = opt.sync
        else:
            opt = cfg.make_optimizer(list(stage.parameters()))
        ids, targets = cfg.loader(layout, coords).next()
        saved = PeakSaved(exclude=stage.parameters())
        with saved.hooks():
            trainer.step(stage, opt, (ids, targets), layout, groups, coords,
                         cfg.micro_batches, sync, cfg.dtype)
    params = list(stage.parameters())
    grads = [p.grad for p in params] + [opt.shard.grad if cfg.zero else None]
    shards = stage.shards()
    return dict(rank=dist.get_rank(), coords=tuple(coords), blocks=list(stage.blocks),
                batch=tuple(ids.shape), psi=sum(p.numel() for p in params),
                shapes={n: tuple(p.shape) for n, p in stage.named_parameters()
                        if shards[n] is not None},
                params=tally.storage_bytes(params), grads=tally.storage_bytes(grads),
                optimizer=tally.optimizer_state_bytes(opt),
                activations=saved.peak)


def stage_psi(cfg, layout, coords) -> int:
    """Ψ of one rank's stage from the decoder's shapes: per block the TP-split
    q, k, v (weights and biases), o's weight, fc1 (weight and bias) and fc2's
    weight / tp, o's and fc2's biases and the two LayerNorms whole
    (``calc.gpt_params``' 12h² + 13h per block at tp = 1); the first stage the
    token embedding / tp and the position embedding; the last the final
    LayerNorm and the bias-free head / tp."""
    h, f, v, tp = cfg.hidden, cfg.ffn_hidden, cfg.vocab_size, layout.tp
    block = (4 * h * h + 2 * h * f + 3 * h + f) // tp + 2 * h + 4 * h
    blocks = len(stage_blocks(cfg.layers, layout.pp, coords.pp))
    first, last = coords.pp == 0, coords.pp == layout.pp - 1
    return (blocks * block + first * (v * h // tp + cfg.seq_len * h)
            + last * (2 * h + v * h // tp))


def in_flight(layout, coords, m) -> int:
    """Micro-batches a stage holds at once under 1F1B: min(pp - stage, m)."""
    return min(layout.pp - coords.pp, m)


def formula(layout, coords, config=None, **fields) -> dict:
    """This rank's bytes (``KEYS``) by chapter 0's formulas (module docstring)."""
    cfg, layout = trainer.TrainConfig.of(config, **fields), Layout(*layout)
    gpt_cfg = cfg.gpt_config()
    e = torch.finfo(cfg.dtype).bits // 8
    precision = {4: "fp32"}.get(e)
    if precision is None:
        raise ValueError(f"dtype {cfg.dtype}: the formulas here are fp32's (4 + 4 + 8 "
                         "bytes per parameter); measure float64 runs, or use fp32")
    n = layout.dp * layout.cp
    out = tally.model_state_bytes(stage_psi(gpt_cfg, layout, coords), precision,
                                  cfg.zero, n)
    del out["total"]
    b = cfg.batch // layout.dp // cfg.micro_batches            # sequences per micro-batch
    s, h = cfg.seq_len // layout.cp, gpt_cfg.hidden            # this rank's positions
    sp = cfg.sequence_parallel and layout.tp > 1
    layer = memory_calc.activation_bytes_per_layer(
        s, b, h, gpt_cfg.heads, e=e, dropout=False, t=layout.tp, sp=sp, flash=layout.cp > 1)
    if sp:   # QKV's and fc1's inputs kept all-gathered (Megatron-SP gathers them again)
        layer += 2 * e * s * b * h * (1 - 1 / layout.tp)
    blocks = len(stage_blocks(gpt_cfg.layers, layout.pp, coords.pp))
    head = memory_calc.head_activation_bytes(s, b, h, gpt_cfg.vocab_size, e=e,
                                             dropout=False)
    last = coords.pp == layout.pp - 1
    out["activations"] = in_flight(layout, coords, cfg.micro_batches) * blocks * layer \
        + last * head
    return out


def table(rows, layout, config=None, **fields) -> list:
    """``measure``'s rows with the formula's bytes and measured / formula per key."""
    out = []
    layout = Layout(*layout)
    for row in rows:
        want = formula(layout, layout.coords(row["rank"]), config, **fields)
        out.append(dict(row, formula=want,
                        ratio={k: row[k] / want[k] if want[k] else float("nan")
                               for k in KEYS}))
    return out
