"""The launcher inside real Jupyter kernels: interrupts, kernel death, failing cells, %%ranks.

Run: .venv/bin/python -m pytest tests/test_launcher_kernel.py
"""
import os
import signal
import time

import nbformat
import psutil
import pytest
from jupyter_client.manager import start_new_kernel
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


class Kernel:
    """A Jupyter kernel driven as a notebook front end would drive it."""

    def __init__(self):
        self.km, self.kc = start_new_kernel(kernel_name="python3")

    def execute(self, code, timeout=120):
        """Run code; return (status, stdout text, stderr text, error name, reply time)."""
        t0 = time.monotonic()
        msg_id = self.kc.execute(code)
        stdout, stderr, ename = [], [], None
        while True:
            msg = self.kc.get_iopub_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                (stdout if content["name"] == "stdout" else stderr).append(content["text"])
            elif kind == "error":
                ename = content["ename"]
            elif kind == "status" and content["execution_state"] == "idle":
                break
        reply = self.kc.get_shell_msg(timeout=timeout)
        return (reply["content"]["status"], "".join(stdout), "".join(stderr), ename,
                time.monotonic() - t0)

    def value(self, expr):
        status, out, err, _, _ = self.execute(f"print(repr({expr}))")
        assert status == "ok", err
        return eval(out.strip())

    def group_pids(self):
        """The process server and every rank: all descendants of the kernel."""
        return [p.pid for p in psutil.Process(self.km.provisioner.pid).children(recursive=True)]

    def close(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


@pytest.fixture
def kernel():
    k = Kernel()
    status, _, err, _, _ = k.execute(
        "import time, torch, torch.distributed as dist\nimport labsupport as ls\n"
        "cluster = ls.start(world_size=2)")
    assert status == "ok", err
    yield k
    k.close()


def wait_gone(pids, limit=5.0):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        alive = [p for p in pids
                 if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        if not alive:
            return []
        time.sleep(0.05)
    return alive


def test_interrupt_stops_the_ranks_within_5s_and_the_kernel_stays_usable(kernel):
    old = kernel.value("cluster.pids")
    kernel.kc.execute("cluster.run(lambda: dist.barrier() if dist.get_rank() "
                      "else time.sleep(600))")
    time.sleep(1.5)  # let the run start
    t0 = time.monotonic()
    kernel.km.interrupt_kernel()
    status = None
    while status is None:
        msg = kernel.kc.get_shell_msg(timeout=10)
        if msg["msg_type"] == "execute_reply":
            status = msg["content"]
    assert time.monotonic() - t0 < 5.0
    assert status["status"] == "error" and status["ename"] == "KeyboardInterrupt"
    assert wait_gone(old) == []
    assert kernel.value("cluster.run(lambda: dist.get_rank())") == [0, 1]


@pytest.mark.parametrize("how", ["shutdown", "restart", "sigkill"])
def test_no_worker_outlives_its_kernel(how):
    k = Kernel()
    try:
        status, _, err, _, _ = k.execute("import labsupport as ls\n"
                                         "cluster = ls.start(world_size=2)\n"
                                         "cluster.run(lambda: 0)")
        assert status == "ok", err
        pids = k.group_pids()
        assert len(pids) == 3, "the process server and two ranks"
        if how == "shutdown":
            k.km.shutdown_kernel(now=False)
        elif how == "restart":
            k.km.restart_kernel(now=True)
        else:
            os.kill(k.km.provisioner.pid, signal.SIGKILL)
        assert wait_gone(pids) == [], f"still alive 5 s after kernel {how}"
    finally:
        if how != "shutdown":
            k.close()


def test_a_busy_rank_dies_with_a_killed_kernel_too():
    k = Kernel()
    try:
        k.execute("import labsupport as ls, time\ncluster = ls.start(world_size=2)")
        pids = k.group_pids()
        k.kc.execute("cluster.run(time.sleep, 600)")
        time.sleep(1.0)
        os.kill(k.km.provisioner.pid, signal.SIGKILL)
        assert wait_gone(pids) == []
    finally:
        k.close()


def test_a_group_started_from_a_thread_outlives_the_thread_but_not_the_kernel():
    # The parent-death signal follows the thread that started the process
    # server: a group started from a short-lived thread must not die with it.
    k = Kernel()
    try:
        status, _, err, _, _ = k.execute(
            "import threading, time\nimport labsupport as ls\n"
            "t = threading.Thread(target=ls.start, kwargs=dict(world_size=2))\n"
            "t.start(); t.join(); time.sleep(1.5)")
        assert status == "ok", err
        pids = k.group_pids()
        assert len(pids) == 3, "the process server and two ranks"
        assert k.value("ls.current().run(lambda: 7)") == [7, 7]
        os.kill(k.km.provisioner.pid, signal.SIGKILL)
        assert wait_gone(pids) == [], "still alive 5 s after the kernel was killed"
    finally:
        k.close()


def test_a_failing_run_fails_the_cell_for_nbclient_papermill_and_nbval(tmp_path):
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "language": "python",
                                                           "display_name": "Python 3"}})
    nb.cells = [nbformat.v4.new_code_cell(c) for c in [
        "import torch.distributed as dist\nimport labsupport as ls\n"
        "cluster = ls.start(world_size=2)",
        "def broken():\n    if dist.get_rank() == 1:\n        raise ValueError('bad rank')\n"
        "    dist.barrier()\ncluster.run(broken)",
        "print('never reached')",
    ]]
    with pytest.raises(CellExecutionError) as info:
        NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    assert "rank 1 raised ValueError: bad rank" in str(info.value)
    assert "Cell In[2], line 3" in str(info.value)
    error = [o for o in nb.cells[1].outputs if o.output_type == "error"][0]
    assert error.ename == "RankError"
    shown = "\n".join(error.traceback)
    assert "cluster.run(broken)" in shown and "labsupport" + os.sep not in shown, \
        "the notebook's traceback shows the cell, not the launcher's internals"
    assert nb.cells[2].outputs == []


def test_ranks_magic_keeps_a_namespace_per_rank_and_returns_the_last_expression(kernel):
    status, out, err, _, _ = kernel.execute(
        "%%ranks\nx = torch.tensor([rank + 1.0])\ndist.all_reduce(x)\n")
    assert status == "ok", err
    status, out, err, _, _ = kernel.execute("%%ranks\nprint(rank, world_size, device, x.item())\n"
                                            "x.item() * 2")
    assert status == "ok", err
    assert out == "[rank0] 0 2 cpu 3.0\n[rank1] 1 2 cpu 3.0\n"
    assert kernel.value("_") == [6.0, 6.0]


def test_ranks_magic_errors_point_at_the_cell_line_and_restarts_are_announced(kernel):
    status, _, _, ename, _ = kernel.execute("%%ranks\nkeep = 1")
    status, _, err, ename, _ = kernel.execute("%%ranks\na = 1\nif rank == 1:\n    a.missing\n"
                                              "dist.barrier()")
    assert status == "error" and ename == "RankError"
    status, out, err, _, _ = kernel.execute("import sys\nprint(str(sys.last_value))")
    assert out.startswith("rank 1 raised AttributeError: 'int' object has no attribute 'missing'")
    assert "Cell In[3], line 4, in <module>\n    a.missing" in out
    assert "rank 0 stopped here ---\n  Cell In[3], line 5, in <module>\n    dist.barrier()" in out
    status, out, err, ename, _ = kernel.execute("%%ranks\nprint(keep)")
    assert "restarted since the last %%ranks cell" in err and ename == "RankError"


def test_ranks_magic_timeout_and_stream_options(kernel):
    t0 = time.monotonic()
    status, _, err, ename, _ = kernel.execute("%%ranks -t 1\nimport time\ntime.sleep(60)")
    assert status == "error" and ename == "RankTimeout" and time.monotonic() - t0 < 15
    status, out, err, _, _ = kernel.execute("%%ranks --stream\nprint('line', rank)")
    assert status == "ok", err
    assert sorted(out.splitlines()) == ["[rank0] line 0", "[rank1] line 1"]


def test_ranks_magic_without_a_group_says_how_to_start_one():
    k = Kernel()
    try:
        k.execute("import labsupport as ls")
        status, out, err, ename, _ = k.execute("%%ranks\nprint(rank)")
        # IPython reports a UsageError on stderr, without a traceback
        assert status == "error" and "UsageError: no group of ranks is running" in err
        status, out, err, ename, _ = k.execute("%%ranks -n 2\nprint(rank)")
        assert status == "ok" and out.endswith("\n[rank0] 0\n[rank1] 1\n")
    finally:
        k.close()
