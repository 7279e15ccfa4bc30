"""One rank's piece of the shared decoder on a (dp, tp, pp, cp) layout.

    gpt = models.GPT(config(...), seed=0)          # the whole decoder, on every rank
    stage = Stage(gpt, layout, coords, groups)     # this rank's blocks, TP shards, ring
    stage.shards()                                 # {name: (dim, tp_rank, tp) or None}

The decoder is built once, whole, from its seed, and every rank keeps its
part, so step 0 is the same model on every layout. The parts are the
chapters' own code:

- pipeline parallelism (chapter 5): stage ``pp`` holds a contiguous run of
  blocks; the first stage also the token and position embeddings, the last
  the final LayerNorm and the LM head (Megatron-LM's placement);
- tensor parallelism (chapter 4, ``tensor_parallel``): every block is a
  ``TensorParallelBlock`` (heads and MLP split, Megatron's f/g), the
  embedding vocab-parallel, the LM head column-parallel; with
  ``sequence_parallel`` the residual stream between the parallel regions
  holds s/(cp·tp) positions per rank (Megatron-SP's all-gather and
  reduce-scatter). At tp = 1 there is nothing to split: the stage keeps the
  decoder's own modules and sequence parallelism is off, as in Megatron-LM
  (``validate_args`` in ``megatron/training/arguments.py`` turns
  ``sequence_parallel`` off when ``tensor_model_parallel_size == 1``, and
  the f/g mappings of ``megatron/core/tensor_parallel/mappings.py`` return
  their input on a group of one), so no collective runs on a one-rank group;
- context parallelism (chapter 6, ``ring_attention``): each rank of a cp
  group holds a contiguous slice of s/cp positions, with the position
  embedding offset to its slice, and every attention is a causal ring over
  the cp group (``RingSelfAttention``).

The decoder is UNTIED: the LM head has its own weight, not the token
embedding's. With the embedding on the first stage and the head on the
last, a tied weight would live on two stages and its two gradients would
have to be summed across them (Megatron's embedding group); that
synchronisation is graded assignment 9's, so the chapter's trainer never
shows it.
"""
import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labsupport import models
from labsupport.context_parallel.ring_attention import RingSelfAttention
from labsupport.tensor_parallel.gpt import _validate, sequence_parallel_params
from labsupport.tensor_parallel.tensor_parallel import (
    ColumnParallelLinear,
    GatherLastDim,
    TensorParallelBlock,
    VocabParallelEmbedding,
    enter_tp,
    my_chunk,
)


def config(**sizes) -> models.GPTConfig:
    """The capstone's decoder: ``models.GPTConfig`` with untied weights and no
    dropout (a dropout mask depends on the layout's shapes, so no parity)."""
    cfg = models.GPTConfig(**{"tie_weights": False, **sizes})
    if cfg.tie_weights or cfg.dropout or cfg.moe_experts:
        raise ValueError("the capstone decoder is untied, dense and without dropout: "
                         f"got {cfg}")
    return cfg


SIZES = {"vocab_size": 256, "hidden": 32, "heads": 4, "layers": 2}  # train's default


def run_config(seq_len, sizes=None) -> models.GPTConfig:
    """The decoder a training run builds: ``SIZES`` (the tests' small decoder)
    for sequences of ``seq_len``, with ``sizes`` (train's ``model=``) on top."""
    return config(**{**SIZES, "seq_len": seq_len, **(sizes or {})})


def stage_blocks(layers, pp, stage) -> range:
    """The blocks of pipeline stage ``stage``: contiguous, near-equal runs."""
    if not 1 <= pp <= layers:
        raise ValueError(f"cannot split {layers} blocks into {pp} pipeline stages")
    bounds = [round(i * layers / pp) for i in range(pp + 1)]
    return range(bounds[stage], bounds[stage + 1])


def validate(cfg, layout, seq_len, sequence_parallel):
    """Raise if ``layout`` cannot split this decoder and sequence length."""
    _validate(dataclasses.replace(cfg, seq_len=seq_len // layout.cp), layout.tp,
              sequence_parallel)
    if seq_len % layout.cp or seq_len > cfg.seq_len:
        raise ValueError(f"sequences of {seq_len} bytes: cp={layout.cp} must divide it "
                         f"and it may not pass seq_len={cfg.seq_len}")
    stage_blocks(cfg.layers, layout.pp, 0)


class Stage(nn.Module):
    """This rank's pipeline stage, tensor- and context-parallel inside.

    ``forward(x)``: ids (b, s/cp) on the first stage, else the residual
    stream (b, s/cp, h), or (b, s/(cp·tp), h) under SP; returns the stream,
    or on the last stage the logits of the rank's positions (b, s/cp, V).
    Parameter names are the decoder's (``blocks.3.attn.q.weight``...).
    ``sequence_parallel`` is taken where tp > 1 and ignored at tp = 1
    (``self.sequence_parallel`` says which held).
    """

    def __init__(self, gpt, layout, coords, groups, sequence_parallel=True):
        super().__init__()
        cfg, tp_group = gpt.cfg, groups["tp"]
        self.split = layout.tp > 1                  # tp = 1: the decoder's own modules
        sequence_parallel = sequence_parallel and self.split   # Megatron: off at tp = 1
        self.cfg, self.group, self.sequence_parallel = cfg, tp_group, sequence_parallel
        self.first, self.last = coords.pp == 0, coords.pp == layout.pp - 1
        self.cp_rank, self.cp = coords.cp, layout.cp
        if self.first:
            self.tok = VocabParallelEmbedding(gpt.tok, tp_group, sequence_parallel) \
                if self.split else gpt.tok
            self.pos = gpt.pos
        blocks = {}
        for i in stage_blocks(cfg.layers, layout.pp, coords.pp):
            block = TensorParallelBlock(gpt.blocks[i], tp_group, sequence_parallel) \
                if self.split else gpt.blocks[i]
            if layout.cp > 1:   # the same projections, attention as a ring
                block.attn = RingSelfAttention(block.attn, groups["cp"])
            blocks[str(i)] = block
        self.blocks = nn.ModuleDict(blocks)
        if self.last:
            self.ln_f = gpt.ln_f
            self.lm_head = ColumnParallelLinear(gpt.lm_head, tp_group) \
                if self.split else gpt.lm_head
        ends = [getattr(self, n) for n in ("pos", "ln_f") if hasattr(self, n)]
        self.sp_params = sequence_parallel_params(self.blocks.values(), *ends)

    def embed(self, ids):                                 # (b, c) int64, c = s/cp
        c = ids.shape[1]
        start = self.cp_rank * c                          # this slice's first position
        pos = self.pos(torch.arange(start, start + c, device=ids.device))   # (c, h)
        if self.sequence_parallel:
            pos = my_chunk(pos, 0, self.group)            # (c/tp, h)
        return self.tok(ids) + pos                        # (b, c, h) or (b, c/tp, h)

    def forward(self, x):
        if self.first:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        if not self.last:
            return x
        if not self.split:
            return self.lm_head(self.ln_f(x))                           # (b, c, V)
        x = enter_tp(self.ln_f(x), self.group, self.sequence_parallel)   # (b, c, h)
        return GatherLastDim.apply(self.lm_head(x), self.group)         # (b, c, V)

    @staticmethod
    def loss(logits, targets):
        """The mean cross-entropy over this rank's positions."""
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def shards(self) -> dict:
        """{parameter name: (dim, tp_rank, tp) if split by TP along dim, else None}."""
        tp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        out = {}
        for mname, module in self.named_modules():
            dims = getattr(module, "shard_dims", {})
            for pname, _ in module.named_parameters(recurse=False):
                name = f"{mname}.{pname}" if mname else pname
                split = pname in dims and tp > 1
                out[name] = (dims[pname], rank, tp) if split else None
        return out
