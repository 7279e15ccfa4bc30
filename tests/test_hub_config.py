"""The course hub's configuration, without a running hub (tests/test_jupyterhub.py
runs one): what the hub refuses to start with, the configuration the trial mode
loads, the class spawners' account checks, the GPUs a running server holds
given back to the pool after a hub restart, the systemd unit the pinned
SystemdSpawner would start (device fence, limits), and the grading sandbox's
refusals. No Unix user is created; one test needs root and skips otherwise.

Run: .venv/bin/python -m pytest tests/test_hub_config.py   (a few seconds)
"""
import asyncio
import logging
import os
import pwd
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from jupyterhub import orm
from traitlets.config.loader import PyFileConfigLoader

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "deploy"))
import class_spawner  # noqa: E402
import course_proxy  # noqa: E402
import gpu_pool  # noqa: E402
import hub_settings  # noqa: E402
import private_sources  # noqa: E402
import sandbox_kernel  # noqa: E402
import service_tokens  # noqa: E402
import systemdspawner.systemd as systemd  # noqa: E402
import uid_processes  # noqa: E402


def refusals(monkeypatch, euid=0, **environ):
    monkeypatch.setattr(hub_settings.os, "geteuid", lambda: euid)
    return "\n".join(hub_settings.refusals(hub_settings.read(environ)))


def test_trial_mode_is_loopback_only_and_never_root(monkeypatch, tmp_path):
    state = str(tmp_path / "state")
    said = refusals(monkeypatch, COURSE_HUB_MODE="trial", COURSE_HUB_STATE=state,
                    COURSE_HUB_URL="http://0.0.0.0:8000")
    assert "listens on loopback only, not http://0.0.0.0:8000" in said
    assert "refuses to run as root" in said and "every user would be root" in said
    assert refusals(monkeypatch, euid=1000, COURSE_HUB_MODE="trial", COURSE_HUB_STATE=state,
                    COURSE_HUB_URL="http://[::1]:8000") == ""
    assert hub_settings.is_loopback("http://localhost:8000")
    assert not hub_settings.is_loopback("http://hub.example.org:8000")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_jupyterhub_itself_exits_before_serving_a_trial_hub_as_root(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("checks what the hub does when started as root: run as root (CI does)")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("COURSE_")}
    run = subprocess.run([sys.executable, "-m", "jupyterhub", "-f",
                          str(ROOT / "deploy" / "jupyterhub_config.py")], cwd=tmp_path,
                         env={**env, "COURSE_HUB_MODE": "trial", "COURSE_GPU_POOL": "none",
                              "COURSE_HUB_URL": f"http://127.0.0.1:{port}",
                              "COURSE_HUB_STATE": str(tmp_path / "state")},
                         capture_output=True, text=True, timeout=120)
    said = run.stdout + run.stderr
    assert run.returncode != 0 and "trial mode refuses to run as root" in said
    assert "is now running" not in said and not (tmp_path / "state").exists()


def test_class_mode_refuses_what_would_be_unsafe(monkeypatch, tmp_path):
    said = refusals(monkeypatch, COURSE_STUDENT_GROUP="no-such-group-x1",
                    COURSE_HUB_STATE=str(ROOT / "state"), COURSE_HUB_URL="http://0.0.0.0:8000",
                    COURSE_IDLE_TIMEOUT="soon")
    assert "the Unix group 'no-such-group-x1' does not exist" in said
    assert "inside the repository" in said
    assert "is not loopback: set COURSE_HUB_SSL_CERT" in said
    assert "COURSE_IDLE_TIMEOUT='soon'" in said
    if os.stat(hub_settings.ASSIGNMENTS).st_mode & 0o007:
        assert "chmod -R go-rwx" in said, "the instructors' assignments are open to students"
    for folder in private_sources.git_folders():  # a clone's .git is 0755
        if os.stat(folder).st_mode & 0o005 == 0o005:
            assert f"git history in {folder} can be read by students" in said
    said = refusals(monkeypatch, euid=1000, COURSE_HUB_STATE=str(tmp_path))
    assert said.startswith("class mode needs root")


def test_class_mode_needs_an_admin(monkeypatch, tmp_path):
    groups = {"students": SimpleNamespace(gr_gid=4242, gr_mem=["ann"]),
              "teachers": SimpleNamespace(gr_gid=4243, gr_mem=[])}
    monkeypatch.setattr(hub_settings.grp, "getgrnam", lambda name: groups[name])
    environ = {"COURSE_STUDENT_GROUP": "students", "COURSE_INSTRUCTOR_GROUP": "teachers",
               "COURSE_HUB_STATE": str(tmp_path)}
    assert "no admin: add an instructor to the group 'teachers'" in refusals(monkeypatch,
                                                                             **environ)
    assert "no admin" not in refusals(monkeypatch, COURSE_ADMIN_USERS="ian", **environ)


def test_the_trial_configuration_is_labelled_culls_and_keeps_secrets_out_of_the_repo(
        monkeypatch, tmp_path):
    monkeypatch.setattr(hub_settings.os, "geteuid", lambda: 1000)
    for name in [k for k in os.environ if k.startswith("COURSE_")]:
        monkeypatch.delenv(name)
    for name, value in {"COURSE_HUB_MODE": "trial", "COURSE_HUB_STATE": str(tmp_path / "s"),
                        "COURSE_GPU_POOL": "none", "COURSE_IDLE_TIMEOUT": "600",
                        "COURSE_KERNEL_IDLE_TIMEOUT": "300"}.items():
        monkeypatch.setenv(name, value)
    c = PyFileConfigLoader("jupyterhub_config.py", str(ROOT / "deploy")).load_config()
    assert "Trial mode" in c.JupyterHub.template_vars["announcement"]
    assert c.JupyterHub.proxy_class is course_proxy.CourseProxy
    assert c.CourseProxy.course_mode == "trial"
    culler, = c.JupyterHub.services
    leash = [sys.executable, str(ROOT / "deploy" / "service_leash.py"), str(os.getpid()), "--"]
    assert culler["command"][:4] == leash, "it ends with the hub (service_leash.py)"
    assert culler["command"][-3:-1] == ["--timeout=600", "--cull-every=60"]
    assert culler["command"][-1] == f"--concurrency={max(10, 4 * os.cpu_count())}"
    assert c.JupyterHub.tornado_settings["slow_stop_timeout"] == 1, "it culls in parallel"
    assert "--MappingKernelManager.cull_idle_timeout=300" in c.Spawner.args
    assert "--MappingKernelManager.cull_connected=True" in c.Spawner.args
    assert not any("allow-root" in a for a in c.Spawner.args)
    assert c.JupyterHub.db_url == f"sqlite:///{tmp_path / 's' / 'jupyterhub.sqlite'}"
    assert Path(c.JupyterHub.cookie_secret_file).parent == tmp_path / "s"
    assert oct((tmp_path / "s").stat().st_mode & 0o777) == "0o700"
    assert oct((tmp_path / "s" / "jupyterhub.sqlite").stat().st_mode & 0o777) == "0o600"


def account(home, uid):
    return SimpleNamespace(pw_name="ann", pw_uid=uid, pw_gid=uid, pw_dir=str(home))


def test_an_account_is_checked_before_its_server_starts(monkeypatch, tmp_path):
    uid = os.getuid() if os.getuid() >= 1000 else 1000
    monkeypatch.setattr(class_spawner, "uid_min", lambda: 1000)
    home = tmp_path / "ann"
    entry = {"ann": account(home, uid)}
    monkeypatch.setattr(class_spawner.pwd, "getpwnam", lambda name: entry[name])
    with pytest.raises(PermissionError, match="not a persistent folder"):
        class_spawner.checked_account("ann")  # tmp_path is under /tmp
    monkeypatch.setattr(class_spawner, "VOLATILE", ())
    with pytest.raises(PermissionError, match="does not exist"):
        class_spawner.checked_account("ann")
    home.mkdir(mode=0o755)
    if os.stat(home).st_uid != uid:
        with pytest.raises(PermissionError, match="must be a folder owned by ann"):
            class_spawner.checked_account("ann")
        entry["ann"] = account(home, os.stat(home).st_uid)
        monkeypatch.setattr(class_spawner, "uid_min", lambda: 0)
    class_spawner.checked_account("ann")
    assert oct(home.stat().st_mode & 0o777) == "0o700", "a home others could enter is closed"
    entry["ann"] = account(home, 0)
    monkeypatch.setattr(class_spawner, "uid_min", lambda: 1000)
    with pytest.raises(PermissionError, match="below UID_MIN"):
        class_spawner.checked_account("ann")
    with pytest.raises(PermissionError, match="no Unix account"):
        class_spawner.checked_account("nobody-here-x1")


def test_uid_min_is_read_from_login_defs(tmp_path):
    defs = tmp_path / "login.defs"
    defs.write_text("# comment\nUID_MIN\t\t\t 2000\nUID_MAX 60000\n")
    assert class_spawner.uid_min(defs) == 2000
    assert class_spawner.uid_min(tmp_path / "missing") == 1000
    with pytest.raises(ValueError, match="every process of root"):
        uid_processes.end_all(0)


def running_server():
    return SimpleNamespace(server=orm.Server(proto="http", ip="127.0.0.1", port=1,
                                             base_url="/user/ann/", cookie_name="c"))


def test_a_restarted_hub_gives_a_running_servers_gpus_back_to_the_pool(caplog):
    pool = gpu_pool.GPUPool(["0", "1", "2"], per_user=1)
    user = SimpleNamespace(name="ann", id=1)
    ann = class_spawner.ClassLocalSpawner(user=user, orm_spawner=running_server(), gpu_pool=pool)
    ann.load_state({"pid": 123, "gpus": ["1"]})
    assert pool.holders() == {"ann": ("1",)} and ann.get_state() == {"pid": 123, "gpus": ["1"]}
    assert pool.acquire("bob") == ("0",) and pool.acquire("cem") == ("2",), "1 is not lent again"
    stopped = class_spawner.ClassLocalSpawner(user=SimpleNamespace(name="dan", id=2),
                                              gpu_pool=pool)
    stopped.load_state({"gpus": ["0"]})  # state of a server the hub no longer runs
    assert "dan" not in pool.holders()
    bob = class_spawner.ClassLocalSpawner(user=SimpleNamespace(name="bob", id=3),
                                          orm_spawner=running_server(), gpu_pool=pool)
    with caplog.at_level(logging.ERROR):
        bob.load_state({"gpus": ["1"]})  # a database that says two servers hold GPU 1
    assert "held by two running servers" in caplog.text
    ann.clear_state()
    assert "gpus" not in ann.get_state()


def fake_driver(folder, gpus):
    """/proc/driver/nvidia/gpus as the NVIDIA driver writes it: (bus id, uuid, minor)."""
    for bus, uuid, minor in gpus:
        (folder / bus).mkdir(parents=True)
        (folder / bus / "information").write_text(
            f"Model: \t\t NVIDIA H100\nGPU UUID: \t {uuid}\nBus Location: \t {bus}\n"
            f"Device Minor: \t {minor}\n")
    return folder


def start_unit(spawner, tmp_path, monkeypatch):
    """The systemd-run command line the spawner's start() runs (nothing is run)."""
    ran = []

    async def capture(*command, **_):
        ran.append(command)
        return SimpleNamespace(returncode=0, wait=lambda: asyncio.sleep(0, 0))

    async def no(*_):
        return False
    monkeypatch.setattr(systemd, "RUN_ROOT", str(tmp_path))  # its environment file
    monkeypatch.setattr(systemd.asyncio, "create_subprocess_exec", capture)
    monkeypatch.setattr(systemd, "service_running", no)
    monkeypatch.setattr(systemd, "service_failed", no)
    monkeypatch.setattr(class_spawner, "checked_account", lambda name: None)
    spawner.cmd, spawner.start_timeout = [sys.executable, "-m", "jupyterhub.singleuser"], 0
    monkeypatch.setattr(spawner, "get_env", lambda: {"JUPYTERHUB_API_TOKEN": "t"})
    asyncio.run(spawner.start())
    return ran[-1]


def test_the_systemd_unit_fences_gpus_and_limits_with_the_pinned_spawner(monkeypatch, tmp_path):
    user = SimpleNamespace(name="nobody", id=7)  # any account: the check is stubbed
    plain = class_spawner.SystemdSpawner(user=user)
    plain.unit_extra_properties = {"DeviceAllow": ["/dev/nvidia0 rw", "/dev/nvidiactl rw"]}
    with pytest.raises(AttributeError, match="'list' object has no attribute 'format'"):
        start_unit(plain, tmp_path, monkeypatch)  # jupyterhub-systemdspawner 1.0.2 as it is
    driver = fake_driver(tmp_path / "gpus", [("0000:3b:00.0", "GPU-aaa", 4),
                                             ("0000:af:00.0", "GPU-bbb", 1)])
    monkeypatch.setattr(gpu_pool, "DRIVER_GPUS", driver)
    ours = class_spawner.ClassSystemdSpawner(user=user, processes=512, cpu_limit=4.0,
                                             mem_limit="32G")
    ours.gpu_ids = ("GPU-bbb",)
    command = start_unit(ours, tmp_path, monkeypatch)
    properties = [a.removeprefix("--property=") for a in command if a.startswith("--property=")]
    assert "DevicePolicy=closed" in properties and "TasksMax=512" in properties
    allowed = [p.removeprefix("DeviceAllow=") for p in properties if p.startswith("DeviceAllow=")]
    assert "/dev/nvidia1 rw" in allowed and "/dev/nvidia4 rw" not in allowed, "bbb, minor 1"
    assert {"CPUQuota=400%", "MemoryMax=34359738368", "PrivateTmp=yes",
            "NoNewPrivileges=yes"} <= set(properties)
    assert f"--uid={pwd.getpwnam('nobody').pw_uid}" in command


def test_gpu_device_files_come_from_the_driver_by_uuid_or_pci_order(tmp_path):
    driver = fake_driver(tmp_path, [("0000:af:00.0", "GPU-bbb", 0),
                                    ("0000:3b:00.0", "GPU-aaa", 7)])
    assert gpu_pool.device_nodes(["GPU-bbb", "GPU-aaa"], driver) == ["/dev/nvidia0",
                                                                     "/dev/nvidia7"]
    assert gpu_pool.device_nodes(["0", "1"], driver) == ["/dev/nvidia7", "/dev/nvidia0"]
    with pytest.raises(ValueError, match="'GPU-ccc' is not one of the 2 GPUs"):
        gpu_pool.device_nodes(["GPU-ccc"], driver)


def test_the_grading_sandbox_never_runs_student_code_as_root():
    with pytest.raises(SystemExit, match="root is root or in root's group"):
        sandbox_kernel.sandbox_account("root")
    args = sandbox_kernel.parse(["--user", "x", "--job", "/j", "--memory", "1", "--processes",
                                 "2", "--cpu-seconds", "3", "--", "/c.json", "--Foo.bar=1"])
    assert (args.connection_file, args.kernel_args) == ("/c.json", ["--Foo.bar=1"])


# --- a whole class at once: the spawn path's timeouts, the line, the services ---------

def documented_allowance():
    """The seconds the course documents for one server's start (book/jupyterhub.md)."""
    import re
    text = (ROOT / "book" / "jupyterhub.md").read_text()
    found = re.findall(r"each server is given \*\*(\d+) s\*\* to start", text)
    assert len(found) == 1, "book/jupyterhub.md states the allowance once"
    return int(found[0])


def loaded_hub(monkeypatch, tmp_path, **environ):
    """A JupyterHub app with the class configuration loaded as `jupyterhub -f` loads
    it (JupyterHub.load_config_file); the refusals, tested above, are left out."""
    from jupyterhub.app import JupyterHub
    monkeypatch.setattr(hub_settings, "refusals", lambda s: [])
    for name in [k for k in os.environ if k.startswith("COURSE_")]:
        monkeypatch.delenv(name)
    for name, value in {"COURSE_HUB_STATE": str(tmp_path / "s"), "COURSE_GPU_POOL": "0,1",
                        **environ}.items():
        monkeypatch.setenv(name, value)
    app = JupyterHub()
    app.load_config_file(str(ROOT / "deploy" / "jupyterhub_config.py"))
    return app


def short_timeouts(app, documented):
    """Every spawn-path timeout shorter than documented, as the spawner the hub
    would build sees it (class config resolved), and a throttle that fails spawns."""
    spawner = app.config.JupyterHub.spawner_class(config=app.config,
                                                  user=SimpleNamespace(name="ann", id=1))
    short = [f"{spawner.__class__.__name__}.{name}={getattr(spawner, name)}"
             for name in ("http_timeout", "start_timeout") if getattr(spawner, name) < documented]
    if app.concurrent_spawn_limit:
        short.append(f"JupyterHub.concurrent_spawn_limit={app.concurrent_spawn_limit} (429)")
    return short


@pytest.mark.parametrize("spawner", ["local", "systemd"])
def test_no_spawn_timeout_is_shorter_than_the_course_documents(monkeypatch, tmp_path, spawner):
    """jupyterhub 6.1.1 waits Spawner.start_timeout for start() (systemdspawner
    1.0.2 polls its unit that long), then Spawner.http_timeout for the server's
    first answer, which is the local spawner's whole import: its default of 30 s
    failed 13 of 14 spawns of a class on 2 cores. Both come from one place."""
    documented = documented_allowance()
    app = loaded_hub(monkeypatch, tmp_path, COURSE_SPAWNER=spawner)
    assert app.config.JupyterHub.spawner_class.__name__.lower() == f"class{spawner}spawner"
    assert short_timeouts(app, documented) == []
    assert app.config[app.config.JupyterHub.spawner_class.__name__].spawns_at_once >= 1
    app = loaded_hub(monkeypatch, tmp_path, COURSE_SPAWNER=spawner, COURSE_SERVER_START_S="30")
    assert short_timeouts(app, documented) == [
        f"Class{spawner.capitalize()}Spawner.http_timeout=30",
        f"Class{spawner.capitalize()}Spawner.start_timeout=30"], "the check can fail"


def test_kubernetes_spawn_timeouts_are_not_shorter_than_the_course_documents():
    import yaml
    values = yaml.safe_load((ROOT / "deploy" / "z2jh-values.yaml").read_text())
    documented = documented_allowance()
    assert values["hub"]["config"]["KubeSpawner"]["http_timeout"] >= documented
    assert values["singleuser"]["startTimeout"] >= documented  # KubeSpawner.start_timeout
    assert values["hub"]["config"]["JupyterHub"]["concurrent_spawn_limit"] == 0


def spawner_of(name, spawns_at_once, hook=None):
    spawner = class_spawner.ClassLocalSpawner(user=SimpleNamespace(name=name, id=hash(name)),
                                              spawns_at_once=spawns_at_once,
                                              pre_spawn_hook=hook)
    spawner._spawn_pending = True  # as the hub sets it before the pre-spawn hook
    return spawner


async def next_message(spawner):
    async for event in spawner.progress():
        return event["message"]


def test_spawns_beyond_the_line_wait_in_order_and_are_told_so(monkeypatch):
    monkeypatch.setattr(class_spawner.CourseSpawnerMixin, "lines", {})

    async def scenario():
        ann, bob, cem = (spawner_of(n, 1) for n in ("ann", "bob", "cem"))
        await asyncio.wait_for(ann.run_pre_spawn_hook(), 5)  # admitted at once
        waiting = [asyncio.ensure_future(s.run_pre_spawn_hook()) for s in (bob, cem)]
        await asyncio.sleep(0.1)
        assert not any(w.done() for w in waiting)
        assert (await next_message(bob)).startswith("Queued, number 1 in line. 1 servers")
        assert (await next_message(cem)).startswith("Queued, number 2 in line")
        assert "keep this page open" in await next_message(cem)
        ann._spawn_pending = False  # ann's server answered: bob's turn, then cem's
        await asyncio.wait_for(waiting[0], 5)
        assert not waiting[1].done() and ann.line.ahead_of(cem) == 0
        assert (await next_message(bob)).startswith("Starting your server")
        bob._spawn_pending = False  # a failed spawn ends the same way
        await asyncio.wait_for(waiting[1], 5)
        cem._spawn_pending = False
        await asyncio.sleep(0.5)
        assert ann.line.starting == set() and not ann.line.waiting
    asyncio.run(scenario())


def test_a_refused_spawn_gives_its_place_in_line_back(monkeypatch):
    monkeypatch.setattr(class_spawner.CourseSpawnerMixin, "lines", {})

    def no_gpu(spawner):
        raise RuntimeError("No GPU free")

    async def scenario():
        ann = spawner_of("ann", 1, hook=no_gpu)
        with pytest.raises(RuntimeError, match="No GPU free"):
            await ann.run_pre_spawn_hook()
        bob = spawner_of("bob", 1)
        await asyncio.wait_for(bob.run_pre_spawn_hook(), 5)  # no wait: ann left the line
        assert bob.line.starting == {bob}
        waiting = asyncio.ensure_future(spawner_of("cem", 1).run_pre_spawn_hook())
        await asyncio.sleep(0.1)
        waiting.cancel()  # a spawn abandoned in line leaves it
        await asyncio.sleep(0.1)
        assert not bob.line.waiting and bob.line.starting == {bob}
    asyncio.run(scenario())


def test_an_admin_without_a_unix_account_is_no_admin(monkeypatch, tmp_path):
    groups = {"students": SimpleNamespace(gr_gid=4242, gr_mem=["ann"]),
              "teachers": SimpleNamespace(gr_gid=4243, gr_mem=[])}
    monkeypatch.setattr(hub_settings.grp, "getgrnam", lambda name: groups[name])
    accounts = {"ian": SimpleNamespace(pw_name="ian")}

    def getpwnam(name):
        return accounts[name]
    monkeypatch.setattr(hub_settings.pwd, "getpwnam", getpwnam)
    environ = {"COURSE_STUDENT_GROUP": "students", "COURSE_INSTRUCTOR_GROUP": "teachers",
               "COURSE_HUB_STATE": str(tmp_path)}
    said = refusals(monkeypatch, COURSE_ADMIN_USERS="ian,typo-ian", **environ)
    assert "COURSE_ADMIN_USERS names 'typo-ian', who has no Unix account" in said
    assert "'ian'" not in said
    assert "no Unix account" not in refusals(monkeypatch, COURSE_ADMIN_USERS="ian", **environ)


def test_the_idle_timeout_has_a_floor_of_two_activity_reports(monkeypatch, tmp_path):
    trial = {"COURSE_HUB_MODE": "trial", "COURSE_HUB_STATE": str(tmp_path),
             "COURSE_HUB_URL": "http://127.0.0.1:8000"}
    said = refusals(monkeypatch, euid=1000, COURSE_IDLE_TIMEOUT="300", **trial)
    assert "COURSE_IDLE_TIMEOUT=300 is below its floor of 600 s" in said
    assert refusals(monkeypatch, euid=1000, COURSE_IDLE_TIMEOUT="600", **trial) == ""
    assert refusals(monkeypatch, euid=1000, COURSE_IDLE_TIMEOUT="120",
                    COURSE_ACTIVITY_INTERVAL="60", **trial) == ""


def test_a_leashed_service_ends_when_its_hub_is_killed(tmp_path):
    """The hub's stand-in starts a leashed sleep, then is SIGKILLed: the sleep ends."""
    import service_leash
    hub = subprocess.Popen([sys.executable, "-c", (
        f"import subprocess, sys, time\nsys.path.insert(0, {str(ROOT / 'deploy')!r})\n"
        "import service_leash\n"
        "p = subprocess.Popen(service_leash.command(['sleep', '600']))\n"
        "print(p.pid, flush=True)\ntime.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    service = psutil.Process(int(hub.stdout.readline()))
    deadline = time.monotonic() + 30
    while "sleep" not in service.cmdline()[:1] and time.monotonic() < deadline:
        time.sleep(0.05)  # the leash execs the service: same pid
    assert service.cmdline() == ["sleep", "600"]
    hub.kill()
    hub.wait()
    _, left = psutil.wait_procs([service], timeout=30)
    assert not left, "the service outlived its hub"
    late = subprocess.run(service_leash.command(["sleep", "600"], hub_pid=1), capture_output=True,
                          text=True, timeout=60)  # its parent is not pid 1: the hub is gone
    assert late.returncode != 0 and "is gone; not starting sleep" in late.stderr


def test_only_a_managed_services_current_token_is_kept():
    db = orm.new_session_factory("sqlite://")()
    culler, other = orm.Service(name="idle-culler"), orm.Service(name="course-test")
    db.add_all([culler, other, orm.OAuthClient(identifier="jupyterhub")])  # tokens' client
    db.commit()
    old, current = culler.new_api_token(), culler.new_api_token()
    kept = other.new_api_token()
    services = {"idle-culler": SimpleNamespace(managed=True, orm=culler, api_token=current),
                "course-test": SimpleNamespace(managed=False, orm=other, api_token=kept)}
    assert service_tokens.revoke_stale(db, services) == 1
    assert orm.APIToken.find(db, old) is None
    assert orm.APIToken.find(db, current) is not None and orm.APIToken.find(db, kept) is not None
