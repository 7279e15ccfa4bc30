"""Every setting the course hub reads from its environment, and the checks that
stop it before it serves anyone in a way it should not.

Two modes (``COURSE_HUB_MODE``):

- ``class`` (default): PAM logins limited to two Unix groups, one Unix user
  per student (class_spawner.py). Needs root (to read passwords and to switch
  to each student's uid). Refuses to start without an admin (or with one
  named who has no Unix account), with the
  instructors' sources readable by students (notebooks/assignments, or the git
  history, which holds them too: private_sources.py), with a Python students
  cannot run, or on a non-loopback address without TLS.
- ``trial``: every server runs as the hub's own user; loopback only, never as
  root. For one person trying the labs, or colleagues who trust each other.

Both refuse an idle timeout below its floor (`idle_floor`). `spawn_timeouts`
is the one place every timeout on a spawn's path comes from.

`read(environ)` gives a `Settings`; `refusals(settings)` lists what is wrong;
`check(settings)` raises SystemExit with all of it, which JupyterHub reports
before it opens any port. `address_refusals` is also run by the proxy
(course_proxy.py) on the address it is finally given, command line included.
Standard library only.
"""
import dataclasses
import grp
import ipaddress
import os
import pwd
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import private_sources

ROOT = private_sources.ROOT  # the repository
ASSIGNMENTS = private_sources.ASSIGNMENTS  # solutions and hidden tests inside
NOBODY = 65534  # who tries the course's Python, with the students' group
INTEGERS = {"cpus": "COURSE_CPUS_PER_USER", "processes": "COURSE_PROCESSES_PER_USER",
            "idle_timeout": "COURSE_IDLE_TIMEOUT",
            "kernel_idle_timeout": "COURSE_KERNEL_IDLE_TIMEOUT",
            "server_start": "COURSE_SERVER_START_S", "spawns_at_once": "COURSE_SPAWNS_AT_ONCE",
            "activity_interval": "COURSE_ACTIVITY_INTERVAL"}
# The allowance the course documents (book/jupyterhub.md, "A whole class at once")
# for one server's start: jupyter_server and JupyterLab imported and the first
# HTTP answer given, on a node where at most COURSE_SPAWNS_AT_ONCE servers start
# together (about a core each). Measured on this project's 2-core machine: the
# book's table. Every timeout on a spawn's path is derived from it (spawn_timeouts).
SERVER_START_S = 120
# A server's start costs about 4 core-seconds (16 started at once on 2 cores
# were all ready within 33 s) but lasts about 6 s alone, mostly waiting: 4 starts
# per core keep the cores busy, each then lasting about 16 s on an idle node,
# a seventh of SERVER_START_S (room for a node busy with other work).
SPAWNS_PER_CORE = 4


@dataclasses.dataclass
class Settings:
    mode: str                 # "class" or "trial"
    bind_url: str
    state_dir: Path           # cookie secret, database, proxy pid: 0700, files 0600
    ssl_cert: str = ""
    ssl_key: str = ""
    student_group: str = "course-students"
    instructor_group: str = "course-instructors"
    admin_users: tuple = ()
    spawner: str = "local"    # "local" or "systemd" (class mode)
    cpus: int | None = None   # per server: LABSUPPORT_CPUS, and systemd's CPUQuota
    memory: str = ""          # per server, systemd's MemoryMax ("32G")
    processes: int = 4096     # per student: RLIMIT_NPROC or systemd's TasksMax
    idle_timeout: int = 3600  # a server with no activity this long is stopped
    kernel_idle_timeout: int = 1800  # an idle kernel (tab open or not) is shut down
    server_start: int = SERVER_START_S  # s one server may take to start and answer
    spawns_at_once: int | None = None  # servers starting together; the rest wait in line
    activity_interval: int = 300  # s between a server's activity reports to the hub
    trial_password: str = ""  # trial: one shared password ("" = any password)
    trial_home: str = ""      # trial: each user's folder, with {username}
    errors: list = dataclasses.field(default_factory=list)  # malformed settings


def read(environ=None, gpus=(), gpus_per_user=1):
    """Settings from the environment (gpus: the pool's, for the default CPU share)."""
    env = os.environ if environ is None else environ
    mode = env.get("COURSE_HUB_MODE", "class").strip() or "class"
    home = Path(os.path.expanduser("~"))
    default_state = "/srv/course-hub" if mode == "class" else str(home / ".local/state/course-hub")
    s = Settings(mode=mode, bind_url=env.get("COURSE_HUB_URL", "http://127.0.0.1:8000"),
                 state_dir=Path(env.get("COURSE_HUB_STATE", default_state)).resolve(),
                 ssl_cert=env.get("COURSE_HUB_SSL_CERT", ""),
                 ssl_key=env.get("COURSE_HUB_SSL_KEY", ""),
                 trial_password=env.get("COURSE_HUB_PASSWORD", ""),
                 trial_home=env.get("COURSE_HUB_HOME", str(home / "course-hub-trial/{username}")))
    s.student_group = env.get("COURSE_STUDENT_GROUP", s.student_group)
    s.instructor_group = env.get("COURSE_INSTRUCTOR_GROUP", s.instructor_group)
    s.admin_users = tuple(u.strip() for u in env.get("COURSE_ADMIN_USERS", "").split(",")
                          if u.strip())
    s.memory = env.get("COURSE_MEMORY_PER_USER", "").strip()
    s.spawner = _spawner(env.get("COURSE_SPAWNER", "auto").strip(), s.errors)
    if mode not in ("class", "trial"):
        s.errors.append(f"COURSE_HUB_MODE={mode!r}: use 'class' (default) or 'trial'")
    for field, name in INTEGERS.items():
        text = env.get(name, "").strip()
        if text and (not text.isdigit() or int(text) < 1):
            s.errors.append(f"{name}={text!r}: give a whole number of at least 1")
        elif text:
            setattr(s, field, int(text))
    if s.cpus is None and gpus and gpus_per_user:  # a fair share of the cores per server
        s.cpus = max(1, (os.cpu_count() or 1) * gpus_per_user // len(gpus))
    if s.spawns_at_once is None:
        s.spawns_at_once = SPAWNS_PER_CORE * (os.cpu_count() or 1)
    return s


def spawn_timeouts(s):
    """Every timeout on a spawn's path, in seconds, from the one allowance s.server_start.

    What each one waits for (jupyterhub 6.1.1, ``User.spawn``; systemdspawner 1.0.2):
    - ``Spawner.start_timeout`` bounds ``Spawner.start()``: the local spawner's
      returns once the process is forked; the systemd spawner's once its unit is
      active (it polls for start_timeout s). No import happens inside it, but a
      loaded node can delay the fork or the unit: the same allowance.
    - ``Spawner.http_timeout`` bounds the wait for the server's first HTTP answer,
      which is the whole import of jupyter_server and JupyterLab: the allowance.
    - The line (class_spawner.SpawnLine) is waited in before start(), in the
      pre-spawn hook, under neither timeout: a student in line is never failed by
      the clock; the line moves as each start in front ends, in at most
      server_start s, so the wait is at most ceil(ahead / spawns_at_once) of them.
    - ``JupyterHub.concurrent_spawn_limit`` (HTTP 429, "Too many users trying to
      log in right now") would fail a student in line: off (0), the line admits.
    """
    return {"Spawner.start_timeout": s.server_start, "Spawner.http_timeout": s.server_start,
            "JupyterHub.concurrent_spawn_limit": 0}


def idle_floor(s):
    """The shortest COURSE_IDLE_TIMEOUT that culls no one still working: a server
    reports its last activity to the hub every activity_interval s (jupyterhub's
    singleuser ``hub_activity_interval``), so the hub's view lags by up to that
    much, and the culler looks every cull_every s (up to that much again)."""
    return 2 * s.activity_interval


def _spawner(choice, errors):
    if choice == "auto":
        return "systemd" if Path("/run/systemd/system").is_dir() else "local"
    if choice not in ("local", "systemd"):
        errors.append(f"COURSE_SPAWNER={choice!r}: use 'auto' (default), 'local' or 'systemd'")
    return choice


def is_loopback(url):
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def refusals(s):
    """Everything that must be fixed before this hub may start: a list of sentences."""
    problems = list(s.errors)
    if not s.errors and s.idle_timeout < idle_floor(s):
        problems.append(f"COURSE_IDLE_TIMEOUT={s.idle_timeout} is below its floor of "
                        f"{idle_floor(s)} s (2 x COURSE_ACTIVITY_INTERVAL={s.activity_interval}): "
                        "a server tells the hub of its activity only every "
                        "COURSE_ACTIVITY_INTERVAL s, so a shorter timeout stops servers of "
                        "students who are still working. Raise it, or lower "
                        "COURSE_ACTIVITY_INTERVAL too")
    if s.mode == "trial":
        return problems + _trial_refusals(s)
    if s.mode == "class":
        problems += _class_refusals(s)
    return problems


def address_refusals(mode, public_url, tls, hub_url=None):
    """What is wrong with where the hub listens: the proxy's public address (the
    users'), and the hub's own port when known (it serves the login page too)."""
    problems = []
    if mode == "trial" and not is_loopback(public_url):
        problems.append(f"trial mode listens on loopback only, not {public_url}: every user's "
                        "server runs as one Unix user, so users can read each other's files, "
                        "tokens and kernels. Use COURSE_HUB_MODE=class to serve a class")
    if mode == "class" and not is_loopback(public_url) and not tls:
        problems.append(f"{public_url} is not loopback: set COURSE_HUB_SSL_CERT and "
                        "COURSE_HUB_SSL_KEY (passwords must not cross the network in clear), "
                        "or keep the hub on 127.0.0.1 behind an HTTPS reverse proxy")
    if hub_url and not is_loopback(hub_url):
        problems.append(f"the hub's own port listens on {hub_url}: keep it on 127.0.0.1 "
                        "(JupyterHub.hub_ip): it serves the login page without TLS, and only "
                        f"the proxy ({public_url}) is for users")
    return problems


def _trial_refusals(s):
    problems = address_refusals("trial", s.bind_url, False)
    if os.geteuid() == 0:
        problems.append("trial mode refuses to run as root: its servers run as the hub's own "
                        "user, so every user would be root. Start it as an ordinary user, or "
                        "use COURSE_HUB_MODE=class, which runs each student as their own user")
    return problems


def _class_refusals(s):
    if os.geteuid() != 0:
        return ["class mode needs root: PAM reads /etc/shadow, and each server is started "
                "as its student's Unix user (root is dropped before the server runs)"]
    problems = (_group_refusals(s) + _state_refusals(s)
                + address_refusals("class", s.bind_url, bool(s.ssl_cert and s.ssl_key)))
    if s.spawner == "systemd" and not Path("/run/systemd/system").is_dir():
        problems.append("COURSE_SPAWNER=systemd, but systemd is not running on this node")
    return problems + _source_refusals(s) + _python_refusals(s)


def group_members(name):
    """Users in the Unix group name: listed members, and those whose primary group it is."""
    group = grp.getgrnam(name)
    primary = [p.pw_name for p in pwd.getpwall() if p.pw_gid == group.gr_gid]
    return sorted(set(group.gr_mem) | set(primary))


def _group_refusals(s):
    problems = []
    for name in (s.student_group, s.instructor_group):
        try:
            grp.getgrnam(name)
        except KeyError:
            problems.append(f"the Unix group {name!r} does not exist: create it (groupadd "
                            f"{name}) and add the class's accounts (usermod -aG {name} USER)")
    for name in s.admin_users:
        try:
            pwd.getpwnam(name)
        except KeyError:
            problems.append(f"COURSE_ADMIN_USERS names {name!r}, who has no Unix account on "
                            "this node: PAM cannot log them in, so they cannot act as admin. "
                            f"Create the account (useradd -m {name}) or remove the name")
    if not problems and not (s.admin_users or group_members(s.instructor_group)):
        problems.append(f"no admin: add an instructor to the group {s.instructor_group!r} or "
                        "name one in COURSE_ADMIN_USERS (an admin stops servers that hold "
                        "GPUs, from the hub's admin page)")
    return problems


def _state_refusals(s):
    if s.state_dir.is_relative_to(ROOT):
        return [f"COURSE_HUB_STATE={s.state_dir} is inside the repository: the cookie secret "
                "and the database must live elsewhere (default /srv/course-hub)"]
    if s.state_dir.exists() and s.state_dir.stat().st_uid != os.geteuid():
        return [f"{s.state_dir} (the hub's secrets) belongs to another user: use a folder of "
                "the hub's own"]
    return []


def _source_refusals(s):
    """Students read nothing of the instructors' sources (tried as a stand-in student)."""
    try:
        gid = grp.getgrnam(s.student_group).gr_gid
    except KeyError:
        gid = NOBODY  # the group is reported missing; others' access is still checked
    found = private_sources.readable(NOBODY, gid)
    if found is None:  # not really root (a test faking it): the folders' modes only
        found = private_sources.open_to_all()
    return private_sources.refusals(found, f"students (tried as uid {NOBODY} in group "
                                           f"{s.student_group})")


def _python_refusals(s):
    """Students must be able to run the course's Python and import the labs."""
    try:
        gid = grp.getgrnam(s.student_group).gr_gid
    except KeyError:
        return []  # already reported
    try:
        run = subprocess.run([sys.executable, "-c", "import jupyterhub, labsupport"],
                             user=NOBODY, group=gid, extra_groups=[], capture_output=True,
                             text=True, cwd="/", timeout=120,
                             env={k: v for k, v in os.environ.items() if k == "PYTHONPATH"})
        error = run.stderr.strip()[-300:] if run.returncode else ""
    except OSError as e:
        error = str(e)
    if error:
        return [f"a student cannot run the course's Python {sys.executable} with labsupport "
                f"(tried as uid {NOBODY} in group {s.student_group}): {error}. Install the "
                "environment where every student can read it (each folder on the way needs "
                "o+x; not under /root)"]
    return []


def prepare_state(s):
    """The state folder (0700) and its files: the database made 0600 before first use."""
    s.state_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(s.state_dir, 0o700)
    database = s.state_dir / "jupyterhub.sqlite"
    database.touch(mode=0o600, exist_ok=True)
    os.chmod(database, 0o600)
    return database


def check(s):
    """Raise SystemExit listing every refusal; JupyterHub then exits before serving."""
    problems = refusals(s)
    if problems:
        raise SystemExit(f"The course hub will not start (COURSE_HUB_MODE={s.mode}):\n"
                         + "\n".join(f"  - {p}" for p in problems))
