"""The class hub (deploy/jupyterhub_config.py, COURSE_HUB_MODE=class), started for
real and attacked the way a student would attack it.

As root (CI is), a temporary class is made of real Unix users
(deploy/temporary_class.py): students alice, bob and carol, instructor ian, an
outsider mallory, and a sandbox user for grading; they and their homes are
removed afterwards, also when a test fails. The hub runs on free ports of
127.0.0.1 with a pool of two made-up GPUs, one per student. The instructors'
assignments and the git history are made private for the run (mode 0700, as
the guide says; the modes are put back afterwards). Then:

0. the hub is started in both modes with `--url http://0.0.0.0:PORT` on its
   command line, which jupyterhub applies after the configuration file: each
   refuses, saying why, before its proxy starts;
1. logins go through the real login form and PAM: students and the
   instructor get in, the outsider and a wrong password do not; only the
   instructor is admin;
2. alice and bob start servers (each as their own uid) and run ranks at the
   same moment; then alice tries, from her kernel, what a student would:
   bob's home, his processes' environments, his kernel's connection file and
   its ports, the hub's cookie secret, database and log, the proxy's token
   and API, bob's server with her token and her cookie, killing bob's ranks,
   an instructors' notebook through git (`git show HEAD:...`) and the
   history's files. Every attempt must fail (each HTTP one with its exact
   status code), and bob's ranks still answer; a third student is refused by
   the GPU pool, saying why;
3. a small assignment of this test's own (one hidden test) is released
   through nbgrader's exchange, alice and bob submit from their servers,
   alice also plants a submission in bob's name, and the instructor collects
   and autogrades with deploy/grade_sandboxed.py: the forged submission is
   not collected, and alice's code, run by the grader, cannot read the hidden
   test, the gradebook, bob's work or the repository's history, hits the
   memory and process limits, and leaves nothing behind. As root this test
   fails, rather than skips, where no network namespace can be made;
4. the hub is killed (SIGKILL) and started again with a short idle timeout:
   its idle culler ended with it, the new hub runs one and refuses the dead
   one's token, its proxy is replaced; it lends no GPU twice (the
   servers kept running and the pool learns what they hold), the admin stops
   bob's server, and the idle culler stops alice's server with all her
   processes (ranks, and one she detached), her GPU going back to the pool;
   meanwhile carol's server, started with a kernel idle timeout of 3 s,
   culls her idle kernel (its websocket open) and the kernel's ranks. Each
   stop of the hub must end its proxy and idle culler (deploy/hub_driver.py).

Not root: every test here skips, saying so. test_hub_config.py and test_hub_exposure.py check the
refusals (trial mode as root, open binds, missing admin) without a hub.

Run: sudo .venv/bin/python -m pytest tests/test_jupyterhub.py -v
     (130 to 240 s on 2 cores, by load)
"""
import asyncio
import json
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import nbformat
import psutil
import pytest
import requests

import hub_attacks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "deploy"))
import private_sources  # noqa: E402  (deploy/)
from hub_driver import (  # noqa: E402
    CONFIG,
    PROXY,
    Hub,
    HubProcess,
    LoginRefused,
    cullers,
    free_port,
    last_json,
    login_form,
    token_in_environment,
    token_of,
)
from temporary_class import ROOT, TemporaryClass, uid_processes  # noqa: E402  (deploy/)

pytestmark = pytest.mark.slow
ASSIGNMENTS = ROOT / "notebooks" / "assignments"
GIT_FOLDERS = private_sources.git_folders()  # .git; for a worktree, its folder and the main one
PEOPLE = ("alice", "bob", "carol", "ian")
STUDENTS = ("alice", "bob")  # the two who run ranks and attack


@pytest.fixture(scope="module")
def klass():
    if os.geteuid() != 0:
        pytest.skip("the class hub tests create Unix users: run them as root (CI does)")
    assert PROXY.exists(), f"{PROXY} is missing: run `make test` (or scripts/fetch_proxy.py)"
    assert shutil.which("git") and GIT_FOLDERS, "the attacks on the history need git and a clone"
    made = TemporaryClass()
    try:
        made.create(students=("alice", "bob", "carol"), instructors=("ian",),
                    outsiders=("mallory",), sandbox="sandbox")
        made.grant_python()
        made.close_sources()  # the modes are put back by remove()
        yield made
    finally:
        made.remove()


def class_settings(klass, state):
    """The class hub's environment in these tests: the temporary class, two made-up GPUs."""
    return {"COURSE_HUB_STATE": str(state), "COURSE_SPAWNER": "local",
            "COURSE_STUDENT_GROUP": klass.students_group,
            "COURSE_INSTRUCTOR_GROUP": klass.instructors_group,
            "COURSE_GPU_POOL": "0,1", "COURSE_GPUS_PER_USER": "1",
            "COURSE_GPU_WHEN_EMPTY": "refuse", "COURSE_CPUS_PER_USER": "1",
            "COURSE_IDLE_TIMEOUT": "3600", "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def hub(klass):
    folder = klass.base / "run"
    folder.mkdir(mode=0o700)
    process = HubProcess(folder, class_settings(klass, klass.base / "state"))
    process.start()
    yield process
    process.stop()


# --- 0. the address, checked after the command line -------------------------------

def test_an_address_beyond_loopback_on_the_command_line_is_refused_before_the_proxy_starts(
        klass):
    """`--url` is applied after the configuration file (jupyterhub's
    load_config_file merges the command line last) and replaces COURSE_HUB_URL's
    address: the proxy checks the final one. The trial mode runs as an ordinary
    user (ian), the class mode as root. (`--ip`, also applied last, changes no
    address once the file has set one: test_hub_exposure.py.)"""
    ian = klass.accounts["ian"]
    plain = {k: v for k, v in os.environ.items() if not k.startswith("COURSE_")}
    environments = {
        "trial": {**plain, "HOME": str(ian.home), "USER": ian.name, "COURSE_HUB_MODE": "trial",
                  "COURSE_GPU_POOL": "none", "COURSE_HUB_STATE": str(ian.home / "trial-state"),
                  "PYTHONPATH": str(ROOT)},
        "class": {**plain, **class_settings(klass, klass.base / "state-refused")}}
    gids = os.getgrouplist(ian.name, pwd.getpwnam(ian.name).pw_gid)
    as_ian = {"trial": dict(user=ian.uid, group=gids[0], extra_groups=gids), "class": {}}
    runs, urls = {}, {}
    for mode, env in environments.items():
        urls[mode] = f"http://0.0.0.0:{free_port()}/"
        ports = [f"--url={urls[mode]}", f"--JupyterHub.hub_bind_url=http://127.0.0.1:{free_port()}",
                 f"--ConfigurableHTTPProxy.api_url=http://127.0.0.1:{free_port()}"]
        out = open(klass.base / f"refused-{mode}.log", "w")  # a file: a stray proxy holds no pipe
        runs[mode] = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", str(CONFIG),
                                       *ports], cwd=Path(env["COURSE_HUB_STATE"]).parent,
                                      env=env, stdout=out, stderr=subprocess.STDOUT,
                                      **as_ian[mode])
        out.close()
    for mode, run in runs.items():
        try:
            run.wait(timeout=120)
        except subprocess.TimeoutExpired:  # it serves: the check was got past
            run.kill()
            run.wait()
        said = (klass.base / f"refused-{mode}.log").read_text()
        assert run.returncode == 1, f"{mode}: the hub ran on {urls[mode]}:\n{said[-3000:]}"
        assert "command-line options included" in said, said[-3000:]
        assert "Starting proxy" not in said and "is now running" not in said
        reason = {"trial": f"trial mode listens on loopback only, not {urls[mode]}",
                  "class": f"{urls[mode]} is not loopback: set COURSE_HUB_SSL_CERT"}[mode]
        assert reason in said, said[-3000:]


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()  # one loop: the kernels' websockets live in it
    yield loop
    loop.close()


class Person:
    def __init__(self, account, browser, token):
        self.account, self.browser, self.token = account, browser, token
        self.name, self.uid, self.home = account.name, account.uid, account.home


@pytest.fixture(scope="module")
def people(hub, klass):
    """Everyone of the class logged in through the login form, with an API token."""
    def log_in(short):
        account = klass.accounts[short]
        browser = login_form(hub.url, account.name, account.password)
        return Person(account, browser, token_of(browser, hub.url, account.name))
    with ThreadPoolExecutor(len(PEOPLE)) as pool:
        return dict(zip(PEOPLE, pool.map(log_in, PEOPLE)))


class Servers:
    def __init__(self, api, kernels):
        self.api, self.kernels = api, kernels


@pytest.fixture(scope="module")
def servers(loop, hub, people):
    """alice's and bob's servers started through the hub, a kernel open in each."""
    async def start():
        api = Hub(hub.url)
        await asyncio.gather(*(api.start_server(people[s].name, people[s].token)
                               for s in STUDENTS))
        kernels = await asyncio.gather(*(api.kernel(people[s].name, people[s].token)
                                         for s in STUDENTS))
        return Servers(api, dict(zip(STUDENTS, kernels)))
    return loop.run_until_complete(start())


def with_log(hub, fn, *args):
    """Run a test's body; on failure, show the end of the hub's log too."""
    try:
        return fn(*args)
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- the hub's log:\n{hub.log()[-6000:]}") from None


def test_logins_go_through_pam_and_only_the_class_groups_get_in(hub, klass, people):
    refused = {"an outsider with his own password": ("mallory", None),
               "a student with a wrong password": ("bob", "not-the-password")}
    for short, password in refused.values():
        account = klass.accounts[short]
        with pytest.raises(LoginRefused, match="403"):
            login_form(hub.url, account.name, password or account.password)
    admin = {}
    for short in ("alice", "ian"):
        token = people[short].token
        reply = people[short].browser.get(hub.url + "hub/api/user", timeout=60,
                                          headers={"Authorization": f"token {token}"})
        admin[short] = reply.json()["admin"]
    assert admin == {"alice": False, "ian": True}, "the instructors' group, and only it, is admin"
    assert "Trial mode" not in people["alice"].browser.get(hub.url + "hub/login").text


# --- 2. ranks side by side, then alice against bob ------------------------------

def test_two_students_run_ranks_at_once_and_neither_reaches_the_other(loop, hub, klass,
                                                                       people, servers):
    with_log(hub, lambda: loop.run_until_complete(ranks_and_attacks(hub, klass, people, servers)))


async def together(kernels, go, codes):
    runs = [kernels[s].execute(code) for s, code in zip(STUDENTS, codes)]
    go.touch()
    return dict(zip(STUDENTS, map(last_json, await asyncio.gather(*runs))))


async def ranks_and_attacks(hub, klass, people, servers):
    sync = klass.base / "sync"
    sync.mkdir(mode=0o755, exist_ok=True)
    kernels = servers.kernels
    info = await together(kernels, sync / "go-start",
                          [hub_attacks.START.format(go=str(sync / "go-start"))] * 2)
    for s in STUDENTS:
        assert info[s]["uid"] == people[s].uid, f"{s}'s kernel runs as {s}'s own Unix user"
        assert Path(info[s]["python"]).resolve() == Path(sys.executable).resolve()
        assert Path(info[s]["labsupport"]).is_relative_to(ROOT)
        assert (info[s]["backend"], info[s]["cpus"]) == ("gloo", "1")  # the GPUs are made up
    assert sorted(info[s]["cuda"] for s in STUDENTS) == ["0", "1"], "one GPU each"
    results = await together(kernels, sync / "go-reduce", [hub_attacks.ALLREDUCE.format(
        go=str(sync / "go-reduce"), tag=10 * i) for i in range(2)])
    for i, s in enumerate(STUDENTS):
        assert [r[0] for r in results[s]] == [2.0 * 10 * i + 1] * 2, f"{s}: wrong sum"
    windows = [(min(r[1] for r in results[s]), max(r[2] for r in results[s])) for s in STUDENTS]
    assert max(w[0] for w in windows) < min(w[1] for w in windows), "the runs did not overlap"
    trees = {s: server_tree(info[s]) for s in STUDENTS}
    for s in STUDENTS:
        check_runs_as(people[s], trees[s])
    check_isolated(info, people)
    await alice_attacks_bob(hub, klass, people, servers, info, trees["bob"])
    assert last_json(await kernels["bob"].execute(hub_attacks.STILL_REDUCES)) == [2.0, 2.0], \
        "bob's group survives alice's signals and the garbage sent to its gloo ports"
    check_browser_cookie(hub, people)
    with pytest.raises(AssertionError, match=f"No GPU free for {people['carol'].name}"):
        await servers.api.start_server(people["carol"].name, people["carol"].token)


def server_tree(info):
    """The student's server and everything under it (kernel, process server, ranks)."""
    server = psutil.Process(info["kernel"]).parent()
    return [server, *server.children(recursive=True)]


def check_runs_as(person, tree):
    """Every process of the server's tree is the student's, none root; home 0700;
    the server's log is the student's own, and it culls idle kernels."""
    for proc in tree:
        assert set(proc.uids()) == {person.uid}, f"{proc.cmdline()[:3]} is not {person.name}'s"
        assert "--allow-root" not in proc.cmdline()
    assert stat.S_IMODE(person.home.stat().st_mode) == 0o700, "created 0755, made 0700 at spawn"
    log = person.home / ".course-hub" / "server.log"
    assert log.stat().st_uid == person.uid and stat.S_IMODE(log.stat().st_mode) == 0o600
    assert "Culling kernels with idle durations > 1800 seconds" in log.read_text()


def group_view(pids):
    """What root sees of a group (process server and ranks): sockets, folders, sessions."""
    seen = {"listen": set(), "remote": set(), "named_unix": [], "dirs": {}, "sessions": set()}
    for pid in pids:
        proc = psutil.Process(pid)
        for conn in proc.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                seen["listen"].add((conn.laddr.ip, conn.laddr.port))
            if conn.raddr:
                seen["remote"].add((conn.raddr.ip, conn.raddr.port))
        seen["named_unix"] += [c.laddr for c in proc.net_connections(kind="unix") if c.laddr]
        folder = os.path.dirname(os.readlink(f"/proc/{pid}/fd/1"))
        info = os.stat(folder)
        seen["dirs"][folder] = (stat.S_IMODE(info.st_mode), info.st_uid)
        seen["sessions"].add(os.getsid(pid))
    return seen


def check_isolated(info, people):
    """The two groups share nothing one could reach the other by."""
    view = {s: group_view([psutil.Process(info[s]["ranks"][0]).ppid(), *info[s]["ranks"]])
            for s in STUDENTS}
    for s, seen in view.items():
        assert all(ip in ("127.0.0.1", "::1") for ip, _ in seen["listen"] | seen["remote"])
        assert seen["named_unix"] == [], f"{s}: a Unix socket with a name (a way in)"
        assert set(seen["dirs"].values()) == {(0o700, people[s].uid)}, f"{s}: folder not private"
    a, b = view["alice"], view["bob"]
    assert len(a["listen"]) >= 2, "gloo's listening sockets should have been seen"
    assert not a["listen"] & b["listen"] and not a["remote"] & b["listen"]
    assert not b["remote"] & a["listen"] and not set(a["dirs"]) & set(b["dirs"])
    assert not a["sessions"] & b["sessions"]


def secrets_of(hub, klass, bob_kernel):
    """The values alice must find nowhere: the proxy's token, the cookie secret,
    bob's API token, bob's kernel's key."""
    hub_proc = psutil.Process(hub.proc.pid)
    own = [p for p in hub_proc.children() if p.uids().real == 0]  # proxy, culler; not servers
    proxy, = [p for p in own if "configurable-http-proxy" in " ".join(p.cmdline())]
    connection = json.loads(Path(connection_file(bob_kernel)).read_text())
    return {"the proxy's token": proxy.environ()["CONFIGPROXY_AUTH_TOKEN"],
            "the cookie secret":
                (klass.base / "state/jupyterhub_cookie_secret").read_text().strip(),
            "B's API token": psutil.Process(bob_kernel).environ()["JUPYTERHUB_API_TOKEN"],
            "B's kernel key": connection["key"]}, [hub_proc.pid, *[p.pid for p in own]]


def connection_file(kernel_pid):
    cmdline = psutil.Process(kernel_pid).cmdline()
    return cmdline[cmdline.index("-f") + 1]


async def alice_attacks_bob(hub, klass, people, servers, info, bob_tree):
    bob = people["bob"]
    hidden, hub_pids = secrets_of(hub, klass, info["bob"]["kernel"])
    server_port, = [c.laddr.port for c in bob_tree[0].net_connections(kind="inet")
                    if c.status == psutil.CONN_LISTEN]
    state = klass.base / "state"
    targets = {"home": str(bob.home), "connection_file": connection_file(info["bob"]["kernel"]),
               "pids": [p.pid for p in bob_tree], "hub_pids": hub_pids, "state": str(state),
               "hub_files": [str(state / f) for f in ("jupyterhub_cookie_secret",
                                                      "jupyterhub.sqlite")] + [str(hub.log_path)],
               "assignments": str(ASSIGNMENTS / "source"), "git": git_targets(),
               "proxy_api": f"http://127.0.0.1:{hub.api_port}/api/routes",
               "server_direct": f"http://127.0.0.1:{server_port}/user/{bob.name}/api/kernels",
               "server_proxied": hub.url + f"user/{bob.name}/api/kernels",
               "hub_user": hub.url + f"hub/api/users/{bob.name}", "secrets": hidden,
               "rank_ports": sorted({c.laddr.port for pid in info["bob"]["ranks"] for c in
                                     psutil.Process(pid).net_connections(kind="inet")
                                     if c.status == psutil.CONN_LISTEN})}
    check_owner_gets_in(targets, bob.token, hidden["the proxy's token"])
    check_git_reads_for_its_owner(targets["git"])
    for path in [bob.home / ".profile", targets["connection_file"], *targets["hub_files"]]:
        assert Path(path).exists(), f"{path}: a denial must not mean a wrong path"
    results = last_json(await servers.kernels["alice"].execute(
        hub_attacks.PEER.format(targets=json.dumps(targets))))
    allowed = [r for r in results if not r[1].startswith("denied")]
    assert not allowed, f"alice got through: {allowed}"
    assert len(results) >= 24 + 2 * len(targets["pids"])
    verdicts = dict(results)
    for what, code in HTTP_DENIALS.items():  # book/jupyterhub.md states these codes
        assert verdicts[what] == f"denied: HTTP {code}", (what, verdicts[what])
    check_git_denied(verdicts, targets["git"])
    print("alice against bob and the hub:\n" + "\n".join(f"  {w}: {v}" for w, v in results))
    await inject_into_bobs_kernel(servers, info, bob)
    for path in ("jupyterhub_cookie_secret", "jupyterhub.sqlite"):
        assert stat.S_IMODE((state / path).stat().st_mode) == 0o600
    assert stat.S_IMODE(state.stat().st_mode) == 0o700


# What each of alice's HTTP attempts gets (the owner gets 200 from each URL):
# configurable-http-proxy answers 403 to a request without its token; a user's
# server 403 to a valid token of another user; the hub's API 404 for a user
# the token may not see.
HTTP_DENIALS = {"proxy API without its token": 403, "proxy API with A's token": 403,
                "B's server API with A's token, straight to its port": 403,
                "B's server API with A's token, through the proxy": 403,
                "the hub's API for B with A's token": 404}


def git_targets():
    """An instructors' notebook as the history holds it, and files of the history."""
    listed = subprocess.run(["git", "-c", "safe.directory=*", "-C", str(ROOT), "ls-files",
                             "notebooks/assignments/source/*.ipynb"],
                            capture_output=True, text=True, check=True).stdout.split()
    objects = next(f / "objects" for f in reversed(GIT_FOLDERS) if (f / "objects").is_dir())
    files = [GIT_FOLDERS[0] / "HEAD", next(p for p in sorted(objects.rglob("*")) if p.is_file())]
    return {"repo": str(ROOT), "source": listed[0], "objects": str(objects),
            "files": [str(f) for f in files]}


def check_git_reads_for_its_owner(git):
    """The denial below means "not yours": root's git prints the solution."""
    shown = subprocess.run(["git", "-c", "safe.directory=*", "-C", git["repo"], "show",
                            "HEAD:" + git["source"]], capture_output=True, text=True)
    assert shown.returncode == 0 and "BEGIN SOLUTION" in shown.stdout, shown.stderr


def check_git_denied(verdicts, git):
    said = verdicts["git show HEAD:" + git["source"]]
    assert said.startswith("denied: git: fatal: not a git repository"), said


def check_owner_gets_in(targets, bob_token, proxy_token):
    """The URLs alice is denied work for their owner: her 403s and 404s mean "not
    yours", not a wrong address."""
    for url, token in ((targets["server_direct"], bob_token),
                       (targets["server_proxied"], bob_token),
                       (targets["hub_user"], bob_token), (targets["proxy_api"], proxy_token)):
        reply = requests.get(url, headers={"Authorization": f"token {token}"}, timeout=60)
        assert reply.status_code == 200, f"{url} with its owner's token: HTTP {reply.status_code}"


async def inject_into_bobs_kernel(servers, info, bob):
    connection = json.loads(Path(connection_file(info["bob"]["kernel"])).read_text())
    ports = {k: connection[k] for k in ("shell_port", "iopub_port", "stdin_port",
                                        "control_port", "hb_port")}
    marker = bob.home / f"written-by-alice-{secrets.token_hex(4)}"
    await servers.kernels["alice"].execute(hub_attacks.INJECT.format(
        targets=json.dumps({"ports": ports, "marker": str(marker)})))
    assert not marker.exists(), "alice's code ran in bob's kernel"


def check_browser_cookie(hub, people):
    """alice's browser, logged in, opens her own server, then bob's."""
    browser, alice, bob = people["alice"].browser, people["alice"].name, people["bob"].name
    own = browser.get(hub.url + f"user/{alice}/lab", timeout=60)
    assert own.status_code == 200 and "jupyter-config-data" in own.text
    theirs = browser.get(hub.url + f"user/{bob}/lab", timeout=60)
    assert theirs.status_code == 403, f"alice's cookie opened bob's server: {theirs.url}"
    assert "jupyter-config-data" not in theirs.text


# --- 3. grading --------------------------------------------------------------

NETNS_PROBE = ("import ctypes, sys\n"
               "sys.exit(ctypes.CDLL(None, use_errno=True).unshare(0x40000000) != 0)")


def test_autograding_runs_each_submission_sandboxed_and_collects_no_forgery(loop, hub, klass,
                                                                            people, servers):
    if subprocess.run([sys.executable, "-c", NETNS_PROBE]).returncode:  # root here (klass)
        pytest.fail("root cannot make a network namespace here (unshare(CLONE_NEWNET) "
                    "failed: no CAP_SYS_ADMIN, as in an unprivileged container): the grading "
                    "sandbox refuses to run students' code without one, so this attack cannot "
                    "run. Run the tests where root has CAP_SYS_ADMIN (CI does)")
    with_log(hub, lambda: loop.run_until_complete(grading(hub.url, klass, people, servers)))


def instructor(*command, cwd):
    """A command of the instructor (root), with the course's environment on PATH."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{command[:4]}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def release_tiny(klass):
    """The instructor's side: a private course directory with the test's own
    assignment, generated and released through a sticky exchange folder."""
    course, exchange = klass.base / "course", klass.base / "exchange"
    course.mkdir(mode=0o700)
    exchange.mkdir()
    os.chmod(exchange, 0o1777)  # sticky: no student renames the course's folder
    options = [f"--Exchange.root={exchange}", f"--CourseDirectory.course_id={klass.prefix}"]
    marker = f"hidden-{secrets.token_hex(8)}"
    hub_attacks.tiny_assignment(course / "source" / "tiny" / "tiny.ipynb", marker)
    for step in ("generate_assignment", "release_assignment"):
        instructor(sys.executable, "-m", "nbgrader", step, "tiny",
                   f"--CourseDirectory.root={course}", *options, cwd=course)
    return course, exchange / klass.prefix / "inbound", options, marker


def grader_targets(hub_url, klass, people, course, inbound, links):
    """What alice's graded code goes for: files and folders as root sees them."""
    alice, bob = people["alice"].name, people["bob"].name
    return {
        "files": {**{f"the {name} she planted": name for name in links},
                  "the source assignment": str(course / "source/tiny/tiny.ipynb"),
                  "the gradebook": str(course / "gradebook.db"),
                  "her autograded notebook": str(course / f"autograded/{alice}/tiny/tiny.ipynb"),
                  "B's submission": str(course / f"submitted/{bob}/tiny/tiny.ipynb")},
        "folders": {"the course": str(course), "B's home": str(people["bob"].home),
                    "the exchange's inbound": str(inbound),
                    "the repository's assignments": str(ASSIGNMENTS)},
        "urls": {"the hub": hub_url + "hub/api/"}, "git": git_targets()}


async def grading(hub_url, klass, people, servers):
    course, inbound, options, marker = release_tiny(klass)
    memory, processes = 2 << 30, 256  # per process; of the sandbox user (torch's threads count)
    links = {"gradebook-link": str(course / "gradebook.db"),
             "source-link": str(course / "source/tiny/tiny.ipynb")}
    targets = grader_targets(hub_url, klass, people, course, inbound, links)
    planted = f"planted-{secrets.token_hex(4)}"
    attack = hub_attacks.graded_attack({**targets, "marker_reversed": marker[::-1],
                                        "memory": memory, "processes": processes,
                                        "planted": planted})
    answers = {"alice": attack, "bob": "def square(x):\n    return x * x"}
    await asyncio.gather(*(servers.kernels[s].execute(hub_attacks.SUBMIT.format(
        options=options, answer=answers[s])) for s in STUDENTS))
    await servers.kernels["alice"].execute(hub_attacks.FORGE.format(
        inbound=str(inbound), bob=people["bob"].name, alice=people["alice"].name, links=links))
    grade = [sys.executable, str(ROOT / "deploy" / "grade_sandboxed.py")]
    said = instructor(*grade, "collect", "tiny", "--course-dir", str(course), *options, cwd=course)
    assert f"Not collected: {people['bob'].name}+tiny+2099" in said, said
    assert all(f"Not collected: the link {name}" in said for name in links), said
    collected = (course / f"submitted/{people['bob'].name}/tiny/tiny.ipynb").read_text()
    assert "return x * x" in collected and "return 0" not in collected
    said = instructor(*grade, "autograde", "tiny", "--course-dir", str(course),
                      "--sandbox-user", klass.accounts["sandbox"].name, "--memory", str(memory),
                      "--processes", str(processes), "--deadline", "300", *options, cwd=course)
    missing = [p for w, p in targets["files"].items()
               if "planted" not in w and not Path(p).exists()]
    assert not missing, f"a denial must not mean a wrong path: {missing}"
    check_graded(course, klass, people, said, marker, planted)


def check_graded(course, klass, people, said, marker, planted):
    from nbgrader.api import Gradebook
    for s in STUDENTS:
        assert f"{people[s].name}: graded" in said, said[-3000:]
    with Gradebook(f"sqlite:///{course}/gradebook.db", course_id=klass.prefix) as book:
        scores = {s: book.find_submission("tiny", people[s].name).score for s in STUDENTS}
    assert scores == {"alice": 3.0, "bob": 3.0}, "both answers are right, on 2 ranks too"
    graded = nbformat.read(course / f"autograded/{people['alice'].name}/tiny/tiny.ipynb", 4)
    outputs = [o for c in graded.cells for o in c.get("outputs", [])]
    assert marker not in json.dumps(outputs), "the hidden test's text reached alice's outputs"
    text = "".join(o.get("text", "") for o in outputs if o["output_type"] == "stream")
    lines = [t for t in text.splitlines() if t.startswith("ATTACK-RESULTS ")]
    assert len(lines) == 1, f"alice's attack printed no verdicts; her outputs: {outputs}"
    line, = lines
    results = json.loads(line.removeprefix("ATTACK-RESULTS "))
    allowed = [r for r in results if not r[1].startswith("denied")]
    assert not allowed, f"alice's graded code got through: {allowed}"
    verdicts = dict(results)
    assert verdicts["allocate twice the memory limit"] == "denied: MemoryError"
    assert verdicts["start more processes than the limit"] == "denied: BlockingIOError"
    check_git_denied(verdicts, git_targets())
    print("alice's code, as the grader ran it:\n" + "\n".join(f"  {w}: {v}" for w, v in results))
    assert uid_processes.pids_of(klass.accounts["sandbox"].uid) == [], "a sandbox process left"
    assert not (Path("/tmp") / planted).exists(), "a file left for the next submission"
    assert not list(Path("/tmp").glob("grade-*")), "a job folder left behind"


# --- 4. restart and idle culling --------------------------------------------------

def test_a_restarted_hub_lends_no_gpu_twice_and_idle_servers_are_culled(loop, hub, klass,
                                                                        people, servers):
    with_log(hub, lambda: loop.run_until_complete(restart_and_cull(hub, people, servers)))


async def mark_active(hub, api, names):
    now = datetime.now(UTC).isoformat().replace("+00:00", "Z")
    for name in names:
        await api.api("POST", f"hub/api/users/{name}/activity", hub.token,
                      body={"last_activity": now, "servers": {"": {"last_activity": now}}})


async def gone_within(uid, seconds, what):
    deadline = time.monotonic() + seconds
    while uid_processes.pids_of(uid):
        if time.monotonic() > deadline:
            left = [psutil.Process(p).cmdline()[:3] for p in uid_processes.pids_of(uid)]
            raise AssertionError(f"{what}: processes still there after {seconds} s: {left}")
        await asyncio.sleep(0.2)


async def logged_within(hub, text, seconds):
    """The hub logs text within seconds (a stop's hooks run after its processes end)."""
    deadline = time.monotonic() + seconds
    while text not in hub.log():
        assert time.monotonic() < deadline, f"the hub did not log {text!r} in {seconds} s"
        await asyncio.sleep(0.2)


KERNEL_IDLE = 3  # s: carol's server, started after the restart, culls kernels idle this long
RANKS = """
import json, os, labsupport as ls, torch.distributed as dist
cluster = ls.start(world_size=2)
cluster.run(dist.barrier)
print(json.dumps({"kernel": os.getpid(), "ranks": cluster.pids}))
"""


async def pids_gone_within(pids, seconds, what):
    deadline = time.monotonic() + seconds
    while left := [p for p in pids if psutil.pid_exists(p)]:
        assert time.monotonic() < deadline, f"{what}: {left} still there after {seconds} s"
        await asyncio.sleep(0.2)


async def kernel_culled(hub, api, carol):
    """carol's kernel, idle with its tab (websocket) still open, is shut down by her
    server, and its ranks and process server end with it; her server runs on."""
    await mark_active(hub, api, [carol.name])  # so that the hub's culler leaves her server
    kernel = await api.kernel(carol.name, carol.token)
    info = last_json(await kernel.execute(RANKS))
    doomed = [info["kernel"], psutil.Process(info["ranks"][0]).ppid(), *info["ranks"]]
    await mark_active(hub, api, [carol.name])
    log = carol.home / ".course-hub" / "server.log"
    assert f"Culling kernels with idle durations > {KERNEL_IDLE} seconds" in log.read_text()
    await pids_gone_within(doomed, KERNEL_IDLE + 20, "carol's idle kernel and its ranks")
    culled = f"Culling 'idle' kernel 'python3' ({kernel.id}) with 1 connections due to"
    assert culled in log.read_text(), "her server culled it, her tab still open"
    _, running = await api.api("GET", f"user/{carol.name}/api/kernels", carol.token)
    assert running == [], "her server answers, with no kernel left"


async def crash_and_restart(hub, api, **settings):
    """The hub is killed (SIGKILL: none of its cleanup runs) and started again.
    Its idle culler ends with it (its leash, deploy/service_leash.py), so the
    restarted hub runs one culler, not two; the dead culler's token, a role that
    may stop any server, is refused by the restarted hub; its proxy is replaced."""
    state = Path(hub.env["COURSE_HUB_STATE"])
    culler, = cullers(state)
    token = token_in_environment(culler)
    assert (await api.api("GET", "hub/api/users", token))[0] == 200, "the culler's own token"
    old = hub.crash()
    assert culler in old
    gone, left = psutil.wait_procs([culler], timeout=30)
    assert not left, "the culler of a crashed hub still runs (as root)"
    hub.start(**settings)
    assert len(cullers(state)) == 1, "one culler after a crash"
    with pytest.raises(AssertionError, match="HTTP 403"):
        await api.api("GET", "hub/api/users", token)
    _, left = psutil.wait_procs(old, timeout=30)
    assert not left, f"the crashed hub's {[p.cmdline()[:3] for p in left]} run on"


async def restart_and_cull(hub, people, servers):
    alice, bob, carol, ian = (people[s] for s in ("alice", "bob", "carol", "ian"))
    await servers.kernels["alice"].execute(
        "import subprocess, labsupport as ls, torch.distributed as dist\n"
        "subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
        "cluster = ls.start(world_size=2)\ncluster.run(dist.barrier)")
    idle_timeout = 20  # from mark_active to carol's refusal: a hub crash and start
    await mark_active(hub, servers.api, [alice.name, bob.name])  # idle from now on
    await crash_and_restart(hub, servers.api, COURSE_IDLE_TIMEOUT=str(idle_timeout),
                            COURSE_ACTIVITY_INTERVAL=str(idle_timeout // 2),  # its floor
                            COURSE_KERNEL_IDLE_TIMEOUT=str(KERNEL_IDLE))
    assert len(uid_processes.pids_of(alice.uid)) >= 5, "servers outlive the hub"
    for name, gpu in ((alice.name, "0"), (bob.name, "1")):
        assert f"gpu_pool: {name} still holds '{gpu}'" in hub.log(), "restored at start"
    refused = f"No GPU free for {carol.name}.*held by: {alice.name} \\(0\\), {bob.name} \\(1\\)"
    with pytest.raises(AssertionError, match=refused):
        await servers.api.start_server(carol.name, carol.token)
    await servers.api.api("DELETE", f"hub/api/users/{bob.name}/server", ian.token)
    await gone_within(bob.uid, 30, "bob's server stopped by the admin")
    # The hub answers a stop after 1 s (the culler's sake, jupyterhub_config.py) and
    # gives the GPUs back when the stop has ended.
    await logged_within(hub, f"gpu_pool: {bob.name} gave back '1'", 30)
    await servers.api.start_server(carol.name, carol.token)
    assert f"gpu_pool: {carol.name} gets CUDA_VISIBLE_DEVICES=" in hub.log()
    await asyncio.gather(gone_within(alice.uid, idle_timeout + 20, "alice's idle server"),
                         kernel_culled(hub, servers.api, carol))
    assert f"Culling server {alice.name} (inactive for" in hub.log(), "the culler stopped it"
    await logged_within(hub, f"gpu_pool: {alice.name} gave back '0'", 30)
    await servers.api.api("DELETE", f"hub/api/users/{carol.name}/server", ian.token)
    await gone_within(carol.uid, 30, "carol's server stopped by the admin")
