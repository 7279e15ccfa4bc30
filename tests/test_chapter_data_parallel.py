"""labsupport.data_parallel.checks, behind chapter 3's your-turn cells.

Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_chapter_data_parallel.py

The chapter's answers (``ddp.broadcast_parameters``, ``ddp.bucket_params``)
pass; broadcasting the parameters but not the buffers, closing a bucket one
parameter early and reordering the parameters each fail with a message that
names the mistake; an untouched stub is "not written yet".
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import labsupport as ls
from labsupport.data_parallel import checks, ddp

cloudpickle.register_pickle_by_value(sys.modules[__name__])


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


def test_broadcasting_parameters_and_buffers_passes_parameters_only_does_not(capsys):
    checks.check_broadcast(ddp.broadcast_parameters)
    assert "✓ broadcast_parameters" in capsys.readouterr().out
    with pytest.raises(AssertionError, match=r"rank 1 the buffer '2\.running_mean'"):
        checks.broadcast(broadcast_params_only)


def test_bucket_assignment_right_and_one_parameter_early(capsys):
    checks.check_buckets(ddp.bucket_params)
    assert "✓ bucket_params" in capsys.readouterr().out
    with pytest.raises(AssertionError, match=r"(?s)\(params, 528\).*expected \[\[16, 512\]"):
        checks.buckets(buckets_at_or_past)
    with pytest.raises(AssertionError, match=r"every parameter once, in the order given"):
        checks.buckets(lambda params, size: [params[::-1]])


@pytest.mark.parametrize("check", [checks.check_broadcast, checks.check_buckets],
                         ids=["broadcast", "buckets"])
def test_an_untouched_stub_is_not_written_yet_not_a_failure(check, capsys):
    assert check(stub) is None
    assert "not written yet" in capsys.readouterr().out
