"""The class hub's spawners: each student's server runs as that student's own
Unix user, never as root, in a private home, with the GPUs the pool lent it.

- `ClassLocalSpawner` (any Linux, run by a root hub): JupyterHub's
  `LocalProcessSpawner`, which switches to the student's uid and groups before
  running the server, plus: the account and home are checked first (a uid below
  the system's ``UID_MIN`` or a home that is not the student's own is refused;
  a home others can enter is made 0700); a cap on the student's processes
  (``RLIMIT_NPROC``, counted per uid); the server's output in the student's own
  ``~/.course-hub/server.log`` instead of the hub's log (which every server
  would otherwise inherit, open for writing); and when the server stops, every
  process of that uid ends (uid_processes.py), so no rank started with
  ``nohup`` keeps a GPU that the pool lends again. No memory or CPU cap: that
  takes cgroups, which the next spawner gets from systemd.
- `ClassSystemdSpawner` (where systemd runs): one systemd unit per server
  (jupyterhub-systemdspawner), with ``CPUQuota``/``MemoryMax`` from the
  spawner's ``cpu_limit``/``mem_limit``, ``TasksMax``, a private /tmp, no
  new privileges, and a device fence: ``DevicePolicy=closed`` and
  ``DeviceAllow=`` for the lent GPUs' device files only.

Both admit at most ``spawns_at_once`` starts at a time (`SpawnLine`, shared by
every server of the hub): the others wait in line, in order of arrival, and
the student's spawn page says so (``progress``) instead of the spawn failing
on a timeout because a whole class imports JupyterLab on a few cores at once.

Both save the GPUs they hold in the spawner's state, which the hub keeps in
its database, and give them back to the pool (`GPUPool.claim`) when a
restarted hub finds their server still running; both set ``LABSUPPORT_CPUS``
(the cores labsupport sizes its ranks' threads by) from ``cpu_limit``.
"""
import asyncio
import collections
import os
import pwd
import resource
import stat
import subprocess
from pathlib import Path

import gpu_pool
import uid_processes
from jupyterhub.spawner import LocalProcessSpawner
from jupyterhub.utils import maybe_future
from systemdspawner import SystemdSpawner
from traitlets import Any, HasTraits, Integer

# Where a home would not survive a reboot, or is shared by every user.
VOLATILE = (Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"), Path("/run"))
SERVER_LOG = ".course-hub/server.log"  # in the student's home
# Besides the lent GPUs, what a CUDA program opens (those that exist), and
# the pseudo-terminals JupyterLab's terminals need.
GPU_CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
TERMINAL_DEVICES = ("/dev/ptmx rw", "char-pts rw")


def uid_min(login_defs="/etc/login.defs"):
    """The smallest uid of a person's account (UID_MIN, 1000 unless the system says)."""
    try:
        for line in Path(login_defs).read_text().splitlines():
            fields = line.split()
            if len(fields) == 2 and fields[0] == "UID_MIN" and fields[1].isdigit():
                return int(fields[1])
    except OSError:
        pass
    return 1000


def checked_account(name):
    """The student's passwd entry, after refusing what must not get a server.

    Refused: no such Unix user; root or a system account (uid below UID_MIN);
    a home that is missing, a symlink, not owned by the student, or under a
    volatile folder. A home that group or others may enter is made 0700.
    """
    try:
        account = pwd.getpwnam(name)
    except KeyError:
        raise PermissionError(f"{name} has no Unix account on this node: the class hub "
                              "starts each server as its student's own Unix user") from None
    if account.pw_uid < uid_min():
        raise PermissionError(f"{name} has uid {account.pw_uid}, below UID_MIN={uid_min()} "
                              "(root or a system account): no server runs as it")
    home = Path(account.pw_dir)
    if not home.is_absolute() or any(home.is_relative_to(v) for v in VOLATILE):
        raise PermissionError(f"{name}'s home {home} is not a persistent folder (not "
                              f"under {', '.join(map(str, VOLATILE))}): move it (usermod -d)")
    try:
        info = os.lstat(home)
    except FileNotFoundError:
        raise PermissionError(f"{name}'s home {home} does not exist: create it "
                              f"(mkhomedir_helper {name}, or useradd -m)") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != account.pw_uid:
        raise PermissionError(f"{name}'s home {home} must be a folder owned by {name}")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(home, 0o700)
    return account


class SpawnLine:
    """At most `size` servers start at once; the others wait, first come first served.

    A place is taken with `enter` (waits while the line is full) and given back
    with `leave`; `ahead_of` is how many wait in front of one who is waiting
    (None once they are starting). One event loop, no threads: the hub's.
    """

    def __init__(self, size):
        self.size = max(1, size)
        self.starting, self.waiting = set(), collections.OrderedDict()  # who -> future

    async def enter(self, who):
        if len(self.starting) < self.size and not self.waiting:
            self.starting.add(who)
            return
        admitted = asyncio.get_running_loop().create_future()
        self.waiting[who] = admitted
        try:
            await admitted
        except BaseException:  # cancelled in line: out of it, and not starting
            self.waiting.pop(who, None)
            self.leave(who)
            raise

    def leave(self, who):
        self.starting.discard(who)
        while self.waiting and len(self.starting) < self.size:
            first, admitted = self.waiting.popitem(last=False)
            self.starting.add(first)
            admitted.set_result(None)

    def ahead_of(self, who):
        return list(self.waiting).index(who) if who in self.waiting else None


QUEUED = ("Queued, number {place} in line. {size} servers start at a time on this node, each "
          "within {allowance} s. Your server starts by itself when its turn comes: keep this "
          "page open.")


class CourseSpawnerMixin(HasTraits):
    """What both class spawners add: checks, the line, the GPUs in the state, LABSUPPORT_CPUS."""

    gpu_pool = Any(None, help="the GPUPool whose hooks lend this server its GPUs").tag(config=True)
    processes = Integer(4096, help="most processes and threads of one student").tag(config=True)
    spawns_at_once = Integer(0, help="servers that start at once; the others wait in line "
                             "(0: no line)").tag(config=True)
    gpu_ids = Any(None)  # set by the pool's pre_spawn_hook
    lines = {}  # spawns_at_once -> the hub's one SpawnLine (class-wide: every server's)

    @property
    def line(self):
        return CourseSpawnerMixin.lines.setdefault(self.spawns_at_once,
                                                   SpawnLine(self.spawns_at_once))

    async def run_pre_spawn_hook(self):
        """Wait in line, then the pool's hook. This runs before start(), under none of
        the spawn timeouts (jupyterhub 6.1.1, User.spawn): waiting is never a failure."""
        if not self.spawns_at_once:
            return await maybe_future(super().run_pre_spawn_hook())
        await self.line.enter(self)
        try:
            return await maybe_future(super().run_pre_spawn_hook())
        except BaseException:
            self.line.leave(self)
            raise
        finally:
            if self in self.line.starting:
                asyncio.ensure_future(self._leave_line_when_started())

    async def _leave_line_when_started(self):
        """The place is held until the spawn ends, ready or failed: the server's
        import (under http_timeout) is the work the line spreads out."""
        try:
            while self._spawn_pending:
                await asyncio.sleep(0.2)
        finally:
            self.line.leave(self)

    async def progress(self):
        """What the spawn page shows: the student's place in line, then the start."""
        said = None
        while (ahead := self.line.ahead_of(self) if self.spawns_at_once else None) is not None:
            if ahead != said:
                said = ahead
                yield {"progress": 10, "message": QUEUED.format(
                    place=ahead + 1, size=self.line.size, allowance=self.http_timeout)}
            await asyncio.sleep(0.5)
        yield {"progress": 50, "message": "Starting your server (JupyterLab is imported)..."}

    def get_state(self):
        state = super().get_state()
        if self.gpu_ids is not None:
            state["gpus"] = list(self.gpu_ids)
        return state

    def load_state(self, state):
        """A restarted hub: a running server's GPUs go back to the pool's books."""
        super().load_state(state)
        running = self.orm_spawner is not None and self.orm_spawner.server is not None
        if "gpus" in state and running and self.gpu_pool is not None:
            self.gpu_ids = tuple(state["gpus"])
            twice = self.gpu_pool.claim(gpu_pool.owner_of(self), self.gpu_ids)
            self.log.info("gpu_pool: %s still holds %r", gpu_pool.owner_of(self),
                          ",".join(self.gpu_ids))
            if twice:
                self.log.error("gpu_pool: %r held by two running servers", twice)

    def clear_state(self):
        super().clear_state()
        self.gpu_ids = None

    def get_env(self):
        env = super().get_env()
        if self.cpu_limit:
            env["LABSUPPORT_CPUS"] = str(max(1, int(self.cpu_limit)))
        return env


class ClassLocalSpawner(CourseSpawnerMixin, LocalProcessSpawner):
    """LocalProcessSpawner run by a root hub, made fit for a class (module docstring)."""

    async def start(self):
        checked_account(self.user.name)
        self.popen_kwargs = {**self.popen_kwargs, "stdin": subprocess.DEVNULL}
        return await super().start()

    def make_preexec_fn(self, name):
        become_student = super().make_preexec_fn(name)  # setgid, initgroups, setuid, cd ~
        processes, log = self.processes, Path(pwd.getpwnam(name).pw_dir) / SERVER_LOG

        def preexec():  # in the child, between fork and exec: system calls only
            resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
            become_student()
            os.umask(0o077)
            os.makedirs(log.parent, mode=0o700, exist_ok=True)  # as the student
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
        return preexec

    async def stop(self, now=False):
        """Stop the server, then end whatever of the student is left (class mode
        runs one server per student: JupyterHub's named servers stay off)."""
        await super().stop(now=now)
        uid = pwd.getpwnam(self.user.name).pw_uid
        left = await asyncio.to_thread(uid_processes.end_all, uid)
        if left:
            self.log.info("ended %d process(es) of %s left after its server", len(left),
                          self.user.name)


class ClassSystemdSpawner(CourseSpawnerMixin, SystemdSpawner):
    """SystemdSpawner with the class's limits and a device fence (module docstring)."""

    def _expand_user_vars(self, value):
        # jupyterhub-systemdspawner 1.0.2 documents list values in
        # unit_extra_properties (one --property= each) but calls .format() on
        # every value in start(), so a list raised AttributeError there.
        if isinstance(value, list):
            return [super(ClassSystemdSpawner, self)._expand_user_vars(v) for v in value]
        return super()._expand_user_vars(value)

    async def start(self):
        checked_account(self.user.name)
        self.isolate_tmp = self.disable_user_sudo = True
        self.unit_extra_properties = {**self.unit_extra_properties,
                                      **fence_properties(self.gpu_ids or (), self.processes)}
        return await super().start()


def fence_properties(gpu_ids, processes):
    """systemd unit properties: devices closed but for the lent GPUs; a task cap."""
    allow = list(TERMINAL_DEVICES)
    if gpu_ids:
        nodes = gpu_pool.device_nodes(gpu_ids)
        allow += [f"{n} rw" for n in nodes + [c for c in GPU_CONTROL_NODES if os.path.exists(c)]]
    return {"DevicePolicy": "closed", "DeviceAllow": allow, "TasksMax": str(processes)}
