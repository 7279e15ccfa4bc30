"""The deadline a user gives is the only one: the ranks' collectives never give up before it.

Whichever way a group was started or a call was given its deadline
(``ls.start(timeout=)``, ``ls.run(timeout=)``, ``%%ranks -t``, the grader), the
process group of the ranks, and every group they make, waits at least as long
as the call may run. (Before, the group waited max(1800 s, the group's own
deadline), so a collective gave up after 30 minutes inside a call allowed an hour.)

Run: .venv/bin/python -m pytest tests/test_launcher_deadlines.py
"""
import os

import pytest

import labsupport as ls
from labsupport.launch import ipython, limits, progress

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


# -- a deadline sized from the work (progress.WorkDeadline, the graders') --------------
# A deadlock is every rank still running waiting, using no CPU time; an endless loop,
# CPU time; load lengthens neither. First the verdicts on made-up readings (a clock
# and /proc as the test says), then on real ranks.

class Machine:
    """A clock and readings the test moves: ``cpu`` {pid: CPU s}, ``busy`` (R or D)."""

    def __init__(self, pids=(1, 2)):
        self.now, self.cpu, self.busy = 0.0, dict.fromkeys(pids, 0.0), False

    def clock(self):
        return self.now

    def read(self, pids):
        return progress.Reading({p: self.cpu[p] for p in pids}, self.busy)

    def watch(self, stall=3.0, cpu=9.0, ceiling=90.0):
        deadline = progress.WorkDeadline(stall, cpu, ceiling)
        return progress.Watch(list(self.cpu), deadline, clock=self.clock,
                              reader=self.read)

    def advance(self, watch, seconds, cpu_per_s=None, pending=None, step=0.25):
        """Time passes in readings ``step`` s apart (exact in binary); each pid gains
        ``cpu_per_s`` {pid: rate}. Returns (the verdict, the time it came)."""
        verdict = None
        for _ in range(round(seconds / step)):
            self.now += step
            for pid, rate in (cpu_per_s or {}).items():
                self.cpu[pid] += rate * step
            verdict = watch.check(self.cpu if pending is None else pending)
            if verdict:
                return verdict, self.now
        return verdict, self.now


def test_ranks_that_all_wait_using_no_cpu_are_a_deadlock_after_the_stall():
    m = Machine()
    w = m.watch(stall=3.0)
    # a waiting rank still wakes now and then: 1 ms of CPU per second, as measured
    verdict, at = m.advance(w, 10, {1: 0.001, 2: 0.001})
    assert verdict == "stall" and at == pytest.approx(3.0)


def test_a_rank_that_computes_starved_of_cpu_is_never_a_deadlock():
    """One rank computes with 2% of a core (a core shared with 49 busy processes), the
    other waits for it: for ten times the stall, nothing is declared; the CPU time
    it used is far below the budget, which counts work, not waiting."""
    m = Machine()
    w = m.watch(stall=3.0, cpu=9.0)
    assert m.advance(w, 30, {1: 0.02, 2: 0.001}) == (None, pytest.approx(30.0))
    assert w.cpu_used == pytest.approx(0.6)


def test_a_runnable_rank_postpones_a_deadlock_that_its_cpu_time_does_not_show():
    """A rank waiting for a core (R) has not run yet: no CPU time, but not waiting."""
    m = Machine()
    w = m.watch(stall=3.0)
    m.busy = True
    assert m.advance(w, 10) == (None, pytest.approx(10.0))
    m.busy = False
    assert m.advance(w, 1)[0] == "stall"


def test_a_rank_that_answers_starts_the_stall_anew():
    m = Machine()
    w = m.watch(stall=3.0)
    assert m.advance(w, 2)[0] is None
    assert m.advance(w, 2, pending=[2]) == (None, pytest.approx(4.0))  # rank 1 answered
    assert m.advance(w, 3, pending=[2]) == ("stall", 5.25)     # 3 s after 2.25


def test_an_endless_loop_is_stopped_by_its_cpu_time_and_anything_else_by_the_ceiling():
    m = Machine()
    w = m.watch(stall=3.0, cpu=9.0, ceiling=90.0)
    verdict, at = m.advance(w, 60, {1: 0.5})     # half a core: 9 CPU s after 18 s
    assert verdict == "cpu" and at == pytest.approx(18.0) and w.cpu_used >= 9.0
    m = Machine()
    w = m.watch(stall=3.0, cpu=9.0, ceiling=90.0)
    m.busy = True                                 # in I/O (D): no CPU, not waiting
    assert m.advance(w, 100) == ("ceiling", pytest.approx(90.0))


def test_a_process_that_sleeps_reads_idle_and_one_that_spins_reads_busy():
    import subprocess
    import sys
    import time
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)                           # both past their start
        first = progress.read([sleeper.pid, spinner.pid])
        time.sleep(0.5)
        second = progress.read([sleeper.pid, spinner.pid])
        assert second.cpu[sleeper.pid] - first.cpu[sleeper.pid] < 0.005
        assert second.cpu[spinner.pid] > first.cpu[spinner.pid]
        assert not progress.read([sleeper.pid]).busy
        assert progress.read([spinner.pid]).busy
        gone = 2 ** 22 + 1                        # no such process
        assert progress.read([gone]).cpu == {gone: None}
    finally:
        for p in (sleeper, spinner):
            p.kill()
            p.wait()


SPIN_AS_GLOO = """
import ctypes, threading, time
def spin():
    ctypes.CDLL(None).prctl(15, b"gloo_tcp_loop")   # PR_SET_NAME: gloo's loop thread
    while True:
        pass
threading.Thread(target=spin, daemon=True).start()
time.sleep(60)                                      # the rank's own thread waits
"""


def test_gloo_spinning_on_its_socket_is_not_work_but_the_ranks_own_threads_are():
    """A deadlocked rank whose gloo event loop spins (the peer's unread bytes,
    level-triggered epoll; measured on assignment 4's deadlock) reads idle."""
    import subprocess
    import sys
    import time
    spinner = subprocess.Popen([sys.executable, "-c", SPIN_AS_GLOO])
    try:
        time.sleep(1.0)
        first = progress.read([spinner.pid])
        time.sleep(0.5)
        second = progress.read([spinner.pid])
        assert second.cpu[spinner.pid] - first.cpu[spinner.pid] < 0.005
        assert not progress.read([spinner.pid]).busy
        names = {open(f"/proc/{spinner.pid}/task/{t}/comm").read().strip()
                 for t in os.listdir(f"/proc/{spinner.pid}/task")}
        assert "gloo_tcp_loop" in names           # the thread is there, and spinning
    finally:
        spinner.kill()
        spinner.wait()


def burn_then_return(seconds):
    """On a rank: compute for ``seconds`` of this thread's CPU time, then return the
    rank. Wall time >= CPU time, so it runs longer than ``seconds`` on any machine."""
    import time

    import torch.distributed as dist
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass
    return dist.get_rank()


def rank_1_computes_while_rank_0_waits(seconds):
    import torch
    import torch.distributed as dist
    x = torch.zeros(1)
    if dist.get_rank() == 1:
        burn_then_return(seconds)
        dist.send(x + 1, 0)
    else:
        dist.recv(x, 1)                           # waits, using no CPU, the whole time
    return x.item()


def waits_forever():
    import torch
    import torch.distributed as dist
    dist.recv(torch.zeros(1), 1 - dist.get_rank())     # both receive: nobody sends


def test_a_run_that_computes_longer_than_the_stall_is_not_stopped(cluster):
    deadline = progress.WorkDeadline(stall=1.0, cpu=10.0, ceiling=120.0)
    assert cluster.run(burn_then_return, 2.0, timeout=deadline) == [0, 1]
    assert cluster.run(rank_1_computes_while_rank_0_waits, 2.0,
                       timeout=deadline) == [1, 0]


def test_a_deadlock_is_stopped_after_the_stall_and_a_loop_by_its_cpu_time(cluster):
    with pytest.raises(ls.RankTimeout, match="all waited, using no CPU time") as info:
        cluster.run(waits_forever, timeout=progress.WorkDeadline(1.0, 10.0, 120.0))
    assert info.value.reason == "stall"
    with pytest.raises(ls.RankTimeout, match="their 1.5 s of CPU time") as info:
        cluster.run(burn_then_return, 60.0,
                    timeout=progress.WorkDeadline(30.0, 1.5, 120.0))
    assert info.value.reason == "cpu"
    assert cluster.run(burn_then_return, 0.0) == [0, 1]            # fresh ranks work


def test_the_graders_deadline_is_sized_from_the_one_they_are_given():
    assert limits.grading_deadline(20) == progress.WorkDeadline(20.0, 60.0, 600.0)
    assert limits.grading_deadline(2).cpu == 6.0
    with pytest.raises(ValueError, match="positive number of seconds"):
        limits.grading_deadline(0)
