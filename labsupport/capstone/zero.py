"""ZeRO-1 and ZeRO-2 in the composed trainer: optimizer state (and gradients) over dp × cp.

    train(layout, steps, zero=1)      # AdamW's moments: 1/(dp·cp) of the stage's on each rank
    train(layout, steps, zero=2)      # and the gradients kept between steps: 1/(dp·cp)

Chapter 7 (``labsupport.zero``) sharded a whole model over all ranks. In
the composition, the ranks that hold the same weights are a dp × cp group
(picotron's ``cp_dp_group``): the tp ranks and the pipeline stages already
hold different parameters, so ZeRO shards each rank's own stage, TP shards
included, over its dp × cp group, and nothing else changes. With N = dp·cp:

- the stage's parameters become views into one flat buffer padded to N equal
  shards (chapter 7's ``FlatParams``, here on the dp × cp group, not the
  world); the optimizer steps only this rank's shard, a view of that buffer,
  so its state is 1/N of the stage's;
- ``sync``: the gradients that sequence parallelism left partial are summed
  over tp as before, then the flat gradient is reduce-scattered over dp × cp
  (a SUM, divided by N: each rank gets the mean of its shard), where the
  plain trainer all-reduced it;
- ZeRO-1 keeps the whole gradient buffer (backward accumulates into it; only
  this rank's slice is then the mean, as chapter 7's ``zero_step`` leaves
  it); ZeRO-2 frees it after the reduce-scatter and keeps only the shard.
  Here backward still makes every parameter's gradient at once before the
  reduce-scatter: the saving is what a rank keeps between steps (and what a
  GPU's allocator could reuse); DeepSpeed's ZeRO-2 reduces bucket by bucket
  during backward so that the whole gradient never lives at once;
- ``step``: AdamW on the shard, then every shard all-gathered over dp × cp
  into the flat buffer, which the model reads: the next forward sees the
  updated weights on every rank. Per step a rank sends (N-1)/N of its stage
  twice, as the all-reduce did (ZeRO paper §7.2.1).

Clipping (``clip_grad_norm_``): after the reduce-scatter a rank holds only
its shard of the mean gradient, so the sum of squares is summed over dp × cp
too (the shards are disjoint), besides tp and pp (``capstone.clip``); the
entries ``clip.counted_params`` leaves out (tp replicas, a tied weight's
second copy) are masked out of the shard. AdamW and SGD act elementwise, so
the sharded step equals the whole one (tests/test_capstone_zero.py).
"""
import torch
import torch.distributed as dist

from labsupport.capstone import clip as capclip
from labsupport.tensor_parallel.gpt import allreduce_sequence_parallel_grads

STAGES = (0, 1, 2)


class ShardedOptimizer:
    """The optimizer of one rank's stage under ZeRO-``zero`` over ``groups["dp_cp"]``.

    ``make_optimizer(params)``: the plain optimizer (``TrainConfig.make_optimizer``),
    given this rank's flat shard as its one parameter. ``zero_grad``, ``step``,
    ``state`` and ``param_groups`` as a torch optimizer's; ``sync`` is the
    trainer's gradient synchronisation for it.
    """

    def __init__(self, stage, groups, make_optimizer, zero=1):
        if zero not in (1, 2):
            raise ValueError(f"zero={zero}: the composed trainer shards with ZeRO-1 "
                             "(optimizer state) or ZeRO-2 (and gradients); 0 is plain dp")
        self.zero, self.group = zero, groups["dp_cp"]
        self.n, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.params = [p for p in stage.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)                 # this stage's Ψ
        self.shard_numel = -(-self.numel // self.n)                       # ⌈Ψ/N⌉
        first = self.params[0]
        self.data = first.new_zeros(self.shard_numel * self.n)            # padded
        for p, view in zip(self.params, self._views(self.data)):
            view.copy_(p.detach())
            p.data = view                     # the model now reads the flat buffer
        self.shard = self._mine(self.data).requires_grad_()   # a view: stepped in place
        self.optimizer = make_optimizer([self.shard])
        counted = {id(p) for p in capclip.counted_params(stage, groups)}
        mask = torch.zeros_like(self.data, dtype=torch.bool)
        for p, view in zip(self.params, self._views(mask)):
            view.fill_(id(p) in counted)
        self.counted = self._mine(mask).clone()   # the shard's entries the norm counts
        self.grad = None
        if zero == 1:                          # the whole gradient, kept between steps
            self.grad = torch.zeros_like(self.data)
            for p, view in zip(self.params, self._views(self.grad)):
                p.grad = view

    @property
    def state(self):
        return self.optimizer.state

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def _views(self, flat):
        out, offset = [], 0
        for p in self.params:
            out.append(flat[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        return out

    def _mine(self, flat):
        return flat[self.rank * self.shard_numel:(self.rank + 1) * self.shard_numel]

    def zero_grad(self, set_to_none=False):
        """ZeRO-1: zero the kept gradient buffer; ZeRO-2: nothing is kept."""
        self.shard.grad = None
        if self.zero == 1:
            self.grad.zero_()
        else:
            for p in self.params:
                p.grad = None

    def sync(self, stage, groups, layout):
        """The trainer's ``sync`` under ZeRO: SP's partial sums over tp, then each
        rank's shard of the mean gradient over dp × cp (reduce-scatter)."""
        allreduce_sequence_parallel_grads(stage)
        if self.zero == 1:
            flat = self.grad
        else:
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]
            pad = self.data.new_zeros(self.data.numel() - self.numel)
            flat = torch.cat([g.flatten() for g in grads] + [pad])
        mine = flat.new_empty(self.shard_numel)
        if self.n > 1:
            dist.reduce_scatter_single(mine, flat, group=self.group)   # the sum
            mine /= self.n
        else:
            mine.copy_(flat)
        if self.zero == 1:
            self.shard.grad = self._mine(self.grad).copy_(mine)
        else:
            self.shard.grad = mine
            for p in self.params:
                p.grad = None                 # only the shard stays
        return self.shard.grad

    def grad_norm(self, groups) -> torch.Tensor:
        """The global gradient norm after ``sync``: this shard's counted squares,
        summed over dp × cp (disjoint shards) and over tp and pp (``clip.SUMMED_OVER``)."""
        squares = (self.shard.grad * self.counted).square().sum()
        for name in ("dp_cp",) + capclip.SUMMED_OVER:
            if dist.get_world_size(groups[name]) > 1:
                dist.all_reduce(squares, group=groups[name])
        return squares.sqrt()

    def clip_grad_norm_(self, groups, max_norm) -> torch.Tensor:
        """Scale the shard's gradient as ``torch.nn.utils.clip_grad_norm_`` scales a
        whole model's; returns the norm before clipping."""
        total = self.grad_norm(groups)
        torch.nn.utils.clip_grads_with_norm_([self.shard], max_norm, total)
        return total

    def step(self):
        """The optimizer on this rank's shard, then every shard all-gathered over
        dp × cp into the flat buffer the model reads."""
        self.optimizer.step()
        if self.n > 1:
            dist.all_gather_single(self.data, self.shard.detach().clone(),
                                   group=self.group)


def clipped_sync(opt, max_norm, norms):
    """``opt.sync`` then ``opt.clip_grad_norm_``: the trainer's sync with ``clip_norm``
    under ZeRO; each step's norm before clipping appended to ``norms``."""
    def sync_and_clip(stage, groups, layout):
        opt.sync(stage, groups, layout)
        norms.append(opt.clip_grad_norm_(groups, max_norm).item())
    return sync_and_clip


def check(zero, custom_sync, record_grads, checkpoints):
    """ValueError, saying what to do, for what ZeRO in the trainer does not do."""
    if zero not in STAGES:
        raise ValueError(f"zero={zero}: use 0 (plain data parallelism), 1 (optimizer state "
                         "sharded over dp x cp) or 2 (and gradients)")
    if zero and custom_sync:
        raise ValueError("train(sync=...) replaces the all-reduce of plain data parallelism; "
                         "with zero > 0 the sync is ZeRO's reduce-scatter: use zero=0")
    if zero and record_grads:
        raise ValueError("with zero > 0 each rank keeps only its shard of the mean gradient: "
                         "compare parameters (return_params=True) or use zero=0 to record "
                         "gradients")
    if zero and checkpoints:
        raise ValueError("checkpoints save the optimizer state per parameter; with zero > 0 "
                         "it is one flat shard per rank, which capstone.checkpoint does not "
                         "save: use zero=0 with checkpoint_every or resume")
