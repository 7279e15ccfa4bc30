# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_bench_zero.py
"""`python -m labsupport.bench zero` runs end to end at a tiny size and ends with its line.

No speed is asserted (machines are noisy); the memory ratio is: the
measured bytes exceed the ZeRO paper's formula only by padding and AdamW's
step counters, well under 1%.
"""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bench(*args, timeout=300):
    cmd = [sys.executable, "-m", "labsupport.bench", "zero", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_the_zero_benchmark_ends_with_its_machine_readable_line():
    out = _bench("--world-sizes", "2", "--rounds", "1", "--steps", "1", "--hidden", "16",
                 "--layers", "1", "--seq-len", "8", "--vocab", "31")
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"zero_mem_measured_over_formula_max=(\d+\.\d+) "
                         r"zero3_step_ratio_vs_fsdp2=(\d+\.\d+)", last)
    assert match, out.stdout[-2000:]
    assert 1.0 <= float(match[1]) < 1.01


def test_a_batch_the_world_sizes_do_not_divide_is_refused():
    out = _bench("--world-sizes", "4", "--batch", "6", timeout=60)
    assert out.returncode != 0 and "divisible by every world size" in out.stderr
