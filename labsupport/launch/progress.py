"""Is a run of ranks still working? Their CPU time and thread states, read from /proc.

    watch = Watch(pids, WorkDeadline(stall=20, cpu=60, ceiling=600))
    reason = watch.check()      # None while it may go on; else why it must stop

A deadline in wall-clock seconds cannot tell a deadlock from a slow answer on
a busy machine: under load a correct run takes longer, and a flat deadline
sized for an idle laptop calls it a deadlock on a class hub (issue 34). What
load cannot fake is progress, as the operating system sees it:

- a rank that computes is running or runnable (state ``R``), or it consumes
  CPU time; starved by a busy machine, it is still runnable, waiting for a
  core, and it is charged no CPU time for the wait;
- a rank in a deadlock sleeps (state ``S``) in a receive, a send or a
  collective that nothing will ever complete, and consumes no CPU time;
  neither do its peers, which sleep too or have returned.

So a run is declared a deadlock (``stall``) only when every rank that has
not answered has consumed (next to) no CPU time for ``stall`` seconds and none
of their threads is runnable or in uninterruptible I/O (``D``, a disk or a
network file system) when it is declared: nothing on those ranks can move.
Load lengthens how long a run computes, never how long all of its ranks
sleep together. A run that never stops computing (an endless loop) is
stopped once one rank has used ``cpu`` seconds of CPU time: work, which a
rank starved of the CPU does not accrue. ``ceiling`` (wall clock) is the
last resort for what neither reading can see (a rank stuck in ``D``, or no
/proc to read), set well beyond both.

The CPU time of a thread comes from ``/proc/<pid>/task/<tid>/schedstat``
(nanoseconds), else from ``stat``'s ``utime + stime`` (clock ticks); a
thread that ends takes its time with it, so a change of a rank's total, up
or down, counts. A sleeping rank still wakes now and then (the launcher's
parent watchdog, once a second; gloo's own threads): measured here, a rank
of a deadlocked reduce-scatter used 1 ms of CPU per second, 0.1% of a core.
A rank counts as active once it used more than ``IDLE_CPU_RATE`` (1% of a
core, ten times that) since the stall began, plus ``IDLE_CPU`` for the
granularity of a reading; a computing rank, even sharing its core with
ninety-nine busy processes, reaches that, and is runnable at nearly every
reading besides.

gloo's transport threads (``gloo_tcp_loop``, ``TRANSPORT``) are left out of
both readings: in a deadlock where a peer has sent bytes that no posted
receive will take (a collective that one side of a group skipped), gloo's
event loop can spin on them, level-triggered epoll reporting the same
socket again and again (``gloo/transport/tcp/pair.cc``, ``handleEvents``):
measured here, 7.6 s of CPU in 90 s on each of the two stuck ranks of
assignment 4's deadlock while their Python threads slept, which made that
deadlock look like work until the last-resort ceiling. What a rank computes
runs on its Python thread, torch's intra-op threads and gloo's collective
workers (``pt_gloo_runloop``), which are all still read; bytes in flight
alone, with every one of those asleep, are not progress a graded run makes
(its tensors are small; a transfer of ``stall`` seconds would not be).
"""
import os
import time
from dataclasses import dataclass

IDLE_CPU_RATE = 0.01  # CPU s per s a waiting rank may use (it used 0.001 here)
IDLE_CPU = 0.005      # s of CPU time on top: a reading's granularity (a clock tick)
POLL = 0.1            # s between two readings
TRANSPORT = ("gloo_tcp_loop",)  # threads that move bytes, not work (see above)


@dataclass(frozen=True)
class WorkDeadline:
    """When a run of ranks is stopped: ``stall`` seconds with every rank still
    running idle (no CPU time, nothing runnable), ``cpu`` seconds of CPU time
    used by one rank, or ``ceiling`` seconds of wall clock, the last resort."""
    stall: float
    cpu: float
    ceiling: float


@dataclass(frozen=True)
class Reading:
    cpu: dict        # pid -> CPU seconds of its threads alive now (None: gone)
    busy: bool       # a thread of one of the pids is runnable or in I/O (R, D)


def read(pids) -> Reading:
    """The CPU time and whether any thread is runnable, for each of ``pids``."""
    cpu, busy = {}, False
    for pid in pids:
        total, tasks = 0.0, f"/proc/{pid}/task"
        try:
            tids = os.listdir(tasks)
        except OSError:  # gone (its death is the launcher's to report) or no /proc
            cpu[pid] = None
            continue
        for tid in tids:
            seconds, state, name = _thread(f"{tasks}/{tid}")
            if name in TRANSPORT:
                continue
            total += seconds
            busy = busy or state in ("R", "D")
        cpu[pid] = total
    return Reading(cpu, busy)


def _thread(path):
    """(CPU seconds, state letter, name) of one thread; (0, '', '') if it just
    ended."""
    try:
        with open(f"{path}/stat") as f:
            stat = f.read()
    except OSError:
        return 0.0, "", ""
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()  # after 'pid (comm) '
    state = fields[0]
    try:
        with open(f"{path}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9, state, name
    except (OSError, ValueError, IndexError):  # no schedstat: clock ticks
        return (int(fields[11]) + int(fields[12])) / _TICKS, state, name


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class Watch:
    """Readings of the ranks still running, and the verdict of ``WorkDeadline``.

    ``check(pending)`` with the pids that have not answered yet returns None,
    or "stall", "cpu" or "ceiling"; ``stalled_for`` and ``cpu_used`` say how
    much, for the message."""

    def __init__(self, pids, deadline: WorkDeadline, clock=time.monotonic, reader=read):
        self.deadline, self.clock, self.reader = deadline, clock, reader
        self.started = clock()
        self.base = dict(reader(pids).cpu)           # pid -> CPU s at the start
        self.stall_since, self.stall_cpu = self.started, dict(self.base)
        self.stalled_for = 0.0
        self.cpu_used = 0.0

    def check(self, pending) -> str | None:
        now = self.clock()
        if now - self.started >= self.deadline.ceiling:
            return "ceiling"
        reading = self.reader(pending)
        used = {pid: c - (self.base.get(pid) or 0.0) for pid, c in reading.cpu.items()
                if c is not None}
        self.cpu_used = max(used.values(), default=0.0)
        if self.cpu_used >= self.deadline.cpu:
            return "cpu"
        allowed = IDLE_CPU + IDLE_CPU_RATE * (now - self.stall_since)
        # A rank that answered leaves the set: what is left starts a new stall.
        if set(reading.cpu) != set(self.stall_cpu) or any(
                c is None or self.stall_cpu[pid] is None
                or abs(c - self.stall_cpu[pid]) > allowed
                for pid, c in reading.cpu.items()):
            self.stall_since, self.stall_cpu = now, dict(reading.cpu)
        self.stalled_for = now - self.stall_since
        if self.stalled_for >= self.deadline.stall and not reading.busy:
            return "stall"
        return None
