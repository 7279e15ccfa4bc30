"""Chapter 5's your-turn checks: the bubble read from a timeline, 1F1B under a memory budget.

    from labsupport.pipeline import checks
    checks.check_bubble(bubble_fraction)        # in chapter 5's check cells
    checks.check_order_1f1b_capped(order_1f1b_capped)

``check_bubble`` runs the reader's function on the ideal timelines of three
schedules (with waits on another lane, which are not work) and compares it
with ``timeline.bubble``; ``check_order_1f1b_capped`` checks the reader's
order of 1F1B with at most ``limit`` micro-batches stashed on a rank (an F
stashes its micro-batch, the B of that micro-batch frees it), on every rank
of 2 to 4 stages, 1 to 8 micro-batches and limits 1 to p + 1: each of the
2m operations once, no B before its F, the stash within the limit after
every operation, then the first operation that runs later (or earlier)
than it could. Until the function is written, a check says so without
failing.
"""
from labsupport import your_turn
from labsupport.checking.diagnosis import name_of


def _order_1f1b(rank, world_size, m):
    from labsupport.pipeline import pipeline
    from labsupport.pipeline import sim as pipeline_sim
    recorder = pipeline_sim.OrderRecorder(rank, world_size, m)
    pipeline.train_step_1f1b(recorder)
    return [(kind, i) for kind, _, i in recorder.ops]


def _reference_capped(rank, world_size, m, limit):
    # 1F1B's rank r peaks at p - r stashed; a budget of `limit` < p - r makes
    # rank r run the order of the 1F1B rank that peaks at `limit`: p - limit.
    return _order_1f1b(max(rank, world_size - limit), world_size, m)


def _call(fn, rank, world_size, m, limit) -> str:
    return f"{name_of(fn)}({rank}, {world_size}, {m}, {limit})"


def _all_once(got, m, where):
    want = [(kind, i) for kind in "FB" for i in range(m)]
    missing = [op for op in want if op not in got]
    extra = [op for k, op in enumerate(got) if op not in want or op in got[:k]]
    if missing or extra:
        raise AssertionError(
            f"{where} must return each of ('F', i) and ('B', i) for i = 0..{m - 1} "
            f"exactly once ({2 * m} operations, tuples of 'F' or 'B' and an int); "
            f"you returned {len(got)}: missing {missing[:4]}, repeated or foreign "
            f"{extra[:4]}.\n  got {got}")


def _within_budget(got, limit, where):
    stash = []  # micro-batches whose activations this rank holds
    for k, (kind, i) in enumerate(got):
        if kind == "F":
            stash.append(i)
        elif i not in stash:
            raise AssertionError(
                f"{where}: operation {k} is ('B', {i}) before ('F', {i}): a backward "
                f"needs its micro-batch's activations, stashed by its forward.\n"
                f"  got {got}")
        else:
            stash.remove(i)
        if len(stash) > limit:
            raise AssertionError(
                f"{where}: after operation {k} {(kind, i)} the rank stashes "
                f"{len(stash)} micro-batches {stash}, over the limit of {limit}. "
                f"An F stashes its micro-batch, the B of that micro-batch frees it; "
                f"run a backward before this forward.\n  got {got}")


def order_1f1b_capped(fn):
    """``fn(rank, world_size, m, limit)``: 1F1B's order with at most ``limit`` stashed."""
    for world_size in (2, 3, 4):
        for m in (1, 2, 4, 8):
            for limit in range(1, world_size + 2):
                for rank in range(world_size):
                    _one_case(fn, rank, world_size, m, limit)


def _one_case(fn, rank, world_size, m, limit):
    where = _call(fn, rank, world_size, m, limit)
    got = [tuple(op) if isinstance(op, (tuple, list)) else op
           for op in fn(rank, world_size, m, limit)]
    _all_once(got, m, where)
    _within_budget(got, limit, where)
    want = _reference_capped(rank, world_size, m, limit)
    if got == want:
        return
    k = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
    peak = min(world_size - rank, limit, m)
    raise AssertionError(
        f"{where}: operation {k} is {got[k]}, expected {want[k]}.\n"
        f"  got      {got}\n  expected {want}\n"
        f"Every operation as early as 1F1B allows within the budget: rank {rank} "
        f"of {world_size} stashes at most min(p - rank, limit, m) = {peak}, so it "
        f"runs {peak - 1} warm-up forward(s) before its first backward, then one forward "
        f"and one backward, then the remaining backwards.")


def check_order_1f1b_capped(fn):
    """The check cell of ``order_1f1b_capped``."""
    return your_turn.check(lambda: order_1f1b_capped(fn), name_of(fn),
                           "every rank, p = 2..4, m = 1..8, limit = 1..p+1")


def bubble(fn):
    """``fn(events)`` is the mean idle fraction of the wall time, as ``timeline.bubble``."""
    from labsupport import timeline
    from labsupport.pipeline import pipeline
    from labsupport.pipeline import sim as pipeline_sim
    cases = [(pipeline.train_step_afab, 4, 4, 1), (pipeline.train_step_1f1b, 2, 8, 1),
             (pipeline.train_step_interleaved, 4, 8, 2)]
    for schedule, p, m, v in cases:
        events = pipeline_sim.ideal_events(schedule, p, m, v, t_f=1.0, t_b=2.0)
        events += [dict(e, lane="wait", name="recv") for e in events[:3]]  # not compute
        got, want = fn(events), timeline.bubble(events)["fraction"]
        if abs(got - want) > 1e-9:
            raise AssertionError(
                f"{name_of(fn)} on the ideal {schedule.__name__} (p={p}, m={m}, v={v}) gave "
                f"{got:.4f}; the idle fraction is {want:.4f} = (p-1)/(vm+p-1) = "
                f"{(p - 1) / (v * m + p - 1):.4f}. Per rank: wall time (first start to "
                "last end, over all ranks) minus the rank's time on the 'compute' lane, "
                "over the wall time; then the mean over the ranks. Events on other "
                "lanes (waiting in recv) are not compute.")


def check_bubble(fn):
    """The check cell of ``bubble_fraction``."""
    return your_turn.check(lambda: bubble(fn), name_of(fn),
                           "GPipe, 1F1B, interleaved ideal charts")
