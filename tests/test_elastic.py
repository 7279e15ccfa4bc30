"""Chapter 10's two-node job is private: torch's TCPStore binds every interface,
so labsupport.checkpoints.elastic runs the agents in a network namespace of their own."""
import socket
import subprocess
import sys

import pytest

from labsupport.checkpoints import elastic

# A TCPStore server given 127.0.0.1, as the c10d rendezvous makes it; prints its
# port, then serves until its stdin closes.
STORE = """import sys
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore('127.0.0.1', int(sys.argv[1]), is_master=True, multi_tenant=True,
                      timeout=timedelta(seconds=10))
store.set('who', 'inside')
print(store.port, flush=True)
sys.stdin.read()
"""


def _namespace_or_skip():
    try:
        with elastic.private_network():
            return
    except OSError as err:
        pytest.skip(f"no private network namespace on this machine: {err}")


def _serve_store(prefix, port):
    proc = subprocess.Popen(prefix + [sys.executable, "-c", STORE, str(port)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert int(proc.stdout.readline()) == port
    return proc


def _reachable(port) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_store_on_the_host_listens_beyond_loopback_and_one_in_the_namespace_does_not():
    _namespace_or_skip()
    port = elastic.free_port()
    host = _serve_store([], port)
    try:   # what the chapter says: given 127.0.0.1, it still binds every interface
        listening = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], text=True,
                                   capture_output=True).stdout
        assert f"*:{port}" in listening or f"0.0.0.0:{port}" in listening, listening
    finally:
        host.stdin.close(), host.wait()
    with elastic.private_network() as enter:
        inside = _serve_store(enter, port)
        try:
            assert not _reachable(port), "the namespace's store is reachable from the host"
        finally:
            inside.stdin.close(), inside.wait()


def test_requiring_a_private_network_where_none_can_be_made_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(elastic.shutil, "which", lambda name: None)
    with pytest.raises(OSError, match="unshare and nsenter"):
        elastic.run_two_nodes(["x.py"], str(tmp_path), private_network=True)
    with pytest.warns(UserWarning, match="listens on every interface"):
        with pytest.raises(RuntimeError):   # x.py does not exist: the agents fail
            elastic.run_two_nodes(["x.py"], str(tmp_path), timeout=60)
