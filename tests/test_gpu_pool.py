"""The hub's GPU pool (deploy/gpu_pool.py): disjoint sets per server, given back on
stop, a clear refusal when empty, safe under concurrent spawns; and labsupport
places a user's ranks on exactly the GPUs that the pool left visible.

No GPU is needed: the GPU count is faked the way tests/test_launcher_gpu.py does.

Run: .venv/bin/python -m pytest tests/test_gpu_pool.py
"""
import copy
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "deploy"))
import gpu_pool  # noqa: E402
from gpu_pool import GPUPool, PoolExhausted  # noqa: E402

from labsupport.launch import placement  # noqa: E402  (read only: where ranks go)


class FakeSpawner:
    """What the hooks use of a JupyterHub Spawner."""

    def __init__(self, user, name=""):
        self.user, self.name = SimpleNamespace(name=user), name
        self.environment = {"KEEP": "me"}
        self.log = logging.getLogger("fake-spawner")


def test_each_server_gets_its_own_gpus_and_gives_them_back():
    pool = GPUPool(["0", "1", "2", "3"], per_user=2)
    assert pool.acquire("alice") == ("0", "1")
    assert pool.acquire("bob") == ("2", "3")
    assert pool.acquire("alice") == ("0", "1"), "asking again returns the same set"
    assert pool.free() == []
    assert pool.release("alice") == ("0", "1")
    assert pool.release("alice") == (), "a second release is harmless"
    assert pool.acquire("carol") == ("0", "1")
    assert pool.holders() == {"bob": ("2", "3"), "carol": ("0", "1")}


def test_an_empty_pool_refuses_saying_who_holds_what_or_starts_on_the_cpu():
    pool = GPUPool(["0", "1", "2"], per_user=2)
    pool.acquire("alice")
    with pytest.raises(PoolExhausted) as refused:
        pool.acquire("bob")
    message = str(refused.value)
    assert "No GPU free for bob" in message and "1 of the 3 in the pool are free" in message
    assert "alice (0,1)" in message and "COURSE_GPU_WHEN_EMPTY=cpu" in message
    assert pool.holders() == {"alice": ("0", "1")}, "a refusal takes nothing"
    cpu = GPUPool(["0"], per_user=1, when_empty="cpu")
    assert cpu.acquire("alice") == ("0",)
    assert cpu.acquire("bob") == (), "no GPU visible rather than a shared one"


def test_a_restarted_hub_claims_what_running_servers_hold_and_lends_it_to_no_one_else():
    pool = GPUPool(["GPU-a", "GPU-b", "GPU-c"], per_user=1)
    assert pool.claim("alice", ["GPU-b"]) == (), "no one else held it"
    assert pool.acquire("bob") == ("GPU-a",) and pool.acquire("carol") == ("GPU-c",)
    with pytest.raises(PoolExhausted, match=r"held by: alice \(GPU-b\)"):
        pool.acquire("dan")
    assert pool.claim("erin", ["GPU-c"]) == ("GPU-c",), "reported: two servers hold it"
    assert pool.release("alice") == ("GPU-b",) and pool.acquire("dan") == ("GPU-b",)
    assert copy.deepcopy(pool) is pool, "every spawner's config shares the one pool"


def test_bad_pool_settings_say_what_to_do():
    with pytest.raises(ValueError, match="lists a GPU twice"):
        GPUPool(["0", "0"])
    with pytest.raises(ValueError, match="per_user must be a whole number"):
        GPUPool(["0"], per_user=-1)
    with pytest.raises(ValueError, match="when_empty must be one of"):
        GPUPool(["0"], when_empty="share")
    with pytest.raises(ValueError, match="COURSE_GPUS_PER_USER must be a whole number"):
        gpu_pool.from_environment({"COURSE_GPU_POOL": "0", "COURSE_GPUS_PER_USER": "two"})


def test_the_pool_is_configured_from_the_environment(monkeypatch):
    pool = gpu_pool.from_environment({"COURSE_GPU_POOL": "4, 5,6", "COURSE_GPUS_PER_USER": "2",
                                      "COURSE_GPU_WHEN_EMPTY": "cpu"})
    assert (pool.gpus, pool.per_user, pool.when_empty) == (("4", "5", "6"), 2, "cpu")
    assert gpu_pool.from_environment({"COURSE_GPU_POOL": "none"}).gpus == ()
    monkeypatch.setattr(gpu_pool, "detect_gpus", lambda: ["0", "1"])
    assert gpu_pool.from_environment({}).gpus == ("0", "1"), "default: every GPU of the node"


def test_concurrent_spawns_never_share_a_gpu():
    pool = GPUPool([str(i) for i in range(8)], per_user=1)
    got, refused, start = {}, [], threading.Barrier(16)

    def spawn(user):
        start.wait()
        try:
            got[user] = pool.acquire(user)
        except PoolExhausted:
            refused.append(user)

    threads = [threading.Thread(target=spawn, args=(f"u{i}",)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    handed_out = [g for ids in got.values() for g in ids]
    assert sorted(handed_out, key=int) == [str(i) for i in range(8)], "each GPU exactly once"
    assert len(refused) == 8


def test_the_hooks_set_cuda_visible_devices_per_server_and_release_on_stop():
    pre, post = GPUPool(["0", "1", "2", "3"], per_user=2).hooks()
    alice, bob, alice_named = FakeSpawner("alice"), FakeSpawner("bob"), FakeSpawner("alice", "big")
    for spawner in (alice, bob):
        pre(spawner)
    assert alice.environment == {"KEEP": "me", "CUDA_VISIBLE_DEVICES": "0,1",
                                 "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}  # indices as nvidia-smi's
    assert alice.gpu_ids == ("0", "1"), "kept in the spawner's state across a hub restart"
    assert bob.environment["CUDA_VISIBLE_DEVICES"] == "2,3"
    with pytest.raises(Exception) as refused:
        pre(alice_named)  # a named server is another owner: the pool is empty
    assert refused.type.__name__ == "SpawnException" and refused.value.status_code == 503
    assert "No GPU free for alice/big" in refused.value.log_message
    post(alice)
    pre(alice_named)
    assert alice_named.environment["CUDA_VISIBLE_DEVICES"] == "0,1"


def fake_cuda(monkeypatch):
    """torch sees as many GPUs as CUDA_VISIBLE_DEVICES lists, as the CUDA runtime does."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count",
                        lambda: len([g for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",")
                                     if g]))


def test_labsupport_puts_a_users_ranks_on_the_gpus_the_pool_left_visible(monkeypatch):
    # A node with 4 GPUs, 2 per user: bob's server gets GPUs 2 and 3.
    pre, _ = GPUPool(["0", "1", "2", "3"], per_user=2).hooks()
    alice, bob = FakeSpawner("alice"), FakeSpawner("bob")
    pre(alice), pre(bob)
    visible = bob.environment["CUDA_VISIBLE_DEVICES"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    fake_cuda(monkeypatch)
    monkeypatch.setenv(placement.ENV, "auto")  # the suite's default is gloo
    on_gpus = placement.place(2)
    assert (on_gpus.backend, on_gpus.devices) == (placement.GPU_BACKEND, ("cuda:0", "cuda:1"))
    # cuda:i is the i-th GPU CUDA_VISIBLE_DEVICES lists: bob's own, never alice's.
    physical = [visible.split(",")[int(d.split(":")[1])] for d in on_gpus.devices]
    assert physical == ["2", "3"]
    too_many = placement.place(3)
    assert too_many.backend == "gloo" and too_many.notice.endswith("only 2 GPU(s) visible")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # when_empty="cpu": no GPU at all
    assert placement.place(2).notice == "labsupport: ranks run on gloo (CPU): no CUDA GPU visible"


RANKS_ENV = """
import json, os, labsupport as ls
print(json.dumps(ls.run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES"), world_size=2,
                        backend="gloo")))
"""


def test_the_ranks_inherit_the_servers_cuda_visible_devices():
    pre, _ = GPUPool(["0", "1", "2", "3"], per_user=2).hooks()
    alice = FakeSpawner("alice")
    pre(alice)
    env = {**os.environ, **alice.environment, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", RANKS_ENV], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["0,1", "0,1"]
