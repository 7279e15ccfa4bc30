"""Pipeline-parallel training steps, written out: naive, GPipe, 1F1B, interleaved 1F1B.

The lesson code of notebooks/05_pipeline_parallel.ipynb, kept here for the
later chapters; tests/test_pipeline.py checks that both copies are identical
and that every schedule gives the single-process loss and gradients.

A model cut into n = p·v stages runs on p ranks; stage s lives on rank s % p,
so with v = 1 rank r holds stage r, and with v stages per rank it holds
r, r + p, r + 2p, ... (Megatron-LM's interleaving, arXiv 2104.04473, Sec. 2.2).
Micro-batch i through stage s is one ``pp.forward(s, i)`` and one
``pp.backward(s, i)``; a schedule is nothing but the order of these calls.
"""
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# ``ls.device()`` as the notebook writes it (the functions below are its copies)
from labsupport.launch import identity as ls
from labsupport.models import DeepMLP
from labsupport.pipeline import sim as pipeline_sim
from labsupport.timeline import Timeline


def split_stages(model: DeepMLP, num_stages: int) -> list[nn.Sequential]:
    """The MLP's hidden blocks in ``num_stages`` equal stages, for equal stage times.

    The bubble formulas assume that every stage takes the same time, so the
    hidden (h x h) blocks are split evenly; the small input block joins the
    first stage and the small head the last. (``DeepMLP.stages`` counts all
    blocks alike.) The stages share parameters with ``model``.
    """
    first, *body, head = model.blocks()
    if num_stages < 1 or len(body) % num_stages:
        raise ValueError(f"cannot split {len(body)} hidden blocks into {num_stages} equal "
                         f"stages: use a depth - 1 that the number of stages divides")
    k = len(body) // num_stages
    stages = [nn.Sequential(*body[j * k:(j + 1) * k]) for j in range(num_stages)]
    stages[0].insert(0, first)
    stages[-1].append(head)
    return stages


# --- lesson: notebooks/05_pipeline_parallel.ipynb (the notebook's copy must match) ---

def send(pp, tensor, stage, i, grad=False):
    """Hand over micro-batch i's activation (or gradient) for ``stage``,
    and post the batches of the plan it completes."""
    pp.outbox[stage, i, grad] = tensor.detach().contiguous()
    post_ready(pp)


def post_ready(pp):
    """Post the plan's batches, in order, as far as we have made their sends.

    One dist.batch_isend_irecv per moment of the ideal timeline: what this
    rank sends then, and the receives of what its neighbours send then.
    Every rank posts in the plan's one order, so each receive meets its send
    even on NCCL, which has no tags and runs a group's operations one at a
    time; and each message leaves as soon as it is made.
    """
    while pp.plan and all((s, i, grad) in pp.outbox
                          for kind, s, i, grad, _ in pp.plan[0] if kind == "send"):
        ops, arriving = [], []
        for kind, stage, i, grad, peer in pp.plan.pop(0):
            if kind == "send":
                tensor = pp.outbox.pop((stage, i, grad))
            else:
                tensor = torch.empty(pp.shape, device=pp.device)  # (b/m, h)
                arriving.append(((stage, i, grad), tensor))
            op = dist.isend if kind == "send" else dist.irecv
            ops.append(dist.P2POp(op, tensor, peer))
        with pp.tl.span("comm", "post", messages=len(ops)):
            pp.batches.append(dist.batch_isend_irecv(ops))
        for key, buffer in arriving:  # it arrives with batch number n
            pp.posted[key] = (buffer, len(pp.batches))


def wait_for(pp, n):
    """Wait for the first n batches posted, in order, each once: NCCL
    completes them in that order, and gloo's requests may be waited for
    only once."""
    for works in pp.batches[pp.waited:n]:
        for work in works:
            work.wait()
    pp.waited = max(pp.waited, n)


def recv(pp, stage, i, grad=False):
    """Wait for micro-batch i's input (or output gradient) of our ``stage``.

    The time spent here is recorded on the "wait" lane: idle time.
    """
    post_ready(pp)  # receives of the plan come before their sends' batches
    buffer, n = pp.posted.pop((stage, i, grad))
    with pp.tl.span("wait", "recv", mb=i, stage=stage):
        wait_for(pp, n)
    return buffer


def forward_step(pp, s, i):
    """Micro-batch i through stage s: receive the input, compute, send on."""
    last = s == pp.num_stages - 1
    x = pp.inputs[i] if s == 0 else recv(pp, s, i).requires_grad_()
    with pp.tl.span("compute", "F", mb=i, stage=s):
        y = pp.stages[s](x)                                 # (b/m, h)
        if last:  # mean over the micro-batch / m: the m losses sum to
            y = F.mse_loss(y, pp.targets[i]) / pp.m  # the batch mean
    if last:
        pp.losses.append(y.detach())
    else:
        send(pp, y, s + 1, i)
    pp.stash[s, i] = (x, y)  # for the backward: input, output and graph
    pp.peak = max(pp.peak, len(pp.stash))


def backward_step(pp, s, i):
    """Micro-batch i back through stage s: get dL/dy, backprop, send dL/dx."""
    x, y = pp.stash.pop((s, i))  # frees this micro-batch's activations
    dy = None if s == pp.num_stages - 1 else recv(pp, s, i, grad=True)
    with pp.tl.span("compute", "B", mb=i, stage=s):
        torch.autograd.backward(y, dy)  # adds into the stage's .grad
    if s > 0:
        send(pp, x.grad, s - 1, i, grad=True)


class PipelineRank:
    """One rank's part of a step: stages, micro-batches, stash, record."""

    forward, backward = forward_step, backward_step

    def __init__(self, stages, x, y, m, hidden, plan):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if len(stages) % self.world_size or x.shape[0] % m:
            raise ValueError(
                f"{len(stages)} stages on {self.world_size} ranks, "
                f"{x.shape[0]} samples in m={m} micro-batches: use a "
                "multiple of p stages and a batch size that m divides")
        self.num_stages = len(stages)
        self.v = self.num_stages // self.world_size  # stages per rank
        mine = range(self.rank, self.num_stages, self.world_size)
        self.stages = {s: stages[s] for s in mine}  # index -> module
        self.m, self.shape = m, (x.shape[0] // m, hidden)  # (b/m, h)
        self.inputs, self.targets = x.chunk(m), y.chunk(m)
        # Spans end when the device's work is done (timeline, GPU too).
        self.device, self.tl = x.device, Timeline(self.rank, x.device)
        self.plan = list(plan)  # pipeline_sim.message_plan's batches, in order
        self.stash, self.outbox, self.posted = {}, {}, {}
        self.batches, self.waited, self.losses = [], 0, []
        self.peak = 0  # most micro-batches stashed at once


def run_step(schedule, x, y, m, v=1, model_kw=None, repeats=1):
    """What each rank runs: ``repeats`` steps of ``schedule``, last recorded.

    First the schedule is played on the ideal machine, which raises if it
    misses a call or deadlocks, and gives the plan of its messages. Each
    rank builds the whole (small, seeded) model and keeps its stages; a
    real run builds only its own. Returns this rank's gradients by
    parameter name, the loss (last rank), the record, the peak stash, the
    sends and the CPU time the rank got.
    """
    p, rank = dist.get_world_size(), dist.get_rank()
    plan = pipeline_sim.message_plan(schedule, p, m, v, rank)
    model = DeepMLP(**(model_kw or {})).to(ls.device())
    stages = split_stages(model, p * v)
    x, y = x.to(ls.device()), y.to(ls.device())
    for _ in range(repeats):
        model.zero_grad(set_to_none=False)  # in place: no allocation
        pp = PipelineRank(stages, x, y, m, model[0].out_features, plan)
        dist.barrier()  # start the step together
        cpu = time.thread_time()
        schedule(pp)
        wait_for(pp, len(pp.batches))  # the step's last sends too
        cpu = time.thread_time() - cpu
    grads = {n: q.grad for n, q in model.named_parameters()
             if q.grad is not None}
    loss = torch.stack(pp.losses).sum() if pp.losses else None
    sends = sum(k == "send" for batch in plan for k, *_ in batch)
    return dict(grads=grads, loss=loss, events=pp.tl.events, peak=pp.peak,
                cpu=cpu, messages=sends)


def train_step_naive(pp):
    """The starting point: the whole batch through every stage, then back.

    One micro-batch (m = 1): while one rank computes, the others wait.
    """
    if pp.m != 1 or pp.v != 1:
        raise ValueError("the naive step runs m=1 batch, one stage per rank")
    pp.forward(pp.rank, 0)
    pp.backward(pp.rank, 0)


def train_step_afab(pp):
    """GPipe: all forwards, then all backwards (Huang et al., 1811.06965).

    Bubble (p-1)/(m+p-1) of the wall time; m micro-batches stashed.
    """
    for i in range(pp.m):
        pp.forward(pp.rank, i)
    for i in range(pp.m):
        pp.backward(pp.rank, i)


def train_step_1f1b(pp):
    """1F1B: warm-up forwards, one forward one backward, cool-down.

    PipeDream-Flush (Narayanan et al., 2006.09503; Megatron-LM 2104.04473
    Sec. 2.2.1): GPipe's bubble, but at most p - rank stashed.
    """
    warmup = min(pp.world_size - pp.rank - 1, pp.m)
    for i in range(warmup):
        pp.forward(pp.rank, i)
    for i in range(pp.m - warmup):
        pp.forward(pp.rank, warmup + i)
        pp.backward(pp.rank, i)
    for i in range(pp.m - warmup, pp.m):
        pp.backward(pp.rank, i)


def train_step_interleaved(pp):
    """Interleaved 1F1B, v stages per rank (Megatron-LM, 2104.04473 2.2.2).

    Micro-batches pass a rank's stages in groups of p; the bubble shrinks
    to (p-1)/(v·m) of the ideal compute time.
    """
    p, m, v = pp.world_size, pp.m, pp.v
    if m % p:
        raise ValueError(f"interleaved 1F1B needs p | m: m={m}, p={p}")

    def stage(k, backward=False):  # the stage of the k-th F (or B) here
        chunk = (k // p) % v
        return (v - 1 - chunk if backward else chunk) * p + pp.rank

    def mb(k):  # ... and its micro-batch
        return k // (p * v) * p + k % p

    warmup = min((p - pp.rank - 1) * 2 + (v - 1) * p, v * m)
    for k in range(warmup):
        pp.forward(stage(k), mb(k))
    for k in range(v * m - warmup):
        pp.forward(stage(warmup + k), mb(warmup + k))
        pp.backward(stage(k, backward=True), mb(k))
    for k in range(v * m - warmup, v * m):
        pp.backward(stage(k, backward=True), mb(k))


def run_step_torch(schedule_name, x, y, m, v=1, model_kw=None):
    """The same step with PyTorch's ``torch.distributed.pipelining``."""
    from torch.distributed import pipelining
    rank, p = dist.get_rank(), dist.get_world_size()
    model = DeepMLP(**(model_kw or {})).to(ls.device())
    stages = split_stages(model, p * v)
    mine = [pipelining.PipelineStage(stages[s], s, p * v, ls.device())
            for s in range(rank, p * v, p)]
    Schedule = getattr(pipelining, schedule_name)
    multi = schedule_name == "ScheduleInterleaved1F1B"  # v stages here
    schedule = Schedule(mine if multi else mine[0], n_microbatches=m,
                        loss_fn=F.mse_loss)  # grads scaled by 1/m
    losses = []  # one mean per micro-batch, on the last rank
    inputs = (x.to(ls.device()),) if rank == 0 else ()
    target = y.to(ls.device()) if rank == p - 1 else None
    schedule.step(*inputs, target=target, losses=losses)
    grads = {n: q.grad for n, q in model.named_parameters()
             if q.grad is not None}
    return dict(grads=grads,
                loss=torch.stack(losses).mean() if losses else None)
# --- end of lesson ---
