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
from pathlib import Path
from types import SimpleNamespace

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
    assert culler["command"][-2:] == ["--timeout=600", "--cull-every=60"]
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
