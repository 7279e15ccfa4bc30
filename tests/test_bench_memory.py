# Run: .venv/bin/python -m pytest tests/test_bench_memory.py
"""python -m labsupport.bench memory runs end to end at a tiny size and ends with its line.

No timing is asserted; the byte ratios are, since they are counts: the states
within 0.1% of 16 bytes per parameter (Adam's step counters are the rest),
the activations within 2% of the adapted formula, and full checkpointing
holding less than a third of the bytes.
"""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_memory_benchmark_ends_with_its_machine_readable_line():
    cmd = [sys.executable, "-m", "labsupport.bench", "memory", "--seqs", "16", "--batches", "2",
           "--hidden", "32", "--vocab", "64", "--steps", "1"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"memory_states_measured_over_formula=(\d+\.\d+) "
                     r"memory_activations_measured_over_formula=(\d+\.\d+) "
                     r"checkpoint_saved_bytes_ratio=(\d+\.\d+)", last)
    assert m, out.stdout[-2000:]
    states, activations, ratio = map(float, m.groups())
    assert 1 <= states < 1.001 and 1 <= activations < 1.02 and 0 < ratio < 1 / 3
