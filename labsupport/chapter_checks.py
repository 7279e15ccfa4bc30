"""Checks behind the chapters' ``your-turn`` cells: run the reader's function, say what is wrong.

    from labsupport import chapter_checks as cc
    ls.your_turn.check(lambda: cc.broadcast(broadcast_parameters), "broadcast_parameters", "...")

(Chapters 1 and 2's checks live in ``grading.chapters.collectives`` and
``grading.chapters.ring``.) Functions run on the ranks through the graders'
core (``labsupport.grading``: a deadline, a deadlock explained rank by rank).
The checks compare the reader's function with
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
