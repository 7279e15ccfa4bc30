"""The composed trainer: the shared decoder on real text with dp, tp, pp and cp at once.

    from labsupport.capstone.trainer import train
    out = ls.run(train, (2, 2, 2, 1), steps=5, world_size=8)   # layout (dp, tp, pp, cp)
    out[0]["losses"]          # the global batch's mean loss at each step, on every rank
    cfg = TrainConfig(batch=12, lr=1e-2)                       # model, data, optimizer
    out = ls.run(train, (2, 1, 2, 1), 5, cfg, world_size=4)

``TrainConfig`` says what a run trains (model, data, optimizer); ``run_steps``
is the one loop that steps, times and records, which ``train``, ``reference``
(one process), ``native.train`` (PyTorch's composition) and assignment 9's
grader call.

One step on every rank (``step``):

1. the loader gives this rank's part of the global batch (its dp rows, its
   cp positions; ``capstone.data``);
2. chapter 5's 1F1B schedule (``pipeline.train_step_1f1b``, its message plan
   from ``pipeline_sim``, its sends and receives batched in one plan order)
   runs ``m`` micro-batches through the pipeline stages, each stage tensor-
   and context-parallel inside (``capstone.model.Stage``); the last stage's
   loss of a micro-batch is its mean cross-entropy / m;
3. ``sync_gradients``: the gradients that sequence parallelism left partial
   (LayerNorms, row-parallel biases, position embedding; SP runs at tp > 1
   only) are summed over tp
   (``tp_gpt.allreduce_sequence_parallel_grads``), then every gradient is
   averaged over the dp × cp ranks, which saw the same weights and different
   tokens: one all-reduce per bucket of chapter 3's ``ddp.bucket_params``, a
   SUM then a division by dp·cp (every rank holds as many tokens, so the mean
   of their means is the global mean);
4. the optimizer steps each rank's own shards (AdamW and SGD act elementwise,
   so sharded steps equal the whole one); with ``clip_norm`` (off by
   default), the global gradient norm is clipped first, as one process's
   ``clip_grad_norm_`` clips it (``capstone.clip``). With ``zero=1`` or ``2``
   the sync reduce-scatters over dp × cp instead and the optimizer steps this
   rank's shard, then all-gathers the weights (``capstone.zero``).

With the same global batch, every layout computes the loss and the gradients
of one process up to the order of floating-point sums (tests/test_capstone.py).
"""
import contextlib
import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from labsupport import calls, models, timing
from labsupport.capstone import checkpoint as capckpt
from labsupport.capstone import clip as capclip
from labsupport.capstone import data as capdata
from labsupport.capstone import zero as capzero
from labsupport.capstone.layout import Layout, make_groups
from labsupport.capstone.model import Stage, run_config, validate
from labsupport.data_parallel.ddp import bucket_params
from labsupport.launch import identity
from labsupport.pipeline import pipeline
from labsupport.pipeline import sim as pipeline_sim
from labsupport.tensor_parallel.gpt import allreduce_sequence_parallel_grads
from labsupport.timeline import Timeline

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


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What a run trains, on what, with what: the one description that ``train``,
    ``reference``, ``native.train`` and assignment 9's grader read (torchtitan's
    trainer likewise takes one config of model, data and optimizer fields).

    ``model``: sizes for ``capstone.model.run_config`` (default ``model.SIZES``:
    2 blocks, h = 32, 4 heads) or a whole ``models.GPTConfig`` (the tied decoder
    of assignment 9). ``optimizer``: "adamw" (no weight decay), "sgd" or a
    callable(params) -> Optimizer. ``text``: the training bytes (default: the
    Bible's training split). ``clip_norm``: clip the global gradient norm to it
    before each optimizer step (``torch.nn.utils.clip_grad_norm_``'s max_norm;
    None, the default: no clipping). ``zero``: 0 (default) plain data parallelism;
    1 or 2, ZeRO-1 or ZeRO-2 over the dp × cp ranks (``capstone.zero``).
    ``sequence_parallel``: Megatron-SP where
    tp > 1; at tp = 1 it is off whatever this says, as in Megatron-LM
    (``capstone.model.Stage``).
    """
    # the model
    model: dict | models.GPTConfig | None = None
    seed: int = 0
    dtype: torch.dtype = torch.float32
    sequence_parallel: bool = True
    # the data
    batch: int = 8
    seq_len: int = 32
    micro_batches: int = 2
    data_seed: int = 0
    text: torch.Tensor | None = None
    # the optimizer
    optimizer: str | Callable = "adamw"
    lr: float = 3e-3
    clip_norm: float | None = None
    zero: int = 0

    @classmethod
    def of(cls, config=None, **fields):
        """``config`` (default: every field's default) with ``fields`` replaced: the
        keyword arguments of ``train(layout, steps, batch=..., lr=...)``."""
        return dataclasses.replace(config or cls(), **fields)

    def gpt_config(self) -> models.GPTConfig:
        if isinstance(self.model, models.GPTConfig):
            return self.model
        return run_config(self.seq_len, self.model)

    def make_optimizer(self, params):
        if callable(self.optimizer):
            return self.optimizer(params)
        return {"adamw": lambda: torch.optim.AdamW(params, lr=self.lr, weight_decay=0.0),
                "sgd": lambda: torch.optim.SGD(params, lr=self.lr)}[self.optimizer]()

    def loader(self, layout=None, coords=None) -> capdata.Loader:
        """The global batches; with a layout, this rank's dp rows and cp positions."""
        text = capdata.split(capdata.corpus())[0] if self.text is None else self.text
        split = () if layout is None else (layout.dp, coords.dp, layout.cp, coords.cp)
        return capdata.Loader(text, self.batch, self.seq_len, self.data_seed, *split)


def build(layout, cfg, seed=0, sequence_parallel=True, dtype=torch.float32, *,
          stage_class=Stage, groups_of=make_groups):
    """(stage, groups, coords): this rank's piece of the seeded decoder
    (``stage_class``: ``Stage`` or a subclass, on the groups ``groups_of(layout)``)."""
    layout = Layout(*layout)
    groups = groups_of(layout)
    coords = layout.coords(dist.get_rank())
    gpt = models.GPT(cfg, seed=seed).to(dtype)          # whole, from its seed
    stage = stage_class(gpt, layout, coords, groups, sequence_parallel)
    return stage.to(identity.device()), groups, coords


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


def run_steps(one_step, loader, steps, *, first=0, warmup=1, timed=True, device=None,
              tokens_per_step=0, record_grads=(), module=None, after_step=None) -> dict:
    """The one training loop: ``one_step(k, ids, targets) -> loss`` for the steps
    ``first`` .. ``steps - 1`` on the loader's batches (moved to ``device``).

    Records each step's loss; for the steps in ``record_grads``, ``module``'s
    gradients after the step (the optimizer leaves them as the sync did) and
    updates (the parameters' change in the step), by name. ``timed``: tokens/s
    of the whole job over the steps after ``warmup`` (all steps if there are no
    more), between barriers (collectives: every rank times). ``after_step(k,
    loss)``: called after each step's records (a checkpoint, a progress line).
    """
    losses, grads, updates, start, timed_steps = [], {}, {}, None, 0
    for k in range(first, steps):
        if timed and k == min(first + warmup, steps - 1):   # whole steps after warm-up
            _barrier()
            start, timed_steps = timing.now(device), steps - k
        ids, targets = (t if device is None else t.to(device) for t in loader.next())
        before = _copies(module) if k in record_grads else None
        loss = one_step(k, ids, targets)
        losses.append(loss.item())
        if k in record_grads:
            grads[k] = {n: p.grad.detach().clone() for n, p in module.named_parameters()}
            updates[k] = {n: p.detach() - before[n] for n, p in module.named_parameters()}
        if after_step is not None:
            after_step(k, losses[-1])
    out = dict(losses=losses, grads=grads, updates=updates, tokens_per_s=None)
    if timed:
        _barrier()
        seconds = timing.now(device) - start    # once the device's work is done
        out["tokens_per_s"] = timed_steps * tokens_per_step / seconds
    return out


def _barrier():
    """Every rank at once, if there are ranks (one process times alone)."""
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _default_dtype(dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _copies(module) -> dict:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def train(layout, steps, config=None, *, sync=sync_gradients, record_grads=(),
          return_params=False, warmup=1, checkpoint_every=0, checkpoint_dir=None,
          resume=None, on_step=None, record_timeline=False, groups_of=make_groups,
          stage_class=Stage, **fields):
    """Train the seeded decoder ``steps`` steps on ``layout`` = (dp, tp, pp, cp), on every
    rank of its world: ``config`` (a ``TrainConfig``) with ``fields`` replaced by name;
    ``sync``: the gradient synchronisation (a broken one, for the parity procedure);
    ``record_timeline``: the last step's spans and calls; checkpoints (DCP) every
    ``checkpoint_every`` steps; ``resume``: one of any layout (``steps`` counts from 0);
    ``on_step(step, loss)`` after each step; ``groups_of``, ``stage_class``: ``build``'s
    (the reader's groups or stage cut in Capstone I). Returns, on each rank, ``run_steps``'s
    record, its coordinates, shards, loader state, timeline, and parameters if asked; with
    ``clip_norm``, each step's gradient norm before clipping (``grad_norms``)."""
    cfg, layout = TrainConfig.of(config, **fields), Layout(*layout)
    if steps < 1:
        raise ValueError(f"train needs steps >= 1, got {steps}")
    gpt_cfg = cfg.gpt_config()
    validate(gpt_cfg, layout, cfg.seq_len, cfg.sequence_parallel)
    stage, groups, coords = build(layout, gpt_cfg, cfg.seed, cfg.sequence_parallel, cfg.dtype,
                                  stage_class=stage_class, groups_of=groups_of)
    with _default_dtype(cfg.dtype):      # the pipeline lesson's receive buffers take it
        norms = []                       # each step's gradient norm before clipping
        if cfg.zero:                     # ZeRO-1/2 over dp x cp: its own sync and step
            capzero.check(cfg.zero, sync is not sync_gradients, record_grads,
                          checkpoint_every or resume)
            opt = capzero.ShardedOptimizer(stage, groups, cfg.make_optimizer, cfg.zero)
            sync = (opt.sync if cfg.clip_norm is None else
                    capzero.clipped_sync(opt, cfg.clip_norm, norms))
        else:
            opt = cfg.make_optimizer(list(stage.parameters()))
        loader = cfg.loader(layout, coords)
        meta = capckpt.run_meta(gpt_cfg, layout, loader.state_dict(), cfg.optimizer, cfg.dtype)
        first = capckpt.resume(resume, stage, opt, loader, meta, steps)
        if checkpoint_every and not checkpoint_dir:
            raise ValueError("checkpoint_every needs a checkpoint_dir")
        timeline = {} if record_timeline else None
        if cfg.clip_norm is not None and not cfg.zero:
            sync = capclip.clipped(sync, cfg.clip_norm, norms)

        def one_step(k, ids, targets):
            return _recorded_step(timeline if k == steps - 1 else None, stage, opt,
                                  (ids, targets), layout, groups, coords, cfg.micro_batches,
                                  sync, cfg.dtype)

        def after_step(k, loss):
            if checkpoint_every and (k + 1) % checkpoint_every == 0:
                capckpt.save(capckpt.path_for(checkpoint_dir, k + 1), stage, opt,
                             dict(meta, step=k + 1, loader=loader.state_dict()))
            if on_step is not None:
                on_step(k, loss)

        out = run_steps(one_step, loader, steps, first=first, warmup=warmup,
                        device=identity.device(), tokens_per_step=cfg.batch * cfg.seq_len,
                        record_grads=record_grads, module=stage, after_step=after_step)
    return dict(out, coords=tuple(coords), layout=tuple(layout), shards=stage.shards(),
                rank=dist.get_rank(), loader=loader.state_dict(), first_step=first,
                params=_copies(stage) if return_params else None, timeline=timeline,
                grad_norms=norms)


def _recorded_step(timeline, *args):
    """``step(*args)``; into a dict ``timeline``, the step's spans and its calls."""
    if timeline is None:
        return step(*args)
    with calls.record() as log:
        t0, record = timing.now(identity.device()), {}
        loss = step(*args, record=record)
        timeline.update(record, calls=log.calls, start=t0, end=timing.now(identity.device()))
    return loss


def reference(steps, config=None, *, record_grads=(), timed=False, warmup=1, **fields):
    """The same training in one process, on ``models.GPT`` itself (no lesson
    code, no communication): the losses, the recorded gradients, the model, and
    with ``clip_norm`` each step's norm before ``clip_grad_norm_`` clipped it;
    ``timed``: tokens/s over the steps after ``warmup``, as ``train`` times them
    (``capstone.baseline``)."""
    cfg = TrainConfig.of(config, **fields)
    gpt = models.GPT(cfg.gpt_config(), seed=cfg.seed).to(cfg.dtype)
    opt = cfg.make_optimizer(list(gpt.parameters()))
    norms = []

    def one_step(k, ids, targets):
        opt.zero_grad()
        loss = gpt(ids, targets)
        loss.backward()
        if cfg.clip_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(gpt.parameters(),
                                                        cfg.clip_norm).item())
        opt.step()
        return loss

    out = run_steps(one_step, cfg.loader(), steps, timed=timed, warmup=warmup,
                    tokens_per_step=cfg.batch * cfg.seq_len, record_grads=record_grads,
                    module=gpt)
    return dict(losses=out["losses"], grads=out["grads"], model=gpt, grad_norms=norms,
                tokens_per_s=out["tokens_per_s"])


def bits_per_byte(loss) -> float:
    """A mean cross-entropy in nats per byte, in bits per byte."""
    return loss / math.log(2)
