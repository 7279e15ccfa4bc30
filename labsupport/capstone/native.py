"""The capstone's training from PyTorch's own pieces: the production composition.

    from labsupport.capstone import native
    out = ls.run(native.train, (2, 2, 2, 1), steps=5, world_size=8)   # (dp, tp, pp, cp)
    out[0]["losses"]       # equal to trainer.train's and to one process's (fp32 sums)

``trainer.train`` composes the course's lesson code; this is the same
training (the same seeded ``models.GPT``, the same global batches from
``capstone.data.Loader``, AdamW without weight decay) written the way
torchtitan writes it (``torchtitan/models/llama3/infra/parallelize.py``,
``torchtitan/distributed/pipeline_parallel.py``), with the pieces that run on
a CPU under gloo in torch 2.13:

- ``init_device_mesh`` over the layout, dimensions ("dp", "pp", "cp", "tp")
  outermost first (``capstone.layout``: tp innermost, picotron's order), and
  "dp_cp", the dp and cp dimensions flattened: the ranks that hold the same
  weights and see different tokens (torchtitan's ``dp_shard_cp``);
- tensor parallelism by DTensor's ``parallelize_module`` (Megatron's split:
  ``ColwiseParallel`` q, k, v and fc1, ``RowwiseParallel`` o and fc2, the
  embedding vocab-parallel by ``RowwiseParallel``, the LM head by
  ``ColwiseParallel``); with sequence parallelism the LayerNorms are
  ``SequenceParallel`` (their weight gradients, partial per rank, are summed
  by DTensor), ``PrepareModuleInput`` all-gathers the sequence before
  attention and the MLP, the row-parallel outputs are reduce-scattered back
  to sequence shards, and the position embedding is a replicated DTensor of
  which each rank adds its sequence shard;
- FSDP2 ``fully_shard`` over "dp_cp", one unit per block and one for the
  rest of the stage (torchtitan's wrapping), its reduce-scatter averaging the
  gradients over the dp x cp ranks, with ``reshard_after_forward=False``
  (torchtitan's choice when pipelined): each unit's parameters are
  all-gathered once per step and kept through backward, so a step is one
  all-gather and one reduce-scatter per unit and AdamW on the shards, the
  algorithm of the hand-composed trainer's ZeRO-2 (``train(..., zero=2)``,
  ``capstone.zero``), which ``step_time_ratio`` times against it;
- ``torch.distributed.pipelining``: a ``PipelineStage`` per pp rank (the
  embeddings on the first stage, the final LayerNorm and the LM head on the
  last, contiguous runs of blocks: ``capstone.model.stage_blocks``) and
  ``Schedule1F1B`` over ``micro_batches`` micro-batches, the loss the mean
  cross-entropy of a micro-batch, gradients scaled by 1/m (``scale_grads``).

Context parallelism does not run on a CPU in torch 2.13:
``torch.distributed.tensor.experimental.context_parallel`` shards the
buffers, then SDPA raises ``NotImplementedError: Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a
sharding strategy registered.`` (tests/test_capstone_native.py keeps that
claim true). For cp the attention is the course's hand ring attention
(chapter 6, ``context_parallel.ring_attention.RingSelfAttention``) on the
local tensors that the TP styles hand it, each cp rank holding a contiguous
slice of the sequence, its position embedding offset to its slice.
"""
import logging
import math
import statistics
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from labsupport import calls, models
from labsupport.capstone import trainer
from labsupport.capstone.layout import AXES, Layout
from labsupport.capstone.model import stage_blocks, validate
from labsupport.context_parallel.ring_attention import RingSelfAttention
from labsupport.launch import identity, session


def make_mesh(layout):
    """(mesh, dp_cp): the layout's DeviceMesh, (dp, pp, cp, tp), and its dp and
    cp dimensions flattened into one (kept: torch deprecates slicing it again
    out of the mesh)."""
    layout = Layout(*layout)
    if dist.get_world_size() != layout.world_size:
        raise ValueError(f"layout {layout} (dp x tp x pp x cp) needs "
                         f"{layout.world_size} ranks, not {dist.get_world_size()}")
    mesh = init_device_mesh(identity.device().type, layout.shape, mesh_dim_names=AXES)
    return mesh, mesh["dp", "cp"]._flatten("dp_cp")


class NativeStage(nn.Module):
    """This rank's pipeline stage of the seeded decoder, as plain modules.

    Parameter names are the decoder's (``tok.weight``, ``blocks.3.attn.q.weight``);
    ``forward``: ids (b, c) on the first stage, else the residual stream; the
    logits (b, c, V) of the rank's c = s/cp positions on the last.
    """

    def __init__(self, gpt, layout, coords, cp_group):
        super().__init__()
        self.first, self.last = coords.pp == 0, coords.pp == layout.pp - 1
        self.cp_rank = coords.cp
        if self.first:
            self.tok, self.pos = gpt.tok, gpt.pos
        blocks = {}
        for i in stage_blocks(gpt.cfg.layers, layout.pp, coords.pp):
            block = gpt.blocks[i]
            if layout.cp > 1:   # the same projections, the attention a ring
                block.attn = RingSelfAttention(block.attn, cp_group)
            blocks[str(i)] = block
        self.blocks = nn.ModuleDict(blocks)
        if self.last:
            self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x):
        if self.first:
            c = x.shape[1]
            start = self.cp_rank * c                    # this slice's first position
            x = self.tok(x) + self.pos(torch.arange(start, start + c, device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x


def _sequence_shard_of_replicated(module, tp_mesh):
    """Make ``module``'s parameters replicated DTensors over tp and its output
    this rank's shard of dim 0 (the position embedding under SP): the
    gradient of the shard is all-gathered back, so the replicated weight's
    gradient is whole on every tp rank."""
    def inputs(_, args, mesh):
        return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                     for a in args)

    def outputs(_, out, mesh):
        return out.redistribute(mesh, [Shard(0)]).to_local()
    distribute_module(module, tp_mesh, input_fn=inputs, output_fn=outputs)


def tensor_parallel(stage, tp_mesh, sequence_parallel):
    """Megatron's split of the stage over ``tp_mesh`` by ``parallelize_module``."""
    sp = sequence_parallel
    stream = Shard(1) if sp else Replicate()      # the residual stream's layout
    if stage.first:
        parallelize_module(stage.tok, tp_mesh,
                           RowwiseParallel(input_layouts=Replicate(),
                                           output_layouts=stream))
        if sp:
            _sequence_shard_of_replicated(stage.pos, tp_mesh)
    for block in stage.blocks.values():
        plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                "attn.v": ColwiseParallel(),
                "attn.o": RowwiseParallel(output_layouts=stream),
                "mlp.fc1": ColwiseParallel(),
                "mlp.fc2": RowwiseParallel(output_layouts=stream)}
        if sp:
            plan.update({
                "ln1": SequenceParallel(), "ln2": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1),),
                                           desired_input_layouts=(Replicate(),)),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                          desired_input_layouts=(Replicate(),))})
        parallelize_module(block, tp_mesh, plan)
    if stage.last:
        plan = {"lm_head": ColwiseParallel(input_layouts=stream,
                                           output_layouts=Replicate())}
        if sp:
            plan["ln_f"] = SequenceParallel()
        parallelize_module(stage, tp_mesh, plan)


def build(layout, cfg, seed=0, sequence_parallel=True, dtype=torch.float32):
    """(stage, meshes, coords): this rank's piece of the seeded decoder,
    tensor-parallel over "tp" and fully sharded over "dp_cp"; ``meshes`` is
    {"mesh": the (dp, pp, cp, tp) mesh, "dp_cp": its flattened dp x cp}."""
    layout = Layout(*layout)
    mesh, dp_cp = make_mesh(layout)
    coords = layout.coords(dist.get_rank())
    gpt = models.GPT(cfg, seed=seed).to(dtype)          # whole, from its seed
    cp_group = mesh.get_group("cp") if layout.cp > 1 else None
    stage = NativeStage(gpt, layout, coords, cp_group).to(identity.device())
    if layout.tp > 1:
        tensor_parallel(stage, mesh["tp"], sequence_parallel)
    if layout.dp * layout.cp > 1:
        for block in stage.blocks.values():    # ZeRO-2: gathered once a step
            fully_shard(block, mesh=dp_cp, reshard_after_forward=False)
        fully_shard(stage, mesh=dp_cp, reshard_after_forward=False)
    return stage, dict(mesh=mesh, dp_cp=dp_cp), coords


def _loss(logits, targets):
    """A micro-batch's mean cross-entropy over the rank's positions."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def full_grads(stage) -> dict:
    """{name: the whole gradient} of this rank's stage: each DTensor gradient
    (FSDP's shard over dp_cp, TP's over tp) gathered (collective over its mesh)."""
    # A gradient sharded over dp_cp and tp gathers in two all-gathers, and DTensor
    # logs a warning per rank saying so (with a time stamp): a record, not a fault.
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor)
                       else p.grad).clone() for name, p in stage.named_parameters()}
    finally:
        log.setLevel(level)


def step(schedule, stage, opt, batch, layout, meshes, dtype=torch.float32,
         record=None):
    """One step: the 1F1B schedule, the optimizer; the global mean loss on every
    rank. ``record``: a dict to fill with the step's whole gradients (after
    their reduction, before the optimizer)."""
    ids, targets = batch
    opt.zero_grad()
    losses = []
    if stage.first and stage.last:
        schedule.step(ids, target=targets, losses=losses)
    elif stage.first:
        schedule.step(ids)
    elif stage.last:
        schedule.step(target=targets, losses=losses)
    else:
        schedule.step()
    if record is not None:
        record.update(full_grads(stage))
    opt.step()
    loss = torch.zeros((), dtype=dtype, device=ids.device)
    if stage.last:               # the m micro-batch means' mean, then over dp x cp
        loss = torch.stack(losses).mean().to(dtype)
        if layout.dp * layout.cp > 1:
            dist.all_reduce(loss, group=meshes["dp_cp"].get_group())
            loss /= layout.dp * layout.cp
    if layout.pp > 1:
        pp_group = meshes["mesh"].get_group("pp")
        dist.broadcast(loss, group=pp_group,
                       group_src=dist.get_world_size(pp_group) - 1)
    return loss


def train(layout, steps, config=None, *, record_grads=(), warmup=1, record_calls=False,
          **fields):
    """Train the seeded decoder for ``steps`` steps on ``layout`` = (dp, tp, pp, cp)
    with PyTorch's pieces; ``config`` and ``fields`` as ``trainer.train``'s (its
    ``TrainConfig``), the loop its ``run_steps``.

    Returns, on each rank: its losses per step (the global mean), tokens/s of
    the whole job (the steps after ``warmup``, between barriers, timed as
    ``trainer.train`` times them), the layout, its rank and coordinates, the
    gradients of the steps in ``record_grads``, whole (``shards``: None for
    each), so that ``compare.parity`` reads the result as ``trainer.train``'s,
    and ``parts``, what the stage is made of; with ``record_calls``, ``calls``:
    the last step's calls to torch.distributed (``labsupport.calls``).
    """
    cfg, layout = trainer.TrainConfig.of(config, **fields), Layout(*layout)
    if steps < 1:
        raise ValueError(f"train needs steps >= 1, got {steps}")
    if cfg.zero:
        raise ValueError("native.train shards with FSDP2 (ZeRO-2's algorithm, module "
                         "docstring); zero= is trainer.train's option: leave it 0 here")
    if cfg.clip_norm is not None:
        raise ValueError("native.train does not clip gradients: clip_norm is "
                         "trainer.train's option (capstone.clip); leave it None here")
    gpt_cfg = cfg.gpt_config()
    validate(gpt_cfg, layout, cfg.seq_len, cfg.sequence_parallel)
    if (cfg.batch // layout.dp) % cfg.micro_batches:
        raise ValueError(f"{cfg.batch // layout.dp} sequences per replica do not split "
                         f"into m={cfg.micro_batches} micro-batches")
    stage, meshes, coords = build(layout, gpt_cfg, cfg.seed, cfg.sequence_parallel, cfg.dtype)
    dev = identity.device()
    pipe = PipelineStage(stage, coords.pp, layout.pp, dev,
                         group=meshes["mesh"].get_group("pp"))
    schedule = Schedule1F1B(pipe, cfg.micro_batches, loss_fn=_loss)
    opt = cfg.make_optimizer(list(stage.parameters()))
    grads, log = {}, None

    def one_step(k, ids, targets):
        nonlocal log
        # whole gradients are gathered (collectives) inside the step, before the optimizer
        record = grads.setdefault(k, {}) if k in record_grads else None
        if record_calls and k == steps - 1:
            with calls.record() as log:
                return step(schedule, stage, opt, (ids, targets), layout, meshes,
                            cfg.dtype, record)
        return step(schedule, stage, opt, (ids, targets), layout, meshes, cfg.dtype, record)

    with warnings.catch_warnings():
        # The last stage's logits are DTensor.to_local()'s view; FSDP2 warns
        # that an in-place op on it would skip its hook. The schedule's loss
        # reads it out of place.
        warnings.filterwarnings("ignore", "FSDP2-wrapped module .* returned a view")
        out = trainer.run_steps(one_step, cfg.loader(layout, coords), steps, warmup=warmup,
                                device=dev, tokens_per_step=cfg.batch * cfg.seq_len)
    return dict(losses=out["losses"], tokens_per_s=out["tokens_per_s"],
                layout=tuple(layout), rank=dist.get_rank(), coords=tuple(coords),
                grads=grads, shards={n: None for n, _ in stage.named_parameters()},
                parts=parts(stage, schedule), calls=None if log is None else log.calls)


def parts(stage, schedule) -> dict:
    """What this rank's training is made of, for a test to see each piece is real:
    FSDP2 units, parameters that are DTensors sharded over tp, the ring attentions,
    the schedule's class."""
    params = list(stage.parameters())
    tp_sharded = [p for p in params if isinstance(p, DTensor)
                  and any(pl.is_shard() for pl, name in
                          zip(p.placements, p.device_mesh.mesh_dim_names)
                          if name == "tp")]
    return dict(fsdp_units=sum(isinstance(m, FSDPModule) for m in stage.modules()),
                tp_sharded=len(tp_sharded), params=len(params),
                ring_attentions=sum(isinstance(m, RingSelfAttention)
                                    for m in stage.modules()),
                schedule=type(schedule).__name__)


def context_parallel_error(device="cpu") -> str | None:
    """Try torch's ``context_parallel`` on this world (one causal SDPA over a
    sequence sharded on all ranks, forward and backward); the one-line error it
    raises, or None if it ran. On a CPU in torch 2.13 it raises (see above)."""
    from torch.distributed.tensor.experimental import context_parallel
    mesh = init_device_mesh(device, (dist.get_world_size(),), mesh_dim_names=("cp",))
    proj = nn.Linear(8, 8, device=device)
    x = torch.randn(1, 2, 4 * dist.get_world_size(), 8, device=device)  # (b, a, s, d)
    try:
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[2]):
            q = proj(x)
            F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    except Exception as error:   # the message is the claim
        return traceback.format_exception_only(error)[-1].strip()
    return None


def step_time_ratio(layout, steps=12, repeats=3, hand_zero=2, **train_kw) -> dict:
    """The hand-composed trainer's step time over native's on ``layout``, from
    here (``ls.run``): the two run alternately ``repeats`` times each (the
    machine's load drifts), each timed as ``train`` times itself; returns the
    median tokens/s of each and ``ratio`` = hand step / native step (< 1: the
    hand-composed trainer is faster). Like for like: the hand-composed run
    with ZeRO-``hand_zero`` (default 2, FSDP2's algorithm here; 0: all-reduce
    data parallelism, not the same algorithm)."""
    layout = tuple(Layout(*layout))
    runs = {"hand": [], "native": []}
    for _ in range(repeats):
        for name, fn in (("hand", trainer.train), ("native", train)):
            kw = dict(train_kw, zero=hand_zero) if name == "hand" else train_kw
            outs = session.run(fn, layout, steps, world_size=math.prod(layout),
                               backend="gloo", **kw)
            runs[name].append(outs[0]["tokens_per_s"])
    hand, nat = (statistics.median(runs[k]) for k in ("hand", "native"))
    return dict(layout=layout, hand_tokens_per_s=hand, native_tokens_per_s=nat,
                ratio=nat / hand, runs=runs)


def collectives(log_calls) -> dict:
    """{op: (calls, payload bytes)} of the collectives in ``log_calls`` (a
    ``labsupport.calls`` record) on groups of more than one rank: what a step
    moves between ranks (a call on a one-rank group moves nothing)."""
    out = {}
    for c in log_calls:
        if c["kind"] == "collective" and len(c["ranks"]) > 1:
            n, b = out.get(c["op"], (0, 0))
            out[c["op"]] = (n + 1, b + c["nbytes"])
    return dict(sorted(out.items()))
