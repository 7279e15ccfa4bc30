# The course's JupyterHub on one node: the configuration tests/test_jupyterhub.py
# starts and drives (two users running ranks at once, GPUs shared out, stop).
#
#   jupyterhub -f deploy/jupyterhub_config.py          (from the repository root)
#
# Settings an admin changes through the environment (no edit needed):
#   COURSE_HUB_URL           where the hub listens      (default http://127.0.0.1:8000)
#   COURSE_HUB_PASSWORD      if set: every user logs in with this shared password
#                            (SharedPasswordAuthenticator); unset: any password works
#   COURSE_HUB_HOME          users' working folders      (default /tmp/course-hub/{username})
#   COURSE_GPU_POOL          GPUs lent to users: "0,1,2,3", UUIDs, or "none"
#                            (default: every GPU nvidia-smi lists)
#   COURSE_GPUS_PER_USER     GPUs per user's server      (default 1)
#   COURSE_GPU_WHEN_EMPTY    "refuse" (spawn fails, saying why) or "cpu" (no GPU)
#
# The login and the spawner are the tested ones, made for a trial or a
# course on a machine whose users all trust each other (see book/jupyterhub.md):
# every server runs as the hub's own Unix user. For real accounts, replace the
# two lines marked (*) with PAM logins and one Unix user per student:
#   c.JupyterHub.authenticator_class = "pam"
#   c.JupyterHub.spawner_class = "localprocess"   # or "systemdspawner"
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gpu_pool  # noqa: E402  (deploy/gpu_pool.py, beside this file)

c = get_config()  # noqa: F821  (provided by JupyterHub when it reads this file)

c.JupyterHub.bind_url = os.environ.get("COURSE_HUB_URL", "http://127.0.0.1:8000")
# The hub's database and cookie secret go next to where the hub is started.
c.JupyterHub.cleanup_servers = True   # the GPU pool lives in the hub's memory

# (*) Any user name logs in: with any password (the tested dummy login), or
# with the shared password when COURSE_HUB_PASSWORD is set.
if os.environ.get("COURSE_HUB_PASSWORD"):
    c.JupyterHub.authenticator_class = "shared-password"
    c.SharedPasswordAuthenticator.user_password = os.environ["COURSE_HUB_PASSWORD"]
else:
    c.JupyterHub.authenticator_class = "dummy"
c.Authenticator.allow_all = True

# (*) One jupyter server per user, a local process of the hub's own Unix user,
# started in the user's own folder.
c.JupyterHub.spawner_class = "simple"
c.SimpleLocalProcessSpawner.home_dir_template = os.environ.get(
    "COURSE_HUB_HOME", "/tmp/course-hub/{username}")
# The course environment: the server runs with this interpreter (the project's
# .venv when the hub is started from it), and so do its "Python 3 (course)"
# kernels and every rank they start.
c.Spawner.cmd = [sys.executable, "-m", "jupyterhub.singleuser"]
c.Spawner.default_url = "/lab"
if os.geteuid() == 0:  # a container where everything is root: jupyter refuses without it
    c.Spawner.args = ["--allow-root"]
c.Spawner.env_keep = ["PATH", "PYTHONPATH", "VIRTUAL_ENV", "LANG", "LC_ALL"]
c.Spawner.start_timeout = 120  # a busy node imports jupyter slowly

# GPUs: each server gets its own disjoint set through CUDA_VISIBLE_DEVICES.
POOL = gpu_pool.from_environment()
c.Spawner.pre_spawn_hook, c.Spawner.post_stop_hook = POOL.hooks()

# configurable-http-proxy: the project's own copy (scripts/fetch_proxy.py), if
# fetched, else the one on PATH (npm install -g configurable-http-proxy).
_proxy = HERE / "proxy" / "node_modules" / ".bin" / "configurable-http-proxy"
if _proxy.exists():
    c.ConfigurableHTTPProxy.command = [str(_proxy)]
