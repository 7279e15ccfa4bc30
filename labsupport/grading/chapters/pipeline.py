"""Chapter 5's your-turn checks: the bubble read from a timeline, 1F1B's order on a rank.

    from labsupport.grading.chapters import pipeline as checks
    checks.check_bubble(bubble_fraction)        # in chapter 5's check cells
    checks.check_order_1f1b(order_1f1b)

``check_bubble`` runs the reader's function on the ideal timelines of three
schedules (with waits on another lane, which are not work) and compares it
with ``timeline.bubble``; ``check_order_1f1b`` compares the reader's order
with the one ``pipeline.train_step_1f1b`` plays, on every rank of 2 to 4
stages and 1 to 8 micro-batches, and shows the first operation that
differs. Until the function is written, a check says so without failing.
"""
from labsupport import your_turn


def _name(fn) -> str:
    return getattr(fn, "__name__", "the function")


def _reference_order(rank, world_size, m):
    from labsupport import pipeline, pipeline_sim
    recorder = pipeline_sim.OrderRecorder(rank, world_size, m)
    pipeline.train_step_1f1b(recorder)
    return [(kind, i) for kind, _, i in recorder.ops]


def _first_difference(got, want) -> int:
    return next((k for k, (a, b) in enumerate(zip(got, want)) if a != b),
                min(len(got), len(want)))


def order_1f1b(fn):
    """``fn(rank, world_size, m)`` is 1F1B's list of ("F", i) and ("B", i) on that rank."""
    for world_size in (2, 3, 4):
        for m in (1, 2, 4, 8):
            for rank in range(world_size):
                got, want = list(fn(rank, world_size, m)), _reference_order(rank, world_size, m)
                if got == want:
                    continue
                k = _first_difference(got, want)
                warmup = min(world_size - rank - 1, m)
                mine = got[k] if k < len(got) else "missing"
                theirs = want[k] if k < len(want) else "nothing"
                raise AssertionError(
                    f"{_name(fn)}({rank}, {world_size}, {m}): operation {k} is "
                    f"{mine}, expected {theirs} (you returned {len(got)} operations, "
                    f"1F1B has {2 * m}).\n  got      {got}\n  expected {want}\n"
                    f"Rank {rank} of {world_size} runs {warmup} warm-up forwards, then "
                    f"one forward and one backward {m - warmup} times, then the "
                    f"{warmup} remaining backwards.")


def check_order_1f1b(fn):
    """The check cell of ``order_1f1b``."""
    return your_turn.check(lambda: order_1f1b(fn), _name(fn),
                           "1F1B's order, every rank, p = 2..4, m = 1..8")


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


def check_bubble(fn):
    """The check cell of ``bubble_fraction``."""
    return your_turn.check(lambda: bubble(fn), _name(fn),
                           "GPipe, 1F1B, interleaved ideal charts")
