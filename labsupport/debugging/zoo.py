"""Chapter 12's fault zoo: each fault a real report, reproduced in seconds on 2-4 gloo ranks.

    from labsupport.debugging import zoo
    fault = zoo.FAULTS["eval_on_rank_zero"]
    fault.fn, fault.kwargs        # what every rank runs: cluster.run(fault.fn, **fault.kwargs)
    fault.report                  # the public report it reproduces
    fault.expect                  # what the tooling must name: kind, ranks, op, group, seq/step

Each fault is a plain function that every rank runs. The faults of
composition run the capstone's trainer (``capstone.trainer.train``) with
the fault injected through one of its documented options, never an edit of
the trainer: ``on_step`` (a callback every rank runs after each step: an
evaluation on rank 0 only, a slow data loader on one rank), ``sync`` (the
gradient synchronisation: one rank that reduces a copy) or ``steps`` given
per rank (one rank's data runs out first).

``gather.run_fault`` runs one with a short deadline and returns the run's
artefacts; ``name`` says what the course's tooling (the launcher's Flight
Recorder lines, DETAIL's fingerprints, gloo's error, the call recorder, the
replicas' checksums) named, which the tests and ``python -m labsupport.bench
debug`` compare with ``expect``.
"""
import datetime
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

CAPSTONE = dict(seq_len=16, micro_batches=2, warmup=0)   # tiny and quick; batch: 2 per replica


@dataclass
class Fault:
    name: str
    fn: object
    world_size: int
    report: str                 # the real report it reproduces
    tool: str                   # the rung of the ladder that names it
    expect: dict                # kind, ranks, op, group, seq (or step)
    kwargs: dict = field(default_factory=dict)
    hangs: bool = True
    detail: bool = False        # needs TORCH_DISTRIBUTED_DEBUG=DETAIL on the ranks


# -- faults on plain ranks ---------------------------------------------------------------

def branch_on_local_value(steps=4, bad_rank=1):
    """Each rank skips its gradient's all-reduce when its own loss looks bad (a rank-local
    value): the others wait in an all-reduce it never issues."""
    torch.manual_seed(dist.get_rank())
    grad = torch.ones(8)
    for k in range(steps):
        local_loss = 10.0 if (dist.get_rank() == bad_rank and k == 2) else 1.0
        if local_loss > 5.0:          # "skip this batch": decided on one rank alone
            continue
        dist.all_reduce(grad)
    return steps


def shape_mismatch(bad_rank=1):
    """One rank all-reduces a tensor of another length (a padded batch, a local vocab)."""
    dist.all_reduce(torch.ones(4))
    n = 5 if dist.get_rank() == bad_rank else 4
    dist.all_reduce(torch.ones(n))
    return n


def dtype_mismatch(bad_rank=1):
    """One rank all-reduces in float64 (its loss was accumulated in double)."""
    dist.all_reduce(torch.ones(4))
    dtype = torch.float64 if dist.get_rank() == bad_rank else torch.float32
    dist.all_reduce(torch.ones(4, dtype=dtype))
    return str(dtype)


def slow_path_collective(bad_rank=1):
    """One rank meets a new input shape, takes the slow path (a recompile) and agrees on
    it with an all-gather the others, on their cached path, never issue."""
    x = torch.ones(4)
    dist.all_reduce(x)
    if dist.get_rank() == bad_rank:            # its cache missed
        seen = [None] * dist.get_world_size()
        dist.all_gather_object(seen, tuple(x.shape))
    dist.all_reduce(x)
    return 1


def groups_in_another_order(bad_rank=1):
    """Every rank makes two groups, but one rank makes them in the other order: group
    creation is a collective over the whole world, matched by order."""
    world = list(range(dist.get_world_size()))
    pairs = [world[:2], world]
    if dist.get_rank() == bad_rank:
        pairs = pairs[::-1]
    made = {tuple(r): dist.new_group(r) for r in pairs}
    dist.all_reduce(torch.ones(2), group=made[tuple(world)])
    return 1


def pipeline_recv_first():
    """Two pipeline stages that each post a blocking receive before their send."""
    peer = 1 - dist.get_rank()
    buf = torch.zeros(4)
    dist.recv(buf, peer)
    dist.send(torch.ones(4), peer)
    return 1


def all_to_all_splits(bad_rank=1):
    """An all-to-all whose split sizes disagree: one rank thinks it gets 3 rows from each
    peer, the others send 2 (the router's counts were not exchanged first)."""
    world = dist.get_world_size()
    rows = 3 if dist.get_rank() == bad_rank else 2
    out = torch.zeros(rows * world)
    dist.all_to_all_single(out, torch.ones(2 * world),
                           output_split_sizes=[rows] * world,
                           input_split_sizes=[2] * world)
    return 1


def timeout_too_long(bad_rank=0, seconds=1.5):
    """The branch of ``slow_path_collective`` on a group whose timeout is ``seconds``: gloo
    itself ends the wait (the default, 30 minutes, turns a 10-second bug into a long one)."""
    group = dist.new_group(list(range(dist.get_world_size())),
                           timeout=datetime.timedelta(seconds=seconds))
    x = torch.ones(4)
    dist.all_reduce(x, group=group)
    if dist.get_rank() == bad_rank:
        dist.all_reduce(x, group=group)
    return 1


def straggler(steps=6, slow_rank=2, pause=0.05, size=64):
    """Every rank times its phases; one rank pauses before each forward (a garbage
    collection, a co-tenant on its core). Returns this rank's phase totals and its
    recorded collectives (``calls.record``)."""
    from labsupport import calls, timing
    torch.manual_seed(0)
    w = torch.randn(size, size, requires_grad=True)
    x = torch.randn(32, size)
    phases = dict(forward=0.0, backward=0.0, communication=0.0, optimizer=0.0)
    with calls.record() as log:
        for _ in range(steps):
            if dist.get_rank() == slow_rank:
                _busy(pause)                      # not in any phase a profiler shows
            t0 = timing.now()
            loss = (x @ w).square().mean()
            t1 = timing.now()
            loss.backward()
            t2 = timing.now()
            dist.all_reduce(w.grad)
            t3 = timing.now()
            with torch.no_grad():
                w -= 1e-3 * w.grad
                w.grad.zero_()
            t4 = timing.now()
            for key, a, b in (("forward", t0, t1), ("backward", t1, t2),
                              ("communication", t2, t3), ("optimizer", t3, t4)):
                phases[key] += b - a
    return dict(phase_times=phases, calls=_times(log.calls))


def _busy(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _times(recorded) -> list[dict]:
    """The recorded collectives as {seq, op, group, enter, exit} (seq counted per group)."""
    counts, out = {}, []
    world = tuple(range(dist.get_world_size()))
    for c in recorded:
        if c["kind"] != "collective" or c["end"] is None:
            continue
        group = "default_pg" if c["ranks"] == world else "ranks " + ",".join(map(str, c["ranks"]))
        counts[group] = counts.get(group, 0) + 1
        out.append(dict(seq=counts[group], op=c["op"], group=group, enter=c["start"],
                        exit=c["end"]))
    return out


# -- faults of composition, on the capstone's trainer ----------------------------------

def eval_on_rank_zero(steps=3):
    """The capstone's trainer with an ``on_step`` that evaluates on rank 0 only: its
    all-reduce of the validation loss is one the other ranks never issue. Two pipeline
    stages: rank 1 (the last) goes on to the next step and waits to receive stage 0's
    activations, a receive the recorder does not keep, so the records part in one
    group only, whatever the machine's load (with two data-parallel replicas, rank 1
    would issue its next gradient all-reduce, whose time beside rank 0's
    all-reduce a loaded machine can reorder)."""
    from labsupport.capstone.trainer import train

    def evaluate(step, loss):
        if dist.get_rank() == 0 and step == 1:
            dist.all_reduce(torch.tensor([loss]))     # "average the eval loss"
    train((1, 1, 2, 1), steps, on_step=evaluate, batch=4, **CAPSTONE)
    return 1


def uneven_data(steps=3, short_rank=1):
    """The capstone's trainer where one rank's shard holds a batch fewer: it leaves the loop
    (and reaches the final barrier) while the others all-reduce another step's gradients."""
    from labsupport.capstone.trainer import train
    mine = steps - 1 if dist.get_rank() == short_rank else steps
    train((2, 1, 1, 1), mine, batch=4, **CAPSTONE)
    return mine


def slow_loader(steps=5, slow_rank=1, pause=0.08):
    """The capstone's trainer with a slow data loader on one rank (an ``on_step`` that
    stalls before the next batch). Returns the rank's recorded collectives."""
    from labsupport import calls
    from labsupport.capstone.trainer import train

    def load_next(step, loss):
        if dist.get_rank() == slow_rank:
            _busy(pause)
    with calls.record() as log:
        train((3, 1, 1, 1), steps, on_step=load_next, batch=6, **CAPSTONE)
    return dict(calls=_times(log.calls))


def reduced_copy(steps=4, bad_rank=1, from_step=2):
    """The capstone's trainer (dp = 3) where one rank, from a step on, all-reduces a
    concatenated copy of its gradients and never writes the sum back: no hang, no error;
    its replica drifts. Returns the checksum of this rank's parameters after each step."""
    from labsupport.capstone import trainer
    sums, held = [], {}

    def sync(stage, groups, layout):
        held["stage"] = stage
        if dist.get_rank() == bad_rank and len(sums) >= from_step:
            params = [p for p in stage.parameters() if p.grad is not None]
            flat = torch.cat([p.grad.flatten() for p in params])
            dist.all_reduce(flat, group=groups["dp_cp"])   # the sum lands in the copy
            return
        trainer.sync_gradients(stage, groups, layout)

    def after(step, loss):
        sums.append(checksum(dict(held["stage"].named_parameters())))
    out = trainer.train((3, 1, 1, 1), steps, sync=sync, on_step=after, batch=6, **CAPSTONE)
    return dict(losses=out["losses"], checksums=sums)


def checksum(params: dict) -> float:
    """One number per replica: the sum of |p| over its parameters, in float64."""
    with torch.no_grad():
        return float(sum(p.double().abs().sum() for p in params.values()))


FAULTS = {f.name: f for f in [
    Fault("eval_on_rank_zero", eval_on_rank_zero, 2,
          "DeepSpeed #5394 (hangs during evaluation under multi-GPU); PyTorch's Flight "
          "Recorder write-up (2026-03-25): CPU-side divergence between ranks",
          "launcher + Flight Recorder",
          dict(kind="desync", ranks=[0], op="all_reduce", group="default_pg")),
    Fault("branch_on_local_value", branch_on_local_value, 3,
          "DeepSpeed #7044 (zero2 training hangs at a fixed step)",
          "launcher + Flight Recorder",
          dict(kind="desync", ranks=[1], op=None, group="default_pg")),
    Fault("shape_mismatch", shape_mismatch, 2,
          "Stas Bekman, ML Engineering, debug/code/collective_mismatch.py; NVIDIA/nccl #1417",
          "TORCH_DISTRIBUTED_DEBUG=DETAIL",
          dict(kind="mismatch", ranks=[1], op="all_reduce", seq=None), hangs=False,
          detail=True),
    Fault("dtype_mismatch", dtype_mismatch, 2,
          "modelscope/ms-swift PR #9551 (float64 on some ranks), #3955 (BFloat16 vs Float)",
          "TORCH_DISTRIBUTED_DEBUG=DETAIL",
          dict(kind="mismatch", ranks=[1], op="all_reduce", seq=None), hangs=False,
          detail=True),
    Fault("slow_path_collective", slow_path_collective, 3,
          "PyTorch's Flight Recorder write-up (2026-03-25): one rank recompiles",
          "launcher + Flight Recorder",
          dict(kind="desync", ranks=[1], op="all_gather", group="default_pg")),
    Fault("groups_in_another_order", groups_in_another_order, 3,
          "pytorch #134314 (new_group got stuck), #130102",
          "launcher's stacks", dict(kind="hang", ranks=None, op="new_group")),
    Fault("pipeline_recv_first", pipeline_recv_first, 2,
          "NVIDIA/nccl #479 (send/recv order), pytorch #172668; torchtitan #775",
          "launcher's stacks", dict(kind="hang", ranks=[0, 1], op="recv")),
    Fault("all_to_all_splits", all_to_all_splits, 2,
          "pytorch #117486 (all_to_all_single stuck when split sizes disagree)",
          "launcher + gloo's error", dict(kind="mismatch", ranks=None, op="all_to_all_single")),
    Fault("uneven_data", uneven_data, 2,
          "DeepSpeed #5394 (hangs at the last step of an epoch); PyTorch's Join tutorial",
          "launcher + Flight Recorder",
          dict(kind="desync", ranks=[1], op="barrier", group="default_pg")),
    Fault("timeout_too_long", timeout_too_long, 2,
          "CCL-D (arXiv 2605.04478): hangs cost hours; NVIDIA/nccl #1324",
          "gloo's timeout", dict(kind="hang", ranks=[0], op=None), hangs=False),
    Fault("straggler", straggler, 4,
          "FALCON (arXiv 2410.12588): fail-slow ranks; traceopt-ai/traceml #252",
          "call recorder", dict(kind="straggler", ranks=[2]), hangs=False),
    Fault("slow_loader", slow_loader, 3,
          "FALCON (arXiv 2410.12588); traceopt-ai/traceml #252", "call recorder",
          dict(kind="straggler", ranks=[1]), hangs=False),
    Fault("reduced_copy", reduced_copy, 3,
          "jingyaogong/minimind PR #854 (replicas silently diverge), pytorch #109191",
          "replica checksums",
          dict(kind="divergence", ranks=[1], step=2), hangs=False),
]}
