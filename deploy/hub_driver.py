"""Driving a real JupyterHub from the tests: start and stop the hub process on
free loopback ports, log in through its login form like a browser, call its
REST API and a user's server, and run code in a kernel over its websocket.

Used by tests/test_jupyterhub.py and the hub's load benchmark (labsupport/bench/hub.py).
"""
import asyncio
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import psutil
import requests
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from tornado.websocket import websocket_connect

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "deploy" / "jupyterhub_config.py"
PROXY = ROOT / "deploy" / "proxy" / "node_modules" / ".bin" / "configurable-http-proxy"

# The test's own additions to the course configuration: fixed loopback ports
# (the same across a restart: running servers call the hub's API port) and a
# service token that may create tokens and post activity; the rest is the course's.
WRAPPER = """
c = get_config()
load_subconfig({config!r})
c.JupyterHub.hub_bind_url = "http://127.0.0.1:{hub_port}"
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{api_port}"
c.JupyterHub.services.append({{"name": "course-test", "api_token": {token!r}}})
c.JupyterHub.load_roles.append({{"name": "course-test", "services": ["course-test"],
    "scopes": ["admin:users", "admin:servers", "users:activity", "read:users"]}})
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HubProcess:
    """The hub as a subprocess of the test; its log in folder/hub.log."""

    def __init__(self, folder, env):
        self.folder, self.env = Path(folder), env
        self.port, self.hub_port, self.api_port = free_port(), free_port(), free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}/"
        self.log_path, self.proc = self.folder / "hub.log", None
        self.wrapper = self.folder / "test_config.py"
        self.wrapper.write_text(WRAPPER.format(config=str(CONFIG), hub_port=self.hub_port,
                                               api_port=self.api_port, token=self.token))

    def start(self, timeout=60, **overrides):
        """Start with the base environment plus overrides; wait until the API answers
        (timeout s: a hub checks every running server before it answers)."""
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("COURSE_")}
        env = {**inherited, **self.env, "COURSE_HUB_URL": self.url.rstrip("/"), **overrides}
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", str(self.wrapper)],
                                     cwd=self.folder, env=env, stdout=log,
                                     stderr=subprocess.STDOUT, preexec_fn=default_sigint)
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(self.url + "hub/api/", timeout=5)
                return
            except OSError as err:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise AssertionError(
                        f"the hub did not start:\n{self.log()[-4000:]}") from err
                time.sleep(0.2)

    def stop(self):
        """SIGTERM, as systemd would; the hub's own children (the proxy and the idle
        culler, root's) must end with it. The students' servers run on."""
        if self.proc is None:
            return
        try:
            own = [p for p in psutil.Process(self.proc.pid).children() if p.uids().real == 0]
        except psutil.Error:  # the hub already ended (a failed start)
            own = []
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        _, left = psutil.wait_procs(own, timeout=5)
        names = [" ".join(p.cmdline()[:3]) for p in left]
        for proc in left:
            proc.kill()
        assert not left, f"the hub left {names} running"

    def crash(self):
        """SIGKILL, as the OOM killer would: none of the hub's cleanup runs. Its
        own children as they were (proxy, services), for the caller to follow."""
        try:
            own = [p for p in psutil.Process(self.proc.pid).children() if p.uids().real == 0]
        except psutil.Error:
            own = []
        self.proc.kill()
        self.proc.wait()
        self.proc = None
        return own

    def log(self):
        return self.log_path.read_text() if self.log_path.exists() else ""


def cullers(state_dir):
    """The idle cullers running for the hub whose state is state_dir (their cwd)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "cwd"]):
        if (any("jupyterhub_idle_culler" in a for a in proc.info["cmdline"] or ())
                and proc.info["cwd"] == str(state_dir)):
            found.append(proc)
    return found


def token_in_environment(proc):
    """The hub API token a service process was given (root reads /proc/PID/environ)."""
    return proc.environ().get("JUPYTERHUB_API_TOKEN")


def default_sigint():
    """In the hub's process, before it starts: SIGINT back to its default. A test
    run started in the background (`cmd &`) inherits SIGINT ignored, and so do
    the hub's services; JupyterHub stops them with SIGINT, then SIGTERM after 30 s
    (LocalProcessSpawner.interrupt_timeout), so a stop took 30 s and stop() above
    killed the hub first, its proxy and idle culler left running."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class LoginRefused(AssertionError):
    pass


def login_form(url, name, password):
    """Log in through /hub/login as a browser does: a requests session holding the
    hub's login cookie. LoginRefused (with the page's message) if the hub says no."""
    browser = requests.Session()
    page = browser.get(url + "hub/login", timeout=60)
    xsrf = re.search(r'name="_xsrf" value="([^"]+)"', page.text).group(1)
    reply = browser.post(url + "hub/login?next=", timeout=60, allow_redirects=False,
                         data={"username": name, "password": password, "_xsrf": xsrf})
    if reply.status_code != 302 or "jupyterhub-hub-login" not in browser.cookies:
        message = re.search(r'login_error[^>]*>\s*([^<]+)', reply.text)
        raise LoginRefused(f"HTTP {reply.status_code}: "
                           f"{message.group(1).strip() if message else reply.text[:200]}")
    return browser


def token_of(browser, url, name):
    """A new API token of the logged-in user, asked for with the login cookie."""
    reply = browser.post(url + f"hub/api/users/{name}/tokens", json={"note": "test"},
                         headers={"X-XSRFToken": browser.cookies["_xsrf"]}, timeout=60)
    assert reply.status_code == 201, f"token for {name}: HTTP {reply.status_code} {reply.text}"
    return reply.json()["token"]


class Hub:
    """The hub's REST API and each user's server, through the proxy."""

    def __init__(self, url):
        self.url, self.http = url, AsyncHTTPClient()

    async def api(self, method, path, token, body=None, ok=(200, 201, 202, 204)):
        """(status, JSON reply); AssertionError on a status not in ok."""
        req = HTTPRequest(self.url + path, method=method, request_timeout=120,
                          headers={"Authorization": f"token {token}"},
                          body=(None if body is None and method == "GET"
                                else json.dumps(body or {})),
                          allow_nonstandard_methods=True, follow_redirects=False)
        try:
            resp = await self.http.fetch(req)
        except HTTPClientError as e:
            if e.code in ok:
                return e.code, None
            detail = e.response.body.decode() if e.response else ""
            raise AssertionError(f"{method} {path}: HTTP {e.code} {detail}") from None
        text = resp.body.decode()
        return resp.code, json.loads(text) if text.strip() else None

    async def start_server(self, name, token):
        await self.api("POST", f"hub/api/users/{name}/server", token)
        for _ in range(600):
            _, model = await self.api("GET", f"hub/api/users/{name}", token)
            if model["servers"].get("", {}).get("ready"):
                return
            await asyncio.sleep(0.2)
        raise AssertionError(f"{name}'s server did not become ready")

    async def kernel(self, name, token):
        _, specs = await self.api("GET", f"user/{name}/api/kernelspecs", token)
        assert specs["kernelspecs"]["python3"]["spec"]["display_name"] == "Python 3 (course)"
        _, k = await self.api("POST", f"user/{name}/api/kernels", token, body={"name": "python3"})
        ws_url = self.url.replace("http", "ws", 1) + f"user/{name}/api/kernels/{k['id']}/channels"
        ws = await websocket_connect(HTTPRequest(ws_url,
                                                 headers={"Authorization": f"token {token}"}))
        return Kernel(ws, k["id"])


class Kernel:
    """Executes code in a kernel over its websocket (Jupyter messaging protocol)."""

    def __init__(self, ws, kernel_id):
        self.ws, self.id, self.session = ws, kernel_id, uuid.uuid4().hex

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


def last_json(text):
    return json.loads(text.strip().splitlines()[-1])
