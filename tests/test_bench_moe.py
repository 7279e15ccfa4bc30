# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_bench_moe.py
"""python -m labsupport.bench moe runs end to end (tiny sizes, no speed asserted)."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NUMBER = r"\d+\.\d+"


def _bench(*args, timeout=300):
    cmd = [sys.executable, "-m", "labsupport.bench", "moe", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_it_ends_with_its_machine_readable_line_and_counts_bytes():
    out = _bench("--world-sizes", "2", "--tokens", "256", "--hidden", "32", "--repeats", "1",
                 "--train-steps", "8")
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    assert re.fullmatch(rf"moe_a2a_bytes_measured_over_formula=({NUMBER}) "
                        rf"moe_step_ratio_vs_functional={NUMBER} "
                        rf"moe_aux_loss_imbalance_ratio={NUMBER}", last), out.stdout
    ratio = float(re.search(r"formula=(\d+\.\d+)", last).group(1))
    assert 1.0 <= ratio < 1.05  # the wire count: the formula plus gloo's headers


def test_bad_world_sizes_are_refused():
    out = _bench("--world-sizes", "1", timeout=60)
    assert out.returncode != 0 and "at least 2 ranks" in out.stderr
    out = _bench("--world-sizes", "4", "--experts", "6", timeout=60)
    assert out.returncode != 0 and "divisible by every world size" in out.stderr
