"""Ideal pipeline schedules: a schedule's own calls, timed on a perfect machine.

    ops = orders(train_step_1f1b, p=4, m=8)          # per rank: [("F", s, i), ...]
    events = ideal_events(train_step_1f1b, p=4, m=8)  # timeline events, no run needed
    events = play(ops, cost, waits)                   # given (e.g. recorded) orders
    timeline.bubble(events)["fraction"]               # == (p-1)/(m+p-1)
    timeline.gantt(events, "1F1B", legend=KINDS, label=micro_batch, scale=1)  # its chart

The schedule functions of ``labsupport.pipeline.pipeline`` (or the notebook's copies)
only call ``pp.forward(s, i)`` and ``pp.backward(s, i)``; here ``pp`` is an
``OrderRecorder`` that writes those calls down. With ``split=True`` the
backward is two calls, as in zero-bubble schedules (Qi et al., arXiv
2401.10241): ``pp.backward_input`` (B, which the previous stage waits for)
and ``pp.backward_weight`` (W, which nobody waits for); ``pp.backward`` is
then B followed by W. ``ideal_events`` then plays
them with fixed costs and free communication: each rank runs its calls in
order, each as soon as its input has arrived. It is the picture the bubble
formulas describe (GPipe, Huang et al. arXiv 1811.06965; interleaved 1F1B,
Narayanan et al. arXiv 2104.04473 Sec. 2.2), and it finds deadlocks: a rank
waiting for a message that no rank will send. ``play`` does the same for
orders given as lists (e.g. recorded on the ranks, with the messages each
call waited for): assignment 3's grader times a run's order in units so.
"""
from labsupport.timeline import Timeline, merge


class OrderRecorder:
    """Stands in for ``PipelineRank``: records the schedule's calls instead of running them."""

    def __init__(self, rank: int, world_size: int, m: int, v: int = 1, split: bool = False):
        if not (0 <= rank < world_size and m >= 1 and v >= 1):
            raise ValueError(f"need 0 <= rank < world_size, m >= 1, v >= 1; got rank={rank}, "
                             f"world_size={world_size}, m={m}, v={v}")
        self.rank, self.world_size, self.m, self.v = rank, world_size, m, v
        self.num_stages, self.split = world_size * v, split
        self.stages = {s: None for s in range(rank, self.num_stages, world_size)}  # like pp's
        self.ops: list[tuple] = []

    def forward(self, s, i):
        self.ops.append(("F", s, i))

    def backward(self, s, i):
        self.ops += [("B", s, i), ("W", s, i)] if self.split else [("B", s, i)]

    def backward_input(self, s, i):
        self.ops.append(("B", s, i))

    def backward_weight(self, s, i):
        self.ops.append(("W", s, i))


class IncompleteSchedule(ValueError):
    """A rank's schedule misses calls, or makes some twice or for another stage.

    ``rank``, ``missing`` and ``extra`` (lists of (kind, stage, micro-batch))
    are kept for callers that explain more (assignment 3's grader)."""

    def __init__(self, rank, kinds, stages, m, missing, extra):
        super().__init__(f"rank {rank}'s schedule must run {' and '.join(kinds)} of each "
                         f"of its stages {stages} for micro-batches 0..{m - 1} once each: "
                         f"missing {missing[:4]}, repeated or foreign {extra[:4]}")
        self.rank, self.missing, self.extra = rank, missing, extra


class ScheduleDeadlock(RuntimeError):
    """Every rank with calls left waits for a call no rank will make.

    ``stuck`` ({rank: the call it waits at}) and ``ops`` (every rank's orders)
    are kept for callers that explain more."""

    def __init__(self, stuck: dict, ops: list):
        super().__init__("deadlock: every rank waits for a call no rank will make: "
                         + ", ".join(f"rank {r} at {op}" for r, op in stuck.items()))
        self.stuck, self.ops = stuck, ops


def orders(schedule, p: int, m: int, v: int = 1, split: bool = False) -> list[list[tuple]]:
    """Each rank's calls, in order: ``[("F", stage, micro-batch), ("B", ...), ...]``
    (and ``("W", ...)`` with ``split``); ``IncompleteSchedule`` (a ValueError) if a rank
    misses one."""
    result = []
    for rank in range(p):
        recorder = OrderRecorder(rank, p, m, v, split)
        schedule(recorder)
        _check_complete(recorder)
        result.append(recorder.ops)
    return result


def _check_complete(rec: OrderRecorder):
    """Every stage of the rank does each micro-batch's forward and backward exactly once."""
    mine = range(rec.rank, rec.num_stages, rec.world_size)
    kinds = "FBW" if rec.split else "FB"
    want = sorted((k, s, i) for k in kinds for s in mine for i in range(rec.m))
    if sorted(rec.ops) != want:
        missing = sorted(set(want) - set(rec.ops))
        extra = sorted({op for op in rec.ops if rec.ops.count(op) > 1 or op not in want})
        raise IncompleteSchedule(rec.rank, kinds, list(mine), rec.m, missing, extra)


def needs(op, num_stages) -> list[tuple]:
    """The calls whose results ``op`` uses: its input message, its own forward (B),
    its own B (W)."""
    kind, s, i = op
    if kind == "F":
        return [("F", s - 1, i)] if s > 0 else []
    if kind == "W":
        return [("B", s, i)]
    after = ("B", s + 1, i) if s < num_stages - 1 else ("F", s, i)
    return [("F", s, i), after]


def ideal_events(schedule, p: int, m: int, v: int = 1, t_f: float = 1.0,
                 t_b: float = 2.0, durations: dict | None = None, split: bool = False,
                 t_w: float = 1.0) -> list[dict]:
    """Timeline events of ``schedule`` on an ideal machine (no run needed).

    A stage costs ``t_f / v`` forward and ``t_b / v`` backward (a rank's
    model is cut into v stages; with ``split``, B costs ``t_b / v`` and W
    ``t_w / v``), or ``durations[(kind, stage, mb)]`` seconds when given
    (e.g. those of a real run); messages are free. Raises a RuntimeError
    (``deadlock``) naming the stuck calls if the ranks' orders deadlock.
    """
    ops, n = orders(schedule, p, m, v, split), p * v
    unit = {"F": t_f, "B": t_b, "W": t_w}
    cost = durations or {op: unit[op[0]] / v for r in ops for op in r}
    return play(ops, cost, {op: needs(op, n) for r in ops for op in r})


def play(ops: list[list[tuple]], cost: dict, waits: dict) -> list[dict]:
    """Timeline events of given per-rank orders of calls on an ideal machine.

    ``ops[rank]``: the rank's calls in order, ``("F", stage, mb)`` etc. (e.g.
    as recorded on the ranks); ``cost[op]``: its duration; ``waits[op]``: the
    calls whose results it uses (``needs``, or the messages a run recorded).
    Each rank runs its calls in its order, each as soon as the rank is free
    and every call it waits for has ended; messages are free. Raises a
    RuntimeError (``deadlock``) naming the stuck calls when every rank with
    calls left waits for one that no rank will make.
    """
    p = len(ops)
    done, free, pos = {}, [0.0] * p, [0] * p
    tls = [Timeline(rank) for rank in range(p)]
    while any(pos[r] < len(ops[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(ops[r]) and all(d in done
                                               for d in waits[ops[r][pos[r]]]):
                kind, s, i = op = ops[r][pos[r]]
                start = max([free[r]] + [done[d] for d in waits[op]])
                free[r] = done[op] = start + cost[op]
                tls[r].record("compute", kind, start, free[r], mb=i, stage=s)
                pos[r], progressed = pos[r] + 1, True
        if not progressed:
            stuck = {r: ops[r][pos[r]] for r in range(p) if pos[r] < len(ops[r])}
            raise ScheduleDeadlock(stuck, ops)
    return merge([tl.events for tl in tls])


def message_plan(schedule, p: int, m: int, v: int = 1, rank: int = 0,
                 as_written: bool = False) -> list:
    """``rank``'s point-to-point messages, in one order that every rank shares.

    NCCL matches a receive with the next message its peer sends (no tags)
    and runs a group's operations one batch at a time, in the order they
    were posted: all ranks must post sends and receives in one order in
    which no two wait for each other. The ideal machine gives one: a
    message is due when the call that makes it ends on the ideal timeline.
    Returns the batches, [[(kind, stage, mb, grad, peer), ...], ...]: what
    the rank sends ("send", to ``stage``) and receives ("recv", for its
    ``stage``) at each moment, in time order, ties broken alike on every
    rank. Posting them in this order, each as soon as its sends are made,
    cannot deadlock: the earliest unfinished batch has been posted by every
    rank in it, since a rank waits only for a message due no earlier and
    so has made that batch's sends. ``as_written``: time the calls by their
    position alone, for a schedule that deadlocks anyway (it then hangs,
    for the graders' deadline to explain).
    """
    n = p * v
    events = _positions(schedule, p, m, v) if as_written else ideal_events(schedule, p, m, v)
    messages = sorted(
        (e["end"], e["stage"] + step, e["mb"], step < 0, e["rank"], (e["stage"] + step) % p)
        for e in events if e["name"] != "W"       # a weight gradient sends nothing
        for step in ((1,) if e["name"] == "F" else (-1,))
        if 0 <= e["stage"] + step < n)
    batches = {}
    for t, stage, mb, grad, src, dst in messages:
        for kind, me, peer in (("send", src, dst), ("recv", dst, src)):
            if me == rank:
                batches.setdefault(t, []).append((kind, stage, mb, grad, peer))
    return [batches[t] for t in sorted(batches)]


def _positions(schedule, p, m, v):
    """Each rank's calls timed by their position, one unit each."""
    return [dict(rank=r, name=kind, stage=s, mb=i, start=k, end=k + 1)
            for r, ops in enumerate(orders(schedule, p, m, v))
            for k, (kind, s, i) in enumerate(ops)]


def bubble_formula(p: int, m: int, v: int = 1) -> dict:
    """The bubble of GPipe / 1F1B (v = 1) and interleaved 1F1B (v stages per rank).

    ``ratio``: idle over ideal compute, (p-1)/(v·m) (Narayanan et al., arXiv
    2104.04473, Sec. 2.2); ``fraction``: idle over wall time, (p-1)/(v·m+p-1).
    """
    if min(p, m, v) < 1:
        raise ValueError(f"p, m and v must be at least 1, got p={p}, m={m}, v={v}")
    return dict(ratio=(p - 1) / (v * m), fraction=(p - 1) / (v * m + p - 1))


def stash_formula(schedule: str, p: int, m: int, v: int = 1, rank: int = 0) -> int:
    """Peak number of stashed micro-batch activations on ``rank`` (stage-sized for v = 1).

    GPipe: all m; 1F1B: p - rank (its warm-up plus one); interleaved: its
    warm-up 2(p-rank-1) + (v-1)p plus one, counted in stages of 1/v the size.
    """
    peaks = {"naive": 1, "afab": m, "1f1b": min(p - rank, m),
             "interleaved": min(2 * (p - rank - 1) + (v - 1) * p + 1, v * m)}
    if schedule not in peaks:
        raise ValueError(f"unknown schedule {schedule!r}: use one of {sorted(peaks)}")
    return peaks[schedule]


# How the charts of pipelines show each kind of event (timeline.gantt's ``legend``)
# (legend name, index of its colour in plots.PALETTE)
KINDS = {"F": ("forward", 0), "B": ("backward", 2), "recv": ("waiting in recv", 3),
         "post": ("posting messages", 4)}


def micro_batch(event) -> str:
    """The text on a pipeline chart's bar: its micro-batch (timeline.gantt's ``label``)."""
    return str(event.get("mb", ""))
