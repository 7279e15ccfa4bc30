"""The composed trainer: the shared decoder on real text with dp, tp, pp and cp at once.

    from labsupport.capstone.trainer import train
    out = ls.run(train, (2, 2, 2, 1), steps=5, world_size=8)   # layout (dp, tp, pp, cp)
    out[0]["losses"]          # the global batch's mean loss at each step, on every rank

One step on every rank (``step``):

1. the loader gives this rank's part of the global batch (its dp rows, its
   cp positions; ``capstone.data``);
2. chapter 5's 1F1B schedule (``pipeline.train_step_1f1b``, its message plan
   from ``pipeline_sim``, its sends and receives batched in one plan order)
   runs ``m`` micro-batches through the pipeline stages, each stage tensor-
   and context-parallel inside (``capstone.model.Stage``); the last stage's
   loss of a micro-batch is its mean cross-entropy / m;
3. ``sync_gradients``: the gradients that sequence parallelism left partial
   (LayerNorms, row-parallel biases, position embedding) are summed over tp
   (``tp_gpt.allreduce_sequence_parallel_grads``), then every gradient is
   averaged over the dp × cp ranks, which saw the same weights and different
   tokens: one all-reduce per bucket of chapter 3's ``ddp.bucket_params``, a
   SUM then a division by dp·cp (every rank holds as many tokens, so the mean
   of their means is the global mean);
4. the optimizer steps each rank's own shards (AdamW and SGD act elementwise,
   so sharded steps equal the whole one).

With the same global batch, every layout computes the loss and the gradients
of one process up to the order of floating-point sums (tests/test_capstone.py).
"""
import contextlib
import math

import torch
import torch.distributed as dist

from labsupport import calls, models, timing
from labsupport.pipeline import pipeline
from labsupport.pipeline import sim as pipeline_sim
from labsupport.capstone import checkpoint as capckpt
from labsupport.capstone import data as capdata
from labsupport.capstone.layout import Layout, make_groups
from labsupport.capstone.model import Stage, run_config, validate
from labsupport.data_parallel.ddp import bucket_params
from labsupport.launch import identity
from labsupport.timeline import Timeline
from labsupport.tensor_parallel.gpt import allreduce_sequence_parallel_grads

BUCKET_BYTES = 2 ** 20


class StagePipeline(pipeline.PipelineRank):
    """Chapter 5's ``PipelineRank`` on a pipeline group of a bigger mesh.

    Its fields are the lesson's, so the lesson's ``train_step_1f1b``,
    ``backward_step``, ``send``/``recv`` and plan posting run unchanged;
    only ``forward`` differs, for the decoder's cross-entropy in place of the
    lesson's mean squared error, and the plan's peers are mapped from stage
    numbers to global ranks.
    """

    def __init__(self, stage, ids, targets, m, shape, pp_ranks, pp_rank, dtype):
        self.rank, self.world_size = pp_rank, len(pp_ranks)
        self.num_stages, self.v = len(pp_ranks), 1
        self.stages = {pp_rank: stage}
        self.m, self.shape = m, shape                     # (b/m, c or c/tp, h)
        self.inputs, self.targets = ids.chunk(m), targets.chunk(m)
        self.device = ids.device
        self.tl = Timeline(dist.get_rank(), ids.device)
        plan = pipeline_sim.message_plan(pipeline.train_step_1f1b, len(pp_ranks), m, 1,
                                         pp_rank)
        self.plan = [[(kind, s, i, grad, pp_ranks[peer])
                      for kind, s, i, grad, peer in batch] for batch in plan]
        self.stash, self.outbox, self.posted = {}, {}, {}
        self.batches, self.waited, self.losses = [], 0, []
        self.peak = 0
        self.dtype = dtype

    def forward(self, s, i):
        """``pipeline.forward_step`` with the decoder's loss on the last stage."""
        last = s == self.num_stages - 1
        x = self.inputs[i] if s == 0 else pipeline.recv(self, s, i).requires_grad_()
        with self.tl.span("compute", "F", mb=i, stage=s):
            y = self.stages[s](x)
            if last:  # the m means, each / m, sum to the rank's mean
                y = self.stages[s].loss(y, self.targets[i]) / self.m
        if last:
            self.losses.append(y.detach())
        else:
            pipeline.send(self, y, s + 1, i)
        self.stash[s, i] = (x, y)
        self.peak = max(self.peak, len(self.stash))


def sync_gradients(stage, groups, layout):
    """Make every gradient of this rank's shards the one-process gradient.

    Partial sums under SP: summed over tp. Different tokens on dp × cp:
    averaged over dp × cp, one all-reduce per bucket.
    """
    allreduce_sequence_parallel_grads(stage)
    all_reduce_buckets(stage, groups["dp_cp"], divide_by=layout.dp * layout.cp)


def all_reduce_buckets(stage, group, divide_by):
    """Sum every gradient over ``group``, in buckets (chapter 3's
    ``bucket_params``, in backward's order), then divide it by ``divide_by``."""
    if dist.get_world_size(group) == 1 and divide_by == 1:
        return
    params = [p for p in stage.parameters() if p.grad is not None]
    for bucket in bucket_params(params[::-1], BUCKET_BYTES):
        flat = torch.cat([p.grad.flatten() for p in bucket])
        dist.all_reduce(flat, group=group)
        flat /= divide_by
        for p, g in zip(bucket, flat.split([p.numel() for p in bucket])):
            p.grad.copy_(g.view_as(p))


def build(layout, cfg, seed=0, sequence_parallel=True, dtype=torch.float32):
    """(stage, groups, coords): this rank's piece of the seeded decoder."""
    layout = Layout(*layout)
    groups = make_groups(layout)
    coords = layout.coords(dist.get_rank())
    gpt = models.GPT(cfg, seed=seed).to(dtype)          # whole, from its seed
    stage = Stage(gpt, layout, coords, groups, sequence_parallel).to(identity.device())
    return stage, groups, coords


def step(stage, opt, batch, layout, groups, coords, m, sync=sync_gradients,
         dtype=torch.float32, record=None):
    """One training step on this rank's part of a global batch (ids, targets,
    on the device); returns the global mean loss (the same on every rank).
    ``record``: a dict that receives the step's timeline (``record_timeline``)."""
    ids, targets = batch
    tp = dist.get_world_size(groups["tp"])
    b, c = ids.shape
    if b % m:
        raise ValueError(f"{b} sequences per replica do not split into m={m} "
                         "micro-batches")
    rows = c // tp if stage.sequence_parallel else c
    shape = (b // m, rows, stage.cfg.hidden)
    pp_ranks = groups["ranks"]["pp"]
    opt.zero_grad(set_to_none=False)
    pp = StagePipeline(stage, ids, targets, m, shape, pp_ranks, coords.pp, dtype)
    pipeline.train_step_1f1b(pp)
    pipeline.wait_for(pp, len(pp.batches))              # the step's last sends too
    with pp.tl.span("comm", "sync"):                    # tp (SP) and dp x cp
        sync(stage, groups, layout)
    with pp.tl.span("compute", "optimizer"):
        opt.step()
    loss = torch.zeros((), dtype=dtype, device=ids.device)
    if stage.last:                                      # mean over dp x cp
        loss = torch.stack(pp.losses).sum()
        if layout.dp * layout.cp > 1:
            dist.all_reduce(loss, group=groups["dp_cp"])
            loss /= layout.dp * layout.cp
    if layout.pp > 1:                                   # to every stage
        dist.broadcast(loss, src=pp_ranks[-1], group=groups["pp"])
    if record is not None:
        record["events"] = pp.tl.events
    return loss


def train(layout, steps, *, batch=8, seq_len=32, micro_batches=2, lr=3e-3, seed=0,
          data_seed=0, model=None, optimizer="adamw", sequence_parallel=True,
          dtype=torch.float32, sync=sync_gradients, record_grads=(), text=None,
          return_params=False, warmup=1, checkpoint_every=0, checkpoint_dir=None,
          resume=None, on_step=None, record_timeline=False):
    """Train the seeded decoder for ``steps`` steps on ``layout`` = (dp, tp, pp, cp).

    Runs on every rank of a world of dp·tp·pp·cp ranks. ``batch``: sequences
    of ``seq_len`` bytes per global batch (the same bytes on every layout);
    ``micro_batches``: the pipeline's m per replica; ``model``: sizes for
    ``capstone.model.run_config`` (default ``model.SIZES``: 2 blocks, h = 32, 4 heads).
    ``optimizer``: "adamw", "sgd" or a callable(params) -> Optimizer (a broken
    one, ``compare.adamw_one_weight_twice``, to see what the parity procedure
    finds). ``sync``: the gradient synchronisation (a broken one, likewise).
    ``record_grads``: the steps whose gradients (after sync, before the
    optimizer) and updates (the parameters' change in the step) this rank
    returns, by parameter name. ``record_timeline``: the last step's
    timeline (chapter 5's spans, the sync's and the optimizer's) and its
    ``calls.record`` log, on the same clock.
    ``text``: the training bytes (default: the Bible's training split).
    Returns, on each rank: its losses per step (the global mean), recorded
    gradients, coordinates, the TP split of each parameter, the loader's
    state, tokens/s of the whole job (the steps after ``warmup``, between
    barriers; all steps if there are no more), the timeline if asked; with
    ``return_params``, its parameters (``compare.full_params`` puts the
    whole decoder together).

    Checkpoints (``capstone.checkpoint``, DCP): every ``checkpoint_every``
    steps into ``checkpoint_dir``/step<NNNNNN>; ``resume``: a checkpoint
    written at any layout, to continue from its step (``steps`` counts from
    the run's start, so the steps taken are its step .. steps - 1).
    ``on_step(step, loss)``: called on every rank after each step (and its
    save), e.g. for a progress line.
    """
    layout = Layout(*layout)
    if steps < 1:
        raise ValueError(f"train needs steps >= 1, got {steps}")
    cfg = run_config(seq_len, model)
    validate(cfg, layout, seq_len, sequence_parallel)
    stage, groups, coords = build(layout, cfg, seed, sequence_parallel, dtype)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)   # the pipeline lesson's receive buffers take it
    try:
        make = optimizer if callable(optimizer) else {
            "adamw": lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.0),
            "sgd": lambda p: torch.optim.SGD(p, lr=lr)}[optimizer]
        opt = make(list(stage.parameters()))
        train_bytes = capdata.split(capdata.corpus())[0] if text is None else text
        loader = capdata.Loader(train_bytes, batch, seq_len, data_seed, layout.dp,
                                coords.dp, layout.cp, coords.cp)
        losses, grads, updates, dev = [], {}, {}, identity.device()
        meta = capckpt.run_meta(cfg, layout, loader.state_dict(), optimizer, dtype)
        first = capckpt.resume(resume, stage, opt, loader, meta, steps)
        if checkpoint_every and not checkpoint_dir:
            raise ValueError("checkpoint_every needs a checkpoint_dir")
        start, timeline = None, None
        for k in range(first, steps):
            if k == min(first + warmup, steps - 1):    # whole steps after warm-up
                dist.barrier()
                start, timed = timing.now(dev), steps - k
            ids, targets = (t.to(dev) for t in loader.next())
            before = {n: p.detach().clone() for n, p in stage.named_parameters()
                      } if k in record_grads else None
            record = {} if record_timeline and k == steps - 1 else None
            with calls.record() if record is not None else _nothing() as log:
                t0 = timing.now(dev)
                loss = step(stage, opt, (ids, targets), layout, groups, coords,
                            micro_batches, sync, dtype, record)
                if record is not None:
                    timeline = dict(record, calls=log.calls, start=t0,
                                    end=timing.now(dev))
            losses.append(loss.item())
            if k in record_grads:
                grads[k] = {n: p.grad.detach().clone()
                            for n, p in stage.named_parameters()}
                updates[k] = {n: p.detach() - before[n]
                              for n, p in stage.named_parameters()}
            if checkpoint_every and (k + 1) % checkpoint_every == 0:
                capckpt.save(capckpt.path_for(checkpoint_dir, k + 1), stage, opt,
                             dict(meta, step=k + 1, loader=loader.state_dict()))
            if on_step is not None:
                on_step(k, losses[-1])
        dist.barrier()
        seconds = timing.now(dev) - start     # once the device's work is done
    finally:
        torch.set_default_dtype(old_dtype)
    params = {n: p.detach().clone() for n, p in stage.named_parameters()}
    return dict(losses=losses, grads=grads, updates=updates, coords=tuple(coords),
                layout=tuple(layout), shards=stage.shards(), rank=dist.get_rank(),
                loader=loader.state_dict(), first_step=first,
                tokens_per_s=timed * batch * seq_len / seconds,
                params=params if return_params else None, timeline=timeline)


@contextlib.contextmanager
def _nothing():
    yield None


def reference(steps, *, batch=8, seq_len=32, lr=3e-3, seed=0, data_seed=0, model=None,
              optimizer="adamw", dtype=torch.float32, record_grads=(), text=None):
    """The same training in one process, on ``models.GPT`` itself (no lesson
    code, no communication): the losses and the recorded gradients."""
    cfg = run_config(seq_len, model)
    gpt = models.GPT(cfg, seed=seed).to(dtype)
    make = {"adamw": lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.0),
            "sgd": lambda p: torch.optim.SGD(p, lr=lr)}[optimizer]
    opt = make(gpt.parameters())
    train_bytes = capdata.split(capdata.corpus())[0] if text is None else text
    loader = capdata.Loader(train_bytes, batch, seq_len, data_seed)
    losses, grads = [], {}
    for k in range(steps):
        ids, targets = loader.next()
        opt.zero_grad()
        loss = gpt(ids, targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if k in record_grads:
            grads[k] = {n: p.grad.detach().clone() for n, p in gpt.named_parameters()}
    return dict(losses=losses, grads=grads, model=gpt)


def bits_per_byte(loss) -> float:
    """A mean cross-entropy in nats per byte, in bits per byte."""
    return loss / math.log(2)
