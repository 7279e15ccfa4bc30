"""labsupport.pipeline.checks, behind chapter 5's your-turn cells.

Run: .venv/bin/python -m pytest tests/test_chapter_pipeline.py   (one process)

The chapter's answers pass; each plausible mistake in 1F1B under a memory
budget (plain 1F1B ignoring the limit, a backward before its forward, an
operation missing, a budget kept but a backward later than needed) and a
bubble that counts waiting as work fail with a message that names the
mistake; an untouched stub is "not written yet".
"""
import pytest

import labsupport as ls
from labsupport import timeline
from labsupport.pipeline import checks, pipeline
from labsupport.pipeline import sim as pipeline_sim


def stub(*args):
    raise ls.NotWritten("stub")


def order_1f1b_capped(rank, world_size, m, limit):
    warmup = min(world_size - rank, limit, m) - 1
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


def order_1f1b(rank, world_size, m, limit):  # the budget ignored
    return order_1f1b_capped(rank, world_size, m, world_size)


def backward_first(rank, world_size, m, limit):
    order = order_1f1b_capped(rank, world_size, m, limit)
    return order[1:2] + order[:1] + order[2:] if m > 1 else order[::-1]


def one_missing(rank, world_size, m, limit):
    return order_1f1b_capped(rank, world_size, m, limit)[:-1]


def one_at_a_time(rank, world_size, m, limit):  # within budget, not as early
    return [(kind, i) for i in range(m) for kind in "FB"]


def bubble_fraction(events):
    ranks = sorted({e["rank"] for e in events})
    wall = max(e["end"] for e in events) - min(e["start"] for e in events)
    idle = [wall - sum(e["end"] - e["start"] for e in events
                       if e["rank"] == r and e["lane"] == "compute") for r in ranks]
    return sum(idle) / len(ranks) / wall


def bubble_every_lane_busy(events):
    ranks = sorted({e["rank"] for e in events})
    wall = max(e["end"] for e in events) - min(e["start"] for e in events)
    idle = [wall - sum(e["end"] - e["start"] for e in events if e["rank"] == r)
            for r in ranks]
    return sum(idle) / len(ranks) / wall


def test_1f1b_under_a_budget_right_and_each_mistake_named(capsys):
    checks.check_order_1f1b_capped(order_1f1b_capped)
    assert "✓ order_1f1b_capped" in capsys.readouterr().out
    mistakes = {order_1f1b: r"order_1f1b\(0, 2, 2, 1\): after operation 1 "
                            r"\('F', 1\) the rank stashes 2 .* over the limit of 1",
                backward_first: r"backward_first\(0, 2, 1, 1\): operation 0 is "
                                r"\('B', 0\) before \('F', 0\)",
                one_missing: r"one_missing\(0, 2, 1, 1\) must return each .* "
                             r"missing \[\('B', 0\)\]",
                one_at_a_time: r"one_at_a_time\(0, 2, 2, 2\): operation 1 is "
                               r"\('B', 0\), expected \('F', 1\)"}
    for fn, message in mistakes.items():
        with pytest.raises(AssertionError, match=message):
            checks.order_1f1b_capped(fn)


def test_a_budget_of_p_minus_rank_is_1f1b_and_a_smaller_one_costs_bubble():
    for rank in range(4):
        plain = [(k, i) for k, _, i in
                 pipeline_sim.orders(pipeline.train_step_1f1b, 4, 8)[rank]]
        assert order_1f1b_capped(rank, 4, 8, 4 - rank) == plain
    fractions = [timeline.bubble(pipeline_sim.ideal_events(
        capped(limit), 4, 8))["fraction"] for limit in (1, 2, 3, 4)]
    assert fractions == sorted(fractions, reverse=True) and fractions[0] > fractions[-1]


def capped(limit):
    def train_step(pp):
        for kind, i in order_1f1b_capped(pp.rank, pp.world_size, pp.m, limit):
            (pp.forward if kind == "F" else pp.backward)(pp.rank, i)
    return train_step


def test_the_bubble_right_and_counting_waits_as_work(capsys):
    checks.check_bubble(bubble_fraction)
    assert "✓ bubble_fraction" in capsys.readouterr().out
    with pytest.raises(AssertionError, match=r"'compute' lane"):
        checks.bubble(bubble_every_lane_busy)
    events = pipeline_sim.ideal_events(pipeline.train_step_afab, 4, 4)
    assert bubble_fraction(events) == pytest.approx(timeline.bubble(events)["fraction"])


@pytest.mark.parametrize("check", [checks.check_order_1f1b_capped, checks.check_bubble],
                         ids=["order", "bubble"])
def test_an_untouched_stub_is_not_written_yet_not_a_failure(check, capsys):
    assert check(stub) is None
    assert "not written yet" in capsys.readouterr().out
