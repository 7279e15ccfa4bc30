"""labsupport.chapter_checks, behind the chapters' your-turn cells: a right and a wrong answer each.

Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_chapter_checks.py
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import labsupport as ls
from labsupport import chapter_checks as cc
from labsupport import ddp, pipeline, pipeline_sim, timeline

cloudpickle.register_pickle_by_value(sys.modules[__name__])


# -- right answers (the chapters' reference solutions) and plausible wrong ones --------

def stub(*args):
    raise ls.NotWritten("stub")


def broadcast_params_only(module):
    with torch.no_grad():
        for param in module.parameters():
            dist.broadcast(param, src=0)


def buckets_at_or_past(params, bucket_size):
    """Closes a bucket when it reaches bucket_size, one parameter early."""
    buckets, size = [[]], 0
    for param in params:
        nbytes = param.numel() * param.element_size()
        if buckets[-1] and size + nbytes >= bucket_size:
            buckets, size = buckets + [[]], 0
        buckets[-1].append(param)
        size += nbytes
    return buckets


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


# -- the checks ------------------------------------------------------------------------

@pytest.mark.parametrize("check", [
    lambda: cc.broadcast(stub),
    lambda: cc.buckets(stub),
    lambda: cc.order_1f1b(stub),
    lambda: cc.bubble(stub),
], ids=["broadcast", "buckets", "order", "bubble"])
def test_an_untouched_stub_is_not_written_yet_not_a_failure(check, capsys):
    assert ls.your_turn.check(check, "stub") is None
    assert "not written yet" in capsys.readouterr().out


def test_broadcasting_parameters_and_buffers_passes_parameters_only_does_not():
    cc.broadcast(ddp.broadcast_parameters)
    with pytest.raises(AssertionError, match=r"rank 1 the buffer '2\.running_mean'"):
        cc.broadcast(broadcast_params_only)


def test_bucket_assignment_right_and_one_parameter_early():
    cc.buckets(ddp.bucket_params)
    with pytest.raises(AssertionError, match=r"(?s)\(params, 528\).*expected \[\[16, 512\]"):
        cc.buckets(buckets_at_or_past)
    with pytest.raises(AssertionError, match=r"every parameter once, in the order given"):
        cc.buckets(lambda params, size: [params[::-1]])


def test_the_order_of_1f1b_right_and_gpipe_instead():
    cc.order_1f1b(order_1f1b)
    with pytest.raises(AssertionError, match=r"order_gpipe\(1, 2, 2\): operation 1 is "
                                             r"\('F', 1\), expected \('B', 0\)"):
        cc.order_1f1b(order_gpipe)
    assert order_1f1b(0, 4, 8) == [(k, i) for k, _, i in
                                   pipeline_sim.orders(pipeline.train_step_1f1b, 4, 8)[0]]


def test_the_bubble_right_and_counting_waits_as_work():
    cc.bubble(bubble_fraction)
    with pytest.raises(AssertionError, match=r"'compute' lane"):
        cc.bubble(bubble_every_lane_busy)
    events = pipeline_sim.ideal_events(pipeline.train_step_afab, 4, 4)
    assert bubble_fraction(events) == pytest.approx(timeline.bubble(events)["fraction"])
