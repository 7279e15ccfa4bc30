"""Many users on one machine: no port collisions, nothing listening beyond loopback,
a private control channel, and cleanup that touches only our own processes.

Run: .venv/bin/python -m pytest tests/test_launcher_isolation.py
"""
import json
import os
import stat
import subprocess
import sys
import time

import psutil
import pytest
import torch.distributed as dist

import labsupport as ls
from labsupport.launch import forkserver

# One "kernel": waits for a go signal, starts 2 ranks, all-reduces, reports.
KERNEL = r"""
import json, os, sys, time
import labsupport as ls
go = sys.argv[1]
while not os.path.exists(go):
    time.sleep(0.01)
def allreduce(tag):
    import torch, torch.distributed as dist
    t = torch.tensor([float(dist.get_rank() + tag)])
    dist.all_reduce(t)
    return t.item()
tag = int(sys.argv[2])
with ls.start(world_size=2, backend="gloo") as cluster:
    results = cluster.run(allreduce, tag)
print(json.dumps(results))
"""


@pytest.mark.slow
def test_twenty_groups_started_at_once_never_collide(tmp_path):
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", KERNEL, str(go), str(i)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(20)]
    time.sleep(1.0)  # let every kernel import labsupport and wait
    go.touch()
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, f"group {i} failed:\n{err[-3000:]}"
        assert json.loads(out.strip().splitlines()[-1]) == [2.0 * i + 1] * 2


def test_ranks_listen_on_loopback_only_and_the_control_channel_has_no_port():
    cluster = ls.start(world_size=2)
    cluster.run(dist.barrier)  # gloo's connections are up
    server = psutil.Process(forkserver.get().pid)
    listeners = 0
    for proc in [server] + [psutil.Process(p) for p in cluster.pids]:
        for conn in proc.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                listeners += 1
                assert conn.laddr.ip in ("127.0.0.1", "::1"), f"{proc.pid} listens on {conn.laddr}"
            if conn.raddr:
                assert conn.raddr.ip in ("127.0.0.1", "::1")
    assert listeners >= 2, "gloo's own listening sockets should have been seen and checked"
    assert server.net_connections(kind="inet") == [], "the process server uses no TCP at all"
    mode = stat.S_IMODE(os.stat(forkserver.get().dir).st_mode)
    assert mode == 0o700, f"the group's directory (store, output) must be private, not {oct(mode)}"
    ls.shutdown()


def test_the_process_server_and_ranks_are_out_of_reach_of_the_kernels_group_signals():
    cluster = ls.start(world_size=2)
    server_pid = forkserver.get().pid
    for pid in [server_pid] + cluster.pids:
        assert os.getpgid(pid) != os.getpgid(0), (
            "Jupyter's SIGINT to the kernel's group must not hit it")
        assert os.getsid(pid) == server_pid
    ls.shutdown()


def test_cleanup_touches_only_this_groups_processes(tmp_path):
    # A neighbour's group (another kernel) and an unrelated process must survive
    # everything we do to ours: failures, timeouts, shutdown, and our server's exit.
    go = tmp_path / "go"
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    neighbour = subprocess.Popen(
        [sys.executable, "-c", "import labsupport as ls, time, sys, os\n"
         "c = ls.start(world_size=2, backend='gloo')\n"
         "print(' '.join(map(str, c.pids)), flush=True)\n"
         f"while not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
         "print(c.run(lambda: 5), flush=True)"], stdout=subprocess.PIPE, text=True)
    try:
        neighbour_pids = [int(p) for p in neighbour.stdout.readline().split()]
        cluster = ls.start(world_size=2, timeout=1)
        with pytest.raises(ls.RankTimeout):
            cluster.run(lambda: time.sleep(30))
        ls.shutdown()
        forkserver.stop()
        assert bystander.poll() is None
        assert all(psutil.pid_exists(p) for p in neighbour_pids)
        go.touch()
        assert neighbour.stdout.readline().strip() == "[5, 5]"
    finally:
        bystander.kill()
        neighbour.kill()
        neighbour.wait()
        bystander.wait()
