# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_bench_checkpoint.py
"""`python -m labsupport.bench checkpoint` end to end at a tiny size; the two-node restart too.

No speed is asserted (machines are noisy). What is asserted: each rank's
shard file is 12Ψ/N bytes within the padding (under 1% at this size); the
checkpoint of 4 ranks loads at 2 bitwise; a resumed run gives the
uninterrupted losses; and two torchrun agents on loopback, one worker
SIGKILLed once, restart, resume from the last complete checkpoint and
finish with the uninterrupted run's losses (this is the chapter's
two-node restart, tested end to end).
"""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bench(*args, timeout=600):
    cmd = [sys.executable, "-m", "labsupport.bench", "checkpoint", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_the_benchmark_and_the_two_node_restart_end_to_end():
    out = _bench("--hidden", "15", "--heads", "3", "--layers", "2", "--seq-len", "8",
                 "--steps", "6", "--saves", "2")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"ckpt_bytes_measured_over_formula=(\d+\.\d+) "
                         r"ckpt_async_stall_over_sync=(\d+\.\d+) reshard_4_to_2_bitwise=1 "
                         r"resume_losses_equal=1 elastic_two_node_resume_equal=1", last)
    assert match, out.stdout[-2000:]
    assert 1.0 <= float(match[1]) < 1.01


def test_steps_the_failure_needs_are_asked_for():
    out = _bench("--steps", "3", timeout=60)
    assert out.returncode != 0 and "--steps must be even and at least 4" in out.stderr
