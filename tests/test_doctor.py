"""`python -m labsupport doctor`: the real run on this (CPU) machine, and each
failure report with its fix, the conditions faked by passing the measurements
in (no machine is broken for it).

Run: .venv/bin/python -m pytest tests/test_doctor.py
"""
import io
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from labsupport import doctor

ROOT = Path(__file__).resolve().parent.parent
GIB = 1024 ** 3
CPU = {"torch": "2.13.0+cpu", "cuda_build": None, "names": [], "nccl": None,
       "visible_env": None}
H100S = {"torch": "2.11.0+cu130", "cuda_build": "13.0", "names": ["NVIDIA H100"] * 2,
         "nccl": "2.28.9", "visible_env": "2,3"}


class FakeProbe:
    """Stands for start_and_allreduce: records the calls, answers right."""

    def __init__(self, start_s=1.0, results=None):
        self.calls, self.start_s, self.results = [], start_s, results

    def __call__(self, world_size, backend, timeout):
        self.calls.append((world_size, backend))
        results = self.results or [float(sum(range(1, world_size + 1)))] * world_size
        return {"backend": backend, "start_s": self.start_s, "allreduce_s": 0.01,
                "results": results}


def chapters_fine(world_size, timeout):
    """Stands for doctor_kernel.kernel_probe: what every rank got, right."""
    return [(world_size * (world_size + 1) / 2, (r - 1) % world_size) for r in range(world_size)]


def run(ranks=2, facts=CPU, shm=8 * GIB, ncores=8, probe=None, deadline=5.0,
        kernel=chapters_fine):
    probe = probe or FakeProbe()
    checks = doctor.diagnose(ranks, deadline, facts=lambda: dict(facts), shm=lambda: shm,
                             ncores=lambda: ncores, probe=probe, kernel=kernel)
    out = io.StringIO()
    ok = doctor.report(checks, out)
    return ok, {c.name: c for c in checks}, out.getvalue(), probe


def test_the_real_doctor_on_this_machine_says_ready_and_starts_ranks():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "labsupport", "doctor"], env=env,
                         capture_output=True, text=True, timeout=300)
    print(out.stdout)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "labsupport doctor"
    for name in ("Python", "torch", "GPUs", "NCCL", "/dev/shm", "cores per rank",
                 "ranks + all-reduce (gloo, 2 ranks)", "kernel: CPU, batched p2p (2 ranks)"):
        assert any(line[8:].startswith(name) for line in lines[1:]), name
    assert "gloo: started in" in out.stdout
    assert lines[-1].startswith("verdict: ready")


def test_everything_fine_on_two_gpus_checks_nccl_too():
    ok, checks, text, probe = run(facts=H100S)
    assert ok and text.splitlines()[-1] == "verdict: ready - the labs run here."
    assert probe.calls == [(2, "gloo"), (2, "nccl")]
    assert ("2 visible: NVIDIA H100, NVIDIA H100 (CUDA_VISIBLE_DEVICES='2,3')"
            in checks["GPUs"].value)
    assert checks["NCCL"].value == "2.28.9"


def test_too_little_shared_memory_fails_with_gpus_and_says_how_to_fix_it():
    ok, checks, text, _ = run(facts=H100S, shm=64 * 1024 ** 2)
    shm = checks["/dev/shm"]
    assert not ok and shm.status == "fail"
    assert shm.value == "0.06 GiB: less than the 1 GiB NCCL needs"
    assert "--shm-size=1g" in shm.fix and "medium: Memory" in shm.fix
    assert "verdict: NOT READY (1 to look at):" in text and "- /dev/shm: give the" in text
    ok, checks, _, _ = run(facts=CPU, shm=64 * 1024 ** 2)
    assert ok and checks["/dev/shm"].status == "warn", "gloo on the CPU does not need it"


def test_more_ranks_than_gpus_warns_and_runs_nccl_on_the_gpus_there_are():
    one_gpu = {**H100S, "names": ["NVIDIA H100"], "visible_env": "0"}
    ok, checks, text, probe = run(ranks=2, facts=one_gpu)
    assert ok, "a warning, not a failure: the ranks still run (on gloo)"
    warn = checks["ranks per GPU"]
    assert (warn.status, warn.value) == ("warn", "2 ranks, 1 GPU(s) visible")
    assert "COURSE_GPUS_PER_USER=2" in warn.fix and "world_size<=1" in warn.fix
    assert probe.calls == [(2, "gloo"), (1, "nccl")]
    assert "verdict: ready, with warnings (1 to look at):" in text


def test_a_blocked_start_fails_within_the_deadline_with_what_to_check():
    release = threading.Event()

    def blocked(world_size, backend, timeout):
        release.wait(30)  # a start that never returns
    try:
        ok, checks, text, _ = run(probe=blocked, deadline=0.5)
    finally:
        release.set()
    check = checks["ranks + all-reduce (gloo, 2 ranks)"]
    assert not ok and check.status == "fail"
    assert check.value == "blocked: no answer within 0.5 s"
    assert "/tmp is writable" in check.fix and "ulimit -u" in check.fix


def test_a_failing_or_wrong_all_reduce_and_a_slow_start_are_reported():
    def broken(world_size, backend, timeout):
        raise RuntimeError("Connection reset by peer\nmore lines")
    _, checks, _, _ = run(probe=broken)
    assert checks["ranks + all-reduce (gloo, 2 ranks)"].value == \
        "RuntimeError: Connection reset by peer"
    _, checks, _, _ = run(probe=FakeProbe(results=[3.0, 2.0]))
    assert checks["ranks + all-reduce (gloo, 2 ranks)"].value.startswith("wrong sum [3.0, 2.0]")
    _, checks, _, _ = run(probe=FakeProbe(start_s=45.0))
    assert checks["ranks + all-reduce (gloo, 2 ranks)"].status == "warn"


def test_more_ranks_than_cores_a_cpu_torch_with_gpus_asked_for_and_bad_input():
    _, checks, _, _ = run(ranks=4, ncores=2)
    assert checks["cores per rank"].status == "warn" and "more ranks than cores" in \
        checks["cores per rank"].fix
    _, checks, _, _ = run(facts={**CPU, "visible_env": "0"})
    assert checks["GPUs"].status == "warn" and "CPU build" in checks["GPUs"].fix
    _, checks, _, probe = run(facts={**H100S, "error": "RuntimeError: no driver"})
    assert checks["GPUs"].status == "fail" and probe.calls == [(2, "gloo")]
    with pytest.raises(ValueError, match="ranks must be a positive int"):
        doctor.diagnose(0)


def test_the_chapters_own_operations_from_a_kernel_fail_with_what_to_do():
    # What a plain "nccl" group did to every grader: no backend for CPU tensors.
    def nccl_only(world_size, timeout):
        raise RuntimeError("No backend type associated with device type cpu")
    ok, checks, text, _ = run(facts=H100S, kernel=nccl_only)
    check = checks["kernel: CPU, batched p2p (2 ranks)"]
    assert not ok and check.status == "fail"
    assert check.value == "RuntimeError: No backend type associated with device type cpu"
    assert "a plain 'nccl' process group has no CPU backend" in check.fix
    ok, checks, _, _ = run(kernel=lambda n, t: [(3.0, 1.0), (3.0, 1.0)])  # rank 1 got itself
    assert not ok and checks["kernel: CPU, batched p2p (2 ranks)"].value.startswith(
        "wrong results [(3.0, 1.0), (3.0, 1.0)] (want [(3.0, 1.0), (3.0, 0.0)])")
    release = threading.Event()
    try:  # a batched send and receive that hang
        ok, checks, _, _ = run(kernel=lambda n, t: release.wait(30), deadline=0.5)
    finally:
        release.set()
    assert checks["kernel: CPU, batched p2p (2 ranks)"].value == \
        "TimeoutError: no answer within 0.5 s"
