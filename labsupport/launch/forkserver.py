"""Kernel side of the process server (its own side: ``forkserver_main``): start it, fork ranks.

One server per kernel, started on first use and kept warm, so that starting a
new group (after an error, a timeout or a change of world size) costs a fork
and a process-group init, not a fresh ``import torch`` per rank.

The control channel is an anonymous socket pair inherited by the server:
nothing in the file system, no port, so no other user can talk to it. The
server lives in its own session, so Jupyter's interrupt (SIGINT to the
kernel's process group) never reaches it or the ranks blindly.
"""
import atexit
import os
import pickle
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from labsupport.launch.limits import (
    EXIT_WAIT,
    SERVER_REPLY_TIMEOUT,
    STACK_DUMP_WAIT,
    START_TIMEOUT,
    TAIL_CHARS,
)

# The folder that holds the labsupport package (this file is labsupport/launch/forkserver.py)
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ProcessServerError(RuntimeError):
    pass


class ProcessServer:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="labsupport-")  # mode 0700: ours alone
        self.lock = threading.Lock()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.ctrl = ours
        self.log_path = os.path.join(self.dir, "server.log")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_PARENT, env.get("PYTHONPATH")]))
        # torch.cuda.is_available() through NVML, without initialising CUDA: a
        # check anywhere in torch's imports then cannot poison the forks
        # (torch/cuda/__init__.py, is_available's note).
        env.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        # The parent-death signal follows the thread that started the server:
        # only the main thread lives as long as the kernel.
        main_thread = str(int(threading.current_thread() is threading.main_thread()))
        with open(self.log_path, "wb") as log, theirs:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "labsupport.launch.forkserver_main", str(theirs.fileno()),
                 str(os.getpid()), main_thread],
                pass_fds=[theirs.fileno()], start_new_session=True, env=env,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self.pid = self._receive("ready", START_TIMEOUT)[1]

    def request(self, *msg, fds=(), timeout=SERVER_REPLY_TIMEOUT):
        """Send one request and return the server's reply."""
        with self.lock:
            try:
                socket.send_fds(self.ctrl, [pickle.dumps(msg)], list(fds))
            except OSError as exc:
                raise self._failure(f"cannot reach it ({exc})") from None
            return self._receive(None, timeout)

    def exit_status(self, pid: int, wait_s: float = EXIT_WAIT):
        """The wait status of a rank that closed its connection (it may still be exiting)."""
        deadline = time.monotonic() + wait_s
        while True:
            status = self.request("status", [pid])[1].get(pid)
            if status is not None or time.monotonic() > deadline:
                return status
            time.sleep(0.02)

    def dump_stacks(self, stack_paths: dict, wait_s: float = STACK_DUMP_WAIT) -> dict:
        """{pid: faulthandler's dump of every thread} for ranks given as {pid: stack file}."""
        self.request("signal", list(stack_paths), signal.SIGUSR1)
        # faulthandler writes from the signal handler; a size that stopped growing is complete
        deadline, sizes = time.monotonic() + wait_s, {}
        while time.monotonic() < deadline:
            time.sleep(0.03)
            new = {pid: os.path.getsize(path) for pid, path in stack_paths.items()}
            if all(new.values()) and new == sizes:
                break
            sizes = new
        return {pid: _read(path) for pid, path in stack_paths.items()}

    def _receive(self, kind, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if select.select([self.ctrl], [], [], 0.2)[0]:
                data = self.ctrl.recv(1 << 20)
                if not data:
                    break
                reply = pickle.loads(data)
                if kind is None or reply[0] == kind:
                    return reply
            elif self.proc.poll() is not None:
                break
        raise self._failure("it stopped answering" if self.proc.poll() is None
                            else f"it exited with code {self.proc.returncode}")

    def _failure(self, what):
        self.close()
        return ProcessServerError(
            f"labsupport's process server failed: {what}. Its log:\n{self.log_tail()}\n"
            "The next ls.start() starts a new one.")

    def log_tail(self, limit=TAIL_CHARS) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-limit:].decode("utf-8", "backslashreplace")
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self):
        """Stop the server; it kills every rank it forked before exiting."""
        if self.proc.poll() is None:
            try:
                socket.send_fds(self.ctrl, [pickle.dumps(("exit",))], [])
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.ctrl.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _read(path) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


_server: ProcessServer | None = None


def get() -> ProcessServer:
    """This kernel's process server, started if needed."""
    global _server
    if _server is None or not _server.alive():
        if _server is not None:
            _server.close()
        _server = ProcessServer()
    return _server


def current() -> ProcessServer | None:
    """This kernel's process server if it is running (never starts one)."""
    return _server if _server is not None and _server.alive() else None


@atexit.register
def stop():
    global _server
    if _server is not None:
        _server.close()
        _server = None
