"""A real JupyterHub with the course's configuration (deploy/jupyterhub_config.py):
two users log in, start their servers, and run ranks from their kernels at the
same time; the GPU pool hands each its own (fake) GPU and refuses a third;
stopping a server leaves none of its processes behind.

Every port is picked free at run time; the hub, its proxy (configurable-http-proxy
from deploy/proxy/node_modules, installed by `make test` through
scripts/fetch_proxy.py) and the users' servers listen on 127.0.0.1 only.

Run: .venv/bin/python -m pytest tests/test_jupyterhub.py -v   (about 30 s)
"""
import asyncio
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from tornado.websocket import websocket_connect

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "deploy" / "jupyterhub_config.py"
PROXY = ROOT / "deploy" / "proxy" / "node_modules" / ".bin" / "configurable-http-proxy"
USERS = ("alice", "bob")
pytestmark = pytest.mark.slow

# The test's own additions to the course configuration: free ports and an
# admin service token (to create the users); everything else is the course's.
WRAPPER = """
c = get_config()
load_subconfig({config!r})
c.JupyterHub.hub_bind_url = "http://127.0.0.1:{hub_port}"
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{api_port}"
c.JupyterHub.services = [{{"name": "course-test", "api_token": {token!r}}}]
c.JupyterHub.load_roles = [{{"name": "course-test", "services": ["course-test"],
                             "scopes": ["admin:users", "admin:servers"]}}]
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_of(user, hub_port):
    """Every live process this hub started for user: they inherit JUPYTERHUB_USER,
    and JUPYTERHUB_API_URL names this hub's port (another hub's users do not count)."""
    found = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if (env.get("JUPYTERHUB_USER") == user and proc.status() != "zombie"
                    and f":{hub_port}/" in env.get("JUPYTERHUB_API_URL", "")):
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


class Hub:
    """The hub's REST API and each user's server, through the proxy."""

    def __init__(self, url, admin_token, hub_port):
        self.url, self.admin_token, self.tokens = url, admin_token, {}
        self.hub_port = hub_port  # the hub's own API port, private to this run
        self.http = AsyncHTTPClient()

    async def api(self, method, path, token, body=None, ok=(200, 201, 202, 204)):
        req = HTTPRequest(self.url + path, method=method, request_timeout=120,
                          headers={"Authorization": f"token {token}"},
                          body=None if body is None and method == "GET" else json.dumps(body or {}),
                          allow_nonstandard_methods=True)
        try:
            resp = await self.http.fetch(req)
        except HTTPClientError as e:
            if e.code in ok:
                return e.code, None
            detail = e.response.body.decode() if e.response else ""
            raise AssertionError(f"{method} {path}: HTTP {e.code} {detail}") from None
        text = resp.body.decode()
        return resp.code, json.loads(text) if text.strip() else None

    async def login(self, user):
        """The user's own token, from their user name and password (the dummy login)."""
        _, reply = await self.api("POST", f"hub/api/users/{user}/tokens", token="",
                                  body={"auth": {"username": user, "password": "any"}})
        self.tokens[user] = reply["token"]

    async def start_server(self, user):
        await self.api("POST", f"hub/api/users/{user}/server", self.tokens[user])
        for _ in range(600):
            _, model = await self.api("GET", f"hub/api/users/{user}", self.tokens[user])
            if model["servers"].get("", {}).get("ready"):
                return
            await asyncio.sleep(0.2)
        raise AssertionError(f"{user}'s server did not become ready")

    async def kernel(self, user):
        _, specs = await self.api("GET", f"user/{user}/api/kernelspecs", self.tokens[user])
        assert specs["kernelspecs"]["python3"]["spec"]["display_name"] == "Python 3 (course)"
        _, k = await self.api("POST", f"user/{user}/api/kernels", self.tokens[user],
                              body={"name": "python3"})
        ws_url = self.url.replace("http", "ws", 1) + f"user/{user}/api/kernels/{k['id']}/channels"
        ws = await websocket_connect(HTTPRequest(
            ws_url, headers={"Authorization": f"token {self.tokens[user]}"}))
        return Kernel(ws)


class Kernel:
    """Executes code in a kernel over its websocket (Jupyter messaging protocol)."""

    def __init__(self, ws):
        self.ws, self.session = ws, uuid.uuid4().hex

    async def execute(self, code, timeout=120):
        """Run code; the text of its stdout, or AssertionError with the traceback."""
        msg_id = uuid.uuid4().hex
        await self.ws.write_message(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": "execute_request", "session": self.session,
                       "username": "", "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": False,
                        "user_expressions": {}, "allow_stdin": False, "stop_on_error": True}}))
        out, error = [], None
        async with asyncio.timeout(timeout):
            while True:
                msg = json.loads(await self.ws.read_message())
                if msg.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind = msg["msg_type"]
                if kind == "stream":
                    out.append(msg["content"]["text"])
                elif kind == "error":
                    error = "\n".join(msg["content"]["traceback"])
                elif kind == "status" and msg["content"]["execution_state"] == "idle":
                    break
        if error:
            raise AssertionError(f"the kernel raised:\n{error}")
        return "".join(out)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    assert PROXY.exists(), (f"{PROXY} is missing: run `make test` (or "
                            "`python3 scripts/fetch_proxy.py`), which installs it")
    tmp = tmp_path_factory.mktemp("hub")
    port, hub_port, token = free_port(), free_port(), secrets.token_hex(16)
    wrapper = tmp / "test_config.py"
    wrapper.write_text(WRAPPER.format(config=str(CONFIG), hub_port=hub_port,
                                      api_port=free_port(), token=token))
    env = {**os.environ, "COURSE_HUB_URL": f"http://127.0.0.1:{port}",
           "COURSE_HUB_HOME": str(tmp / "home" / "{username}"),
           "COURSE_GPU_POOL": "0,1", "COURSE_GPUS_PER_USER": "1",
           "COURSE_GPU_WHEN_EMPTY": "refuse", "PYTHONPATH": str(ROOT)}
    env.pop("COURSE_HUB_PASSWORD", None)
    log = open(tmp / "hub.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", str(wrapper)],
                            cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                pass
            urllib.request.urlopen(url + "hub/api/", timeout=5)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"the hub did not start:\n{(tmp / 'hub.log').read_text()[-4000:]}")
            time.sleep(0.2)
    yield Hub(url, token, hub_port), tmp
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


START = """
import json, os, sys, time
import labsupport as ls
import torch.distributed as dist
while not os.path.exists({go!r}):
    time.sleep(0.01)
cluster = ls.start(world_size=2)
cluster.run(dist.barrier)
print(json.dumps({{"kernel": os.getpid(), "ranks": cluster.pids, "python": sys.executable,
                  "labsupport": ls.__file__, "backend": cluster.backend,
                  "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}}))
"""

# Ten all-reduces over about half a second, so the two users' runs overlap.
ALLREDUCE = """
while not os.path.exists({go!r}):
    time.sleep(0.01)
def allreduce(tag):
    import time, torch, torch.distributed as dist
    start = time.time()
    for _ in range(10):
        t = torch.tensor([float(dist.get_rank() + tag)])
        dist.all_reduce(t)
        time.sleep(0.05)
    return t.item(), start, time.time()
print(json.dumps(cluster.run(allreduce, {tag}, timeout=60)))
"""

# What one user's kernel can see of another's group (given its process ids):
# the same observations as tests/test_launcher_isolation.py makes of one group.
PROBE = """
import psutil, stat
def probe(pids):
    seen = {{"listen": [], "remote": [], "named_unix": [], "dirs": {{}}, "sessions": []}}
    for pid in pids:
        p = psutil.Process(pid)
        for conn in p.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                seen["listen"].append([conn.laddr.ip, conn.laddr.port])
            if conn.raddr:
                seen["remote"].append([conn.raddr.ip, conn.raddr.port])
        seen["named_unix"] += [c.laddr for c in p.net_connections(kind="unix") if c.laddr]
        folder = os.path.dirname(os.readlink(f"/proc/{{pid}}/fd/1"))
        seen["dirs"][folder] = stat.S_IMODE(os.stat(folder).st_mode)
        seen["sessions"].append(os.getsid(pid))
    return seen
print(json.dumps({{"mine": probe({mine}), "theirs": probe({theirs}),
                  "my_session": os.getsid(0), "current": ls.current().pids}}))
"""


def last_json(text):
    return json.loads(text.strip().splitlines()[-1])


def check_isolated(seen, mine, theirs):
    """Assert that the two users' groups share nothing one could reach the other by."""
    for who in ("mine", "theirs"):
        for ip, port in seen[who]["listen"] + seen[who]["remote"]:
            assert ip in ("127.0.0.1", "::1"), f"{who}: a socket on {ip}:{port}, not loopback"
        assert seen[who]["named_unix"] == [], f"{who}: a Unix socket with a name (a way in)"
        assert set(seen[who]["dirs"].values()) == {0o700}, f"{who}: group folder not private"
    assert len(seen["mine"]["listen"]) >= 2, "gloo's listening sockets should have been seen"
    mine_ports = {tuple(a) for a in seen["mine"]["listen"]}
    their_ports = {tuple(a) for a in seen["theirs"]["listen"]}
    assert not mine_ports & their_ports, "two groups listen on one port"
    assert not {tuple(a) for a in seen["mine"]["remote"]} & their_ports, "connected across users"
    assert not {tuple(a) for a in seen["theirs"]["remote"]} & mine_ports, "connected across users"
    assert not set(seen["mine"]["dirs"]) & set(seen["theirs"]["dirs"]), "a shared group folder"
    assert seen["my_session"] not in seen["theirs"]["sessions"]
    assert sorted(seen["current"]) == sorted(mine["ranks"])
    assert not set(mine["ranks"]) & set(theirs["ranks"])


async def gone_within(hub, user, seconds):
    deadline = time.monotonic() + seconds
    while processes_of(user, hub.hub_port):
        if time.monotonic() > deadline:
            left = [psutil.Process(p).cmdline()[:3] for p in processes_of(user, hub.hub_port)]
            raise AssertionError(f"{user}'s processes still there {seconds} s after stop: {left}")
        await asyncio.sleep(0.1)


def test_two_users_run_ranks_at_once_each_on_its_own_gpus_and_leave_nothing_behind(hub):
    hub, tmp = hub
    try:
        asyncio.run(scenario(hub, tmp))
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- the hub's log:\n{(tmp / 'hub.log').read_text()[-6000:]}")


async def together(kernels, go, codes):
    """Run each user's code in their kernel at the same moment; their last JSON lines."""
    runs = [kernels[u].execute(code) for u, code in zip(USERS, codes)]
    go.touch()
    return dict(zip(USERS, map(last_json, await asyncio.gather(*runs))))


async def scenario(hub, tmp):
    started = time.monotonic()
    await hub.api("POST", "hub/api/users", hub.admin_token,
                  body={"usernames": [*USERS, "carol"]})
    await asyncio.gather(*(hub.login(u) for u in (*USERS, "carol")))
    await asyncio.gather(*(hub.start_server(u) for u in USERS))
    kernels = dict(zip(USERS, await asyncio.gather(*(hub.kernel(u) for u in USERS))))
    info = await start_groups_together(kernels, tmp / "go-start")
    await allreduce_together(kernels, tmp / "go-allreduce")
    await neither_reaches_the_other(kernels, info)
    await pool_refuses_then_stop_cleans_up(hub, kernels, info, tmp)
    print(f"hub scenario: {time.monotonic() - started:.1f} s")


async def start_groups_together(kernels, go):
    """1. Both users start a 2-rank group at the same moment, in the course environment."""
    info = await together(kernels, go, [START.format(go=str(go))] * 2)
    for user in USERS:
        assert Path(info[user]["python"]).resolve() == Path(sys.executable).resolve(), \
            "the kernel runs in the course environment"
        assert Path(info[user]["labsupport"]).is_relative_to(ROOT)
        assert info[user]["backend"] == "gloo"  # the GPUs of the pool are fake here
    assert sorted(info[u]["cuda"] for u in USERS) == ["0", "1"], "one GPU each, not the same"
    return info


async def allreduce_together(kernels, go):
    """2. Both all-reduce at the same time: right results, overlapping runs."""
    results = await together(kernels, go, [ALLREDUCE.format(go=str(go), tag=10 * i)
                                           for i in range(len(USERS))])
    for i, user in enumerate(USERS):
        assert [r[0] for r in results[user]] == [2.0 * 10 * i + 1] * 2, f"{user}: wrong sum"
    windows = [(min(r[1] for r in results[u]), max(r[2] for r in results[u])) for u in USERS]
    assert max(w[0] for w in windows) < min(w[1] for w in windows), "the runs did not overlap"


async def neither_reaches_the_other(kernels, info):
    """3. Neither group is reachable from the other user's kernel; cleanup stays local."""
    for me, them in (USERS, USERS[::-1]):
        mine = [psutil.Process(info[me]["ranks"][0]).ppid(), *info[me]["ranks"]]
        theirs = [psutil.Process(info[them]["ranks"][0]).ppid(), *info[them]["ranks"]]
        seen = last_json(await kernels[me].execute(PROBE.format(mine=mine, theirs=theirs)))
        check_isolated(seen, info[me], info[them])
    await kernels["alice"].execute("ls.shutdown()")
    assert last_json(await kernels["bob"].execute("print(cluster.run(lambda: 5))")) == [5, 5]


async def pool_refuses_then_stop_cleans_up(hub, kernels, info, tmp):
    """4. A third user is refused, saying why. 5. A server stopped through the hub
    leaves nothing of its user within 5 s, and its GPU goes to the third user."""
    with pytest.raises(AssertionError) as refused:
        await hub.start_server("carol")
    assert "No GPU free for carol" in str(refused.value)
    await kernels["alice"].execute("cluster = ls.start(world_size=2); cluster.run(dist.barrier)")
    for user in USERS:  # each: server, kernel, process server, 2 ranks (at least)
        assert len(processes_of(user, hub.hub_port)) >= 5, f"{user}'s ranks should be running"
    await hub.api("DELETE", "hub/api/users/alice/server", hub.tokens["alice"])
    await gone_within(hub, "alice", 5)
    await hub.start_server("carol")
    log = (tmp / "hub.log").read_text()
    assert f"gpu_pool: carol gets CUDA_VISIBLE_DEVICES='{info['alice']['cuda']}'" in log
    for user in ("bob", "carol"):
        await hub.api("DELETE", f"hub/api/users/{user}/server", hub.tokens[user])
    await asyncio.gather(gone_within(hub, "bob", 5), gone_within(hub, "carol", 5))
