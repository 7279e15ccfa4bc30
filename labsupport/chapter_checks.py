"""Checks behind the chapters' ``your-turn`` cells: run the reader's function, say what is wrong.

    from labsupport import chapter_checks as cc
    ls.your_turn.check(lambda: cc.collective("all_gather", ring_all_gather, ring=True),
                       "ring_all_gather", "...")

Collectives written from send/recv reuse the graders' checking core
(``labsupport.grading``: results against ``dist.all_reduce``, no library
collective, every request waited for, ring neighbours and bytes, a deadlock
explained rank by rank). The other checks compare the reader's function with
the reference that ``labsupport`` keeps (``ddp.bucket_params``, the order of
``pipeline.train_step_1f1b``, ``timeline.bubble``). Each raises AssertionError
with a message that names what differs, and NotWritten while the stub is
untouched, so that ``ls.your_turn.check`` says "not written yet".
"""
import torch
import torch.distributed as dist

from labsupport.grading import checks as grading
from labsupport.your_turn import NotWritten

_STUB = "is not written yet"


def _name(fn) -> str:
    return getattr(fn, "__name__", "the function")


def _graded(check, fn, *args, **kwargs):
    """A grading check; its report of an untouched stub becomes NotWritten."""
    try:
        return check(fn, *args, **kwargs)
    except AssertionError as failure:
        if _STUB in str(failure):
            raise NotWritten(_name(fn)) from None
        raise


def collective(kind: str, fn, world_sizes=(2, 4), ring: bool = False):
    """``fn(tensor)`` in place is ``kind`` ("all_reduce", "reduce_scatter", "all_gather").

    Chunk r is ``tensor.tensor_split(world_size)[r]`` (dist.reduce_scatter's
    convention). ``ring=True`` also checks the ring: only neighbours, and
    k(N-1)/N·S bytes sent per rank (k = 2 for all-reduce, else 1).
    """
    checks = dict(all_reduce=grading.check_allreduce, all_gather=grading.check_all_gather,
                  reduce_scatter=grading.check_reduce_scatter)
    if kind not in checks:
        raise ValueError(f"kind must be one of {sorted(checks)}, got {kind!r}")
    _graded(checks[kind], fn, tuple(world_sizes), traffic=ring)


def _ones_through(fn, numel):
    return fn(torch.ones(numel))


def bytes_sent(fn, factor: int, world_size: int = 4, numel: int = 1200):
    """Each rank sends exactly factor·(N-1)/N·S bytes with send/isend (S = numel floats)."""
    calls = _graded(grading.run, _ones_through, fn, numel, world_size=world_size)
    grading.assert_rules(calls, _name(fn))
    want = factor * (world_size - 1) * numel * 4 // world_size
    sent = [c["sent"] for c in calls]
    if sent != [want] * world_size:
        raise AssertionError(
            f"{_name(fn)} on {world_size} ranks, S = {numel * 4} bytes: ranks sent {sent} "
            f"bytes; each should send {factor}(N-1)/N·S = {want}: one chunk of S/N to each "
            f"of the N-1 other ranks{' per half' if factor == 2 else ''}.")


def _composed(fn, numel):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x = torch.arange(numel, dtype=torch.float32) * (rank + 1)
    want = torch.arange(numel, dtype=torch.float32) * world_size * (world_size + 1) / 2
    out = fn(x)
    got = x if out is None else out
    return dict(got=got, want=want)


def composed_all_reduce(fn, world_size: int = 4, numel: int = 12):
    """``fn(t)`` returns the all-reduced t using reduce-scatter then all-gather, tensor forms."""
    calls = _graded(grading.run, _composed, fn, numel, world_size=world_size)
    used = calls[0]["collectives"]
    if used.get("all_reduce"):
        raise AssertionError(f"{_name(fn)} called dist.all_reduce: build it from the two "
                             "halves, a reduce-scatter then an all-gather.")
    halves = {"reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
              "all_gather": ("all_gather_single", "all_gather_into_tensor")}
    for half, names in halves.items():
        if sum(used.get(n, 0) for n in names) != 1:
            raise AssertionError(f"{_name(fn)} should call one {half} in its tensor form "
                                 f"({' or '.join('dist.' + n for n in names)}); it called "
                                 f"{used or 'no collective'}.")
    for rank, c in enumerate(calls):
        got, want = c["value"]["got"], c["value"]["want"]
        if got.shape != want.shape or not torch.equal(got, want):
            raise AssertionError(f"{_name(fn)} on {world_size} ranks: rank {rank} got "
                                 f"{got.tolist()}, expected the sum over ranks {want.tolist()}.")


# -- chapter 3: data parallelism -------------------------------------------------------

def _seeded_model(seed):
    """A model with a frozen layer, a tied weight and buffers, built from ``seed``."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 6), torch.nn.Linear(6, 6),
                                torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 10, bias=False))
    model[1].requires_grad_(False)  # frozen
    model[3].weight = model[0].weight  # tied
    with torch.no_grad():
        model[2].running_mean.add_(seed)  # a buffer that differs too
    return model


def _broadcast_on_rank(fn):
    model = _seeded_model(100 + dist.get_rank())
    fn(model)
    return {name: t.detach().clone() for name, t in
            [*model.named_parameters(), *model.named_buffers()]}


def broadcast(fn, world_size: int = 2):
    """``fn(module)`` copies rank 0's parameters (frozen, tied) and buffers to every rank."""
    got = _graded(grading.run, _broadcast_on_rank, fn, world_size=world_size)
    want = {name: t for name, t in [*_seeded_model(100).named_parameters(),
                                    *_seeded_model(100).named_buffers()]}
    for rank, c in enumerate(got):
        for name, tensor in c["value"].items():
            if not torch.equal(tensor, want[name]):
                kind = "buffer" if "running" in name or "batches" in name else "parameter"
                raise AssertionError(
                    f"{_name(fn)}: on rank {rank} the {kind} {name!r} is not rank 0's "
                    "(each rank built its model from its own seed). Broadcast every "
                    "parameter, frozen ones too, and every buffer (module.buffers()), "
                    "from src=0, in place.")


def buckets(fn):
    """``fn(params, bucket_size)`` splits params as ``labsupport.ddp.bucket_params`` does."""
    from labsupport import ddp
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 32),
                                torch.nn.Linear(32, 4))
    params = list(model.parameters())[::-1]  # the order backward produces them
    nbytes = [p.numel() * 4 for p in params]
    for size in (0, 200, 528, 656, 4096, 8192, 2**30):
        got, want = fn(params, size), ddp.bucket_params(params, size)
        if [id(p) for b in got for p in b] != [id(p) for p in params]:
            raise AssertionError(f"{_name(fn)}(params, {size}): the buckets, one after the "
                                 "other, must hold every parameter once, in the order given "
                                 "(the order backward produces the gradients).")
        if [len(b) for b in got] != [len(b) for b in want]:
            show = [[p.numel() * 4 for p in b] for b in got]
            raise AssertionError(
                f"{_name(fn)}(params, {size}) with parameters of {nbytes} bytes gave "
                f"buckets of {show} bytes; expected "
                f"{[[p.numel() * 4 for p in b] for b in want]}: a bucket takes parameters "
                f"until the next would push it past {size} bytes, and never stays empty.")


# -- chapter 5: pipeline parallelism ---------------------------------------------------

def _reference_order(rank, world_size, m):
    from labsupport import pipeline, pipeline_sim
    recorder = pipeline_sim.OrderRecorder(rank, world_size, m)
    pipeline.train_step_1f1b(recorder)
    return [(kind, i) for kind, _, i in recorder.ops]


def order_1f1b(fn):
    """``fn(rank, world_size, m)`` is 1F1B's list of ("F", i) and ("B", i) on that rank."""
    for world_size in (2, 3, 4):
        for m in (1, 2, 4, 8):
            for rank in range(world_size):
                got, want = list(fn(rank, world_size, m)), _reference_order(rank, world_size, m)
                if got == want:
                    continue
                k = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b),
                         min(len(got), len(want)))
                warmup = min(world_size - rank - 1, m)
                mine = got[k] if k < len(got) else "missing"
                theirs = want[k] if k < len(want) else "nothing"
                raise AssertionError(
                    f"{_name(fn)}({rank}, {world_size}, {m}): operation {k} is "
                    f"{mine}, expected {theirs} (you returned {len(got)} operations, 1F1B has {2 * m}).\n  got      "
                    f"{got}\n  expected {want}\nRank {rank} of {world_size} runs "
                    f"{warmup} warm-up forwards, then one forward and one backward "
                    f"{m - warmup} times, then the {warmup} remaining backwards.")


def bubble(fn):
    """``fn(events)`` is the mean idle fraction of the wall time, as ``timeline.bubble``."""
    from labsupport import pipeline, pipeline_sim, timeline
    cases = [(pipeline.train_step_afab, 4, 4, 1), (pipeline.train_step_1f1b, 2, 8, 1),
             (pipeline.train_step_interleaved, 4, 8, 2)]
    for schedule, p, m, v in cases:
        events = pipeline_sim.ideal_events(schedule, p, m, v, t_f=1.0, t_b=2.0)
        events += [dict(e, lane="wait", name="recv") for e in events[:3]]  # not compute
        got, want = fn(events), timeline.bubble(events)["fraction"]
        if abs(got - want) > 1e-9:
            raise AssertionError(
                f"{_name(fn)} on the ideal {schedule.__name__} (p={p}, m={m}, v={v}) gave "
                f"{got:.4f}; the idle fraction is {want:.4f} = (p-1)/(vm+p-1) = "
                f"{(p - 1) / (v * m + p - 1):.4f}. Per rank: wall time (first start to "
                "last end, over all ranks) minus the rank's time on the 'compute' lane, "
                "over the wall time; then the mean over the ranks. Events on other "
                "lanes (waiting in recv) are not compute.")
