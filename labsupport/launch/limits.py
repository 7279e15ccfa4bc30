"""Every bound of the launcher, and its check, in one place.

Deadlines (seconds): a run's ``DEFAULT_TIMEOUT`` unless ``ls.start(timeout=)``,
``ls.run(timeout=)``, ``%%ranks -t`` or the grader says otherwise
(``grading_timeout``, made a ``grading_deadline``: a stall, CPU time and a
ceiling, see ``progress``); ``START_TIMEOUT`` for ranks to come up; ``GRACE`` for the
other ranks' errors once one has failed. Whatever the deadline, it is the only
one that ends a hang: a rank's collectives (its process group and every group it
makes) wait ``COLLECTIVE_TIMEOUT``, longer than any deadline ``check_timeout``
accepts, so a collective never gives up inside a call that is still allowed to run.
"""
import os
import re
from datetime import timedelta

from labsupport.launch.progress import WorkDeadline

DEFAULT_TIMEOUT = 120.0   # per run; generous, a deadline is for hangs
START_TIMEOUT = 180.0     # importing torch on a busy shared machine can be slow
GRACE = 0.5               # after one rank fails, how long to wait for the others' errors
MAX_TIMEOUT = 7 * 24 * 3600.0  # the longest deadline a run may be given (a week)
COLLECTIVE_TIMEOUT = timedelta(seconds=MAX_TIMEOUT + 60)  # beyond every deadline
GRADING_TIMEOUT = 20.0    # per graded run, unless $LABSUPPORT_GRADING_TIMEOUT says otherwise
GRADING_CPU_FACTOR = 3    # CPU s a graded rank may use, per second of that deadline
GRADING_CEILING_FACTOR = 30  # wall s of the last-resort ceiling, per second of it
SERVER_REPLY_TIMEOUT = 30.0  # the process server answers a request within this
STACK_DUMP_WAIT = 1.0     # for a stopped rank's stack dump to be written
EXIT_WAIT = 1.0           # for a rank that closed its connection to be reaped
TAIL_CHARS = 4000         # shown of a dead rank's last stderr (faulthandler's report), or
                          # of the process server's log when it fails
MAX_MESSAGE = 1 << 20     # bytes of one request to the process server (env, sys.path)
MAX_RANKS_PER_CORE = 8    # more ranks than this per core is a typo, not a lesson


def check_timeout(timeout) -> float:
    """A run's deadline in seconds, checked."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if timeout > MAX_TIMEOUT:
        raise ValueError(f"timeout={timeout:g} s is longer than labsupport allows "
                         f"({MAX_TIMEOUT:g} s, a week): give a shorter deadline")
    return float(timeout)


def grading_timeout() -> float:
    """The deadline of each graded run: $LABSUPPORT_GRADING_TIMEOUT, else 20 s."""
    text = os.environ.get("LABSUPPORT_GRADING_TIMEOUT")
    if text is None:
        return GRADING_TIMEOUT
    value = float(text) if re.fullmatch(r"\s*\d+(\.\d*)?\s*", text) else 0.0
    try:
        return check_timeout(value)
    except ValueError:
        raise ValueError(f"LABSUPPORT_GRADING_TIMEOUT={text!r}: give a positive number of "
                         "seconds (the deadline of each graded run), or unset it for "
                         f"{GRADING_TIMEOUT:g} s") from None


def grading_deadline(timeout: float) -> WorkDeadline:
    """When a graded run with deadline ``timeout`` is stopped (``progress.Watch``).

    - ``stall = timeout``: every rank still running has waited that long,
      using no CPU time, with no thread runnable: a deadlock. The deadline
      a student reads ("did not finish within 20 s"), and what a deadlock
      costs, as before; load cannot bring it about in a run that computes.
    - ``cpu = GRADING_CPU_FACTOR * timeout``: a rank has done that much work,
      in CPU seconds: an endless loop. Sized from the work: the heaviest
      graded run of any assignment's reference used 0.58 CPU seconds on its
      busiest rank here (assignment 5; every other one under 0.08 s;
      book/instructors.md, "Deadlocks never hang the grader"), a hundredth
      of the default 60 s and a tenth of the tests' 6 s; a CPU second is the
      same work under any load (a starved rank accrues none), and differs
      between machines by their speed only.
    - ``ceiling = GRADING_CEILING_FACTOR * timeout`` of wall clock (600 s by
      default): the last resort, for a rank neither reading can judge (stuck
      in uninterruptible I/O); ten times the CPU budget, so a run that works
      reaches it only on a machine that gives its ranks under a tenth of a
      core each.
    """
    timeout = check_timeout(timeout)
    return WorkDeadline(stall=timeout, cpu=GRADING_CPU_FACTOR * timeout,
                        ceiling=min(MAX_TIMEOUT, GRADING_CEILING_FACTOR * timeout))


CPUS_ENV = "LABSUPPORT_CPUS"  # the hub's per-user CPU limit (deploy/), when it sets one
CGROUP = "/sys/fs/cgroup"     # the container's own cgroup (its namespace's root)


def cpu_count() -> int:
    """Cores this process may use: the fewest of its affinity mask, the container's
    CPU quota and ``$LABSUPPORT_CPUS``.

    A pod limited to 8 cores on a 128-core node still sees 128 cores in its
    affinity mask; its quota (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` /
    ``cpu.cfs_period_us``) is what the kernel enforces, by throttling.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    for limit in (cgroup_cpus(), _env_cpus()):
        if limit is not None:
            cores = min(cores, limit)
    return max(1, cores)


def cgroup_cpus(root: str | None = None) -> int | None:
    """Whole cores of the cgroup's CPU quota (at least 1), or None when unlimited."""
    root = CGROUP if root is None else root
    for quota_file, period_file in (("cpu.max", None),  # v2: "<quota> <period>" or "max ..."
                                    ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us"),
                                    ("cpu,cpuacct/cpu.cfs_quota_us",
                                     "cpu,cpuacct/cpu.cfs_period_us")):
        try:
            with open(os.path.join(root, quota_file)) as f:
                fields = f.read().split()
            if period_file is not None:  # v1: quota -1 is unlimited
                with open(os.path.join(root, period_file)) as f:
                    fields.append(f.read().strip())
        except OSError:
            continue
        if len(fields) < 2 or fields[0] in ("max", "-1") or \
                not (fields[0].isdigit() and fields[1].isdigit() and int(fields[1])):
            return None
        return max(1, int(fields[0]) // int(fields[1]))
    return None


def _env_cpus() -> int | None:
    text = os.environ.get(CPUS_ENV)
    if text is None or not text.strip():
        return None
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"{CPUS_ENV}={text!r}: give the number of cores this user may use "
                         "(a positive whole number), or unset it")
    return int(text)


def max_world_size() -> int:
    """The largest group allowed here; LABSUPPORT_MAX_WORLD_SIZE overrides."""
    override = os.environ.get("LABSUPPORT_MAX_WORLD_SIZE")
    return int(override) if override else max(16, MAX_RANKS_PER_CORE * cpu_count())


def check_world_size(world_size) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int (the number of ranks), got {world_size!r}")
    limit = max_world_size()
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if world_size > limit:
        raise ValueError(
            f"world_size={world_size} is more than this machine can run sensibly "
            f"(limit {limit} for {cpu_count()} cores): each rank is a process with its own "
            "copy of torch. Use fewer ranks, or set LABSUPPORT_MAX_WORLD_SIZE to raise the limit.")
    return world_size
