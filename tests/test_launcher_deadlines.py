"""The deadline a user gives is the only one: the ranks' collectives never give up before it.

Whichever way a group was started or a call was given its deadline
(``ls.start(timeout=)``, ``ls.run(timeout=)``, ``%%ranks -t``, the grader), the
process group of the ranks, and every group they make, waits at least as long
as the call may run. (Before, the group waited max(1800 s, the group's own
deadline), so a collective gave up after 30 minutes inside a call allowed an hour.)

Run: .venv/bin/python -m pytest tests/test_launcher_deadlines.py
"""
import pytest

import labsupport as ls
from labsupport.launch import ipython, limits

HOUR = 3600.0


def collective_timeouts() -> list[float]:
    """On a rank: seconds its collectives wait, in the default group and in a new one."""
    import torch
    import torch.distributed as dist

    groups = [dist.group.WORLD, dist.new_group(list(range(dist.get_world_size())))]
    device = torch.device(ls.device().type)  # the backend of this device: gloo or NCCL
    return [g._get_backend(device).options._timeout.total_seconds() for g in groups]


@pytest.fixture
def cluster():
    c = ls.current()
    return c if c is not None and c.world_size == 2 else ls.start(world_size=2)


def test_a_run_given_an_hour_has_collectives_that_wait_an_hour(cluster):
    for timeouts in cluster.run(collective_timeouts, timeout=HOUR):
        assert min(timeouts) >= HOUR


def test_ls_run_with_a_long_deadline(cluster):
    for timeouts in ls.run(collective_timeouts, world_size=2, timeout=2 * HOUR):
        assert min(timeouts) >= 2 * HOUR


def test_a_group_started_with_the_longest_deadline_allowed():
    with ls.start(world_size=2, timeout=limits.MAX_TIMEOUT) as cluster:
        for timeouts in cluster.run(collective_timeouts):
            assert min(timeouts) >= limits.MAX_TIMEOUT


def test_a_ranks_cell_with_a_long_deadline(cluster):
    line = f"-n 2 -t {HOUR:g}"
    values = ipython.ranks(line, "from test_launcher_deadlines import collective_timeouts\n"
                                 "collective_timeouts()")
    assert all(min(timeouts) >= HOUR for timeouts in values)


def test_the_grader_with_a_long_deadline(cluster):
    calls = ls.grading.run(collective_timeouts, world_size=2, timeout=HOUR)
    assert all(min(c["value"]) >= HOUR for c in calls)


def test_a_deadline_beyond_the_longest_is_refused_with_the_limit(cluster):
    with pytest.raises(ValueError, match="longer than labsupport allows"):
        ls.start(world_size=2, timeout=limits.MAX_TIMEOUT * 2)
    with pytest.raises(ValueError, match="longer than labsupport allows"):
        cluster.run(collective_timeouts, timeout=limits.MAX_TIMEOUT * 2)
    assert ls.current() is cluster, "a refused start leaves the running group alone"
