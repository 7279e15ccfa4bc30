# The course's JupyterHub on one node (book/jupyterhub.md says what each mode
# isolates and what it does not). tests/test_jupyterhub.py starts the class mode
# as root with two temporary students and attacks it.
#
#   sudo .venv/bin/jupyterhub -f deploy/jupyterhub_config.py     (class mode)
#
# Settings, through the environment (deploy/hub_settings.py reads and checks
# them; the hub refuses to start, saying why, when something is unsafe):
#   COURSE_HUB_MODE          class (default): PAM logins, one Unix user per
#                            student; trial: every server runs as the hub's own
#                            user, loopback only, never as root
#   COURSE_HUB_URL           where the hub listens (default http://127.0.0.1:8000);
#                            the proxy checks the address again with the command
#                            line applied (--url ...: course_proxy.py)
#   COURSE_HUB_SSL_CERT/KEY  TLS files; needed to listen beyond loopback
#   COURSE_HUB_STATE         cookie secret, database, proxy pid, mode 0700
#                            (default /srv/course-hub; trial ~/.local/state/course-hub)
#   COURSE_STUDENT_GROUP     who may log in (default course-students)
#   COURSE_INSTRUCTOR_GROUP  who may log in as admin (default course-instructors)
#   COURSE_ADMIN_USERS       more admins, comma-separated (at least one admin)
#   COURSE_SPAWNER           auto (default: systemd where it runs), local, systemd
#   COURSE_CPUS_PER_USER     cores per server: LABSUPPORT_CPUS, and systemd's quota
#                            (default: the node's cores shared by the GPU slots)
#   COURSE_MEMORY_PER_USER   memory per server, systemd only (e.g. 64G)
#   COURSE_PROCESSES_PER_USER  processes and threads per student (default 4096)
#   COURSE_IDLE_TIMEOUT      seconds without activity before a server is stopped
#                            and its GPUs go back (default 3600; at least
#                            2 x COURSE_ACTIVITY_INTERVAL, hub_settings.idle_floor)
#   COURSE_ACTIVITY_INTERVAL seconds between a server's activity reports (default 300)
#   COURSE_SERVER_START_S    seconds one server may take to start and answer: every
#                            spawn timeout (hub_settings.spawn_timeouts; default 120)
#   COURSE_SPAWNS_AT_ONCE    servers that start together; the others wait in line,
#                            told so on their spawn page (default: 4 per core)
#   COURSE_KERNEL_IDLE_TIMEOUT  seconds before an idle kernel (and its ranks)
#                            is shut down, tab open or not (default 1800)
#   COURSE_GPU_POOL, COURSE_GPUS_PER_USER, COURSE_GPU_WHEN_EMPTY: the GPU pool
#                            (deploy/gpu_pool.py; default: every GPU, by UUID)
#   COURSE_HUB_PASSWORD, COURSE_HUB_HOME: trial mode's shared password and folders
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import course_proxy  # noqa: E402  (deploy/, beside this file)
import gpu_pool  # noqa: E402
import hub_settings  # noqa: E402
import service_leash  # noqa: E402

c = get_config()  # noqa: F821  (provided by JupyterHub when it reads this file)
POOL = gpu_pool.from_environment()
SETTINGS = hub_settings.read(gpus=POOL.gpus, gpus_per_user=POOL.per_user)
hub_settings.check(SETTINGS)  # SystemExit with every reason, before any port opens

TRIAL_LABEL = ("Trial mode: every user's server runs as one Unix user, so users can read "
               "each other's files and tokens. Not for a class (book/jupyterhub.md).")


def common(c, s):
    """Both modes: where the hub listens and keeps its secrets, the servers, culling."""
    c.JupyterHub.bind_url = s.bind_url
    database = hub_settings.prepare_state(s)
    c.JupyterHub.db_url = f"sqlite:///{database}"
    c.JupyterHub.cookie_secret_file = str(s.state_dir / "jupyterhub_cookie_secret")
    c.ConfigurableHTTPProxy.pid_file = str(s.state_dir / "jupyterhub-proxy.pid")
    c.JupyterHub.proxy_class = course_proxy.CourseProxy  # checks the final address
    c.CourseProxy.course_mode = s.mode
    # The proxy's token is generated at each start and given to the proxy alone:
    # servers get only env_keep and the hub's JUPYTERHUB_* variables.
    proxy = HERE / "proxy" / "node_modules" / ".bin" / "configurable-http-proxy"
    if proxy.exists():  # scripts/fetch_proxy.py's copy, else the one on PATH
        c.ConfigurableHTTPProxy.command = [str(proxy)]
    # The course environment: the server, its "Python 3 (course)" kernels and
    # their ranks run with this interpreter (the project's .venv).
    c.Spawner.cmd = [sys.executable, "-m", "jupyterhub.singleuser"]
    c.Spawner.default_url = "/lab"
    c.Spawner.env_keep = ["PATH", "PYTHONPATH", "VIRTUAL_ENV", "LANG", "LC_ALL"]
    spawn_path(c, s)
    c.Spawner.args = kernel_culling(s.kernel_idle_timeout)
    c.Spawner.environment = {"JUPYTERHUB_ACTIVITY_INTERVAL": str(s.activity_interval)}
    c.Spawner.pre_spawn_hook, c.Spawner.post_stop_hook = POOL.hooks()
    idle_culler(c, s)


def spawn_path(c, s):
    """Every timeout a spawn meets, from hub_settings.spawn_timeouts (one place)."""
    for name, seconds in hub_settings.spawn_timeouts(s).items():
        section, trait = name.split(".")
        setattr(c[section], trait, seconds)


def kernel_culling(timeout):
    """jupyter_server shuts down a kernel idle this long, even with its tab open
    (cull_connected), never while it runs a cell (cull_busy); its ranks end with it."""
    every = max(1, min(300, timeout // 10))
    return [f"--MappingKernelManager.cull_idle_timeout={timeout}",
            f"--MappingKernelManager.cull_interval={every}",
            "--MappingKernelManager.cull_connected=True",
            "--MappingKernelManager.cull_busy=False"]


def idle_culler(c, s):
    """jupyterhub-idle-culler, a hub service: stops servers idle for idle_timeout s.
    It runs on a leash (service_leash.py): it ends when this hub process ends, even
    by SIGKILL, so a restarted hub never finds a second one; and its token dies
    with it (course_proxy.py revokes every token of a managed service but the one
    this start made)."""
    every = max(1, min(300, s.idle_timeout // 10))
    c.JupyterHub.services = [{
        "name": "idle-culler", "cwd": str(s.state_dir),
        "command": service_leash.command(
            [sys.executable, "-m", "jupyterhub_idle_culler", f"--timeout={s.idle_timeout}",
             f"--cull-every={every}", f"--concurrency={max(10, s.spawns_at_once)}"])}]
    # jupyterhub-idle-culler 2.0.0 awaits one user after another (cull_idle: `for
    # name, f in futures: await f`; --concurrency bounds only requests in flight),
    # and the hub answers each DELETE only when the stop ends or after
    # slow_stop_timeout (10 s by default): idle servers were stopped one at a time.
    # Answered 202 ("stopping") after 1 s, the culler goes on while the stops run.
    c.JupyterHub.tornado_settings = {"slow_stop_timeout": 1}
    c.JupyterHub.load_roles = [{
        "name": "idle-culler", "services": ["idle-culler"],
        "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"]}]


def class_mode(c, s):
    """PAM logins for two groups; each server as its student's own Unix user."""
    c.JupyterHub.authenticator_class = "pam"
    c.PAMAuthenticator.allowed_groups = {s.student_group, s.instructor_group}
    c.PAMAuthenticator.admin_groups = {s.instructor_group}
    c.Authenticator.admin_users = set(s.admin_users)
    c.Authenticator.allow_all = False
    c.Authenticator.allow_existing_users = False  # leaving the group ends access
    c.Authenticator.blocked_users = {"root"}
    if s.ssl_cert:
        c.JupyterHub.ssl_cert, c.JupyterHub.ssl_key = s.ssl_cert, s.ssl_key
    import class_spawner
    spawner = (class_spawner.ClassSystemdSpawner if s.spawner == "systemd"
               else class_spawner.ClassLocalSpawner)
    c.JupyterHub.spawner_class = spawner
    getattr(c, spawner.__name__).gpu_pool = POOL
    getattr(c, spawner.__name__).processes = s.processes
    getattr(c, spawner.__name__).spawns_at_once = s.spawns_at_once
    if s.cpus:
        c.Spawner.cpu_limit = float(s.cpus)
    if s.memory:
        c.Spawner.mem_limit = s.memory
    # Servers outlive a hub restart; the pool learns from their state what they hold.
    c.JupyterHub.cleanup_servers = False


def trial_mode(c, s):
    """One Unix user for all (the hub's own): loopback only, labelled, never root."""
    if s.trial_password:
        c.JupyterHub.authenticator_class = "shared-password"
        c.SharedPasswordAuthenticator.user_password = s.trial_password
    else:
        c.JupyterHub.authenticator_class = "dummy"  # any name, any password
    c.Authenticator.allow_all = True
    c.JupyterHub.spawner_class = "simple"
    c.SimpleLocalProcessSpawner.home_dir_template = s.trial_home
    c.JupyterHub.template_vars = {"announcement": TRIAL_LABEL}
    c.JupyterHub.cleanup_servers = True


common(c, SETTINGS)
(class_mode if SETTINGS.mode == "class" else trial_mode)(c, SETTINGS)
