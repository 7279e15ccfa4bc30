"""labsupport.grading.chapters.pipeline, behind chapter 5's your-turn cells.

Run: .venv/bin/python -m pytest tests/test_chapter_pipeline.py   (one process)

The chapter's answers pass; GPipe's order instead of 1F1B's and a bubble
that counts waiting as work each fail with a message that names the
mistake; an untouched stub is "not written yet".
"""
import pytest

import labsupport as ls
from labsupport import pipeline, pipeline_sim, timeline
from labsupport.grading.chapters import pipeline as checks


def stub(*args):
    raise ls.NotWritten("stub")


def order_1f1b(rank, world_size, m):
    warmup = min(world_size - rank - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


def order_gpipe(rank, world_size, m):
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


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


def test_the_order_of_1f1b_right_and_gpipe_instead(capsys):
    checks.check_order_1f1b(order_1f1b)
    assert "✓ order_1f1b" in capsys.readouterr().out
    with pytest.raises(AssertionError, match=r"order_gpipe\(1, 2, 2\): operation 1 is "
                                             r"\('F', 1\), expected \('B', 0\)"):
        checks.order_1f1b(order_gpipe)
    assert order_1f1b(0, 4, 8) == [(k, i) for k, _, i in
                                   pipeline_sim.orders(pipeline.train_step_1f1b, 4, 8)[0]]


def test_the_bubble_right_and_counting_waits_as_work(capsys):
    checks.check_bubble(bubble_fraction)
    assert "✓ bubble_fraction" in capsys.readouterr().out
    with pytest.raises(AssertionError, match=r"'compute' lane"):
        checks.bubble(bubble_every_lane_busy)
    events = pipeline_sim.ideal_events(pipeline.train_step_afab, 4, 4)
    assert bubble_fraction(events) == pytest.approx(timeline.bubble(events)["fraction"])


@pytest.mark.parametrize("check", [checks.check_order_1f1b, checks.check_bubble],
                         ids=["order", "bubble"])
def test_an_untouched_stub_is_not_written_yet_not_a_failure(check, capsys):
    assert check(stub) is None
    assert "not written yet" in capsys.readouterr().out
