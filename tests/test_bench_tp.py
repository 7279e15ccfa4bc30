# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_bench_tp.py
"""`python -m labsupport.bench tp` runs end to end at a tiny size and ends with its line.

No speed is asserted (machines are noisy): only that the script finishes and
prints the machine-readable line the closing note of chapter 4 refers to.
"""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NUMBER = r"\d+\.\d+"


def _bench(*args, timeout=300):
    cmd = [sys.executable, "-m", "labsupport.bench", "tp", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_the_tp_benchmark_ends_with_its_machine_readable_line():
    out = _bench("--world-sizes", "2", "--rounds", "1", "--steps", "1", "--seq", "16",
                 "--hidden", "32", "--heads", "4", "--layers", "1", "--vocab", "64")
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    assert re.fullmatch(rf"tp_step_ratio_vs_dtensor={NUMBER} "
                        rf"tp_sp_step_ratio_vs_dtensor={NUMBER}", last), out.stdout[-2000:]


def test_a_world_size_of_one_is_refused():
    out = _bench("--world-sizes", "1", timeout=60)
    assert out.returncode != 0 and "at least 2" in out.stderr
