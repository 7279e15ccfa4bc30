# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_bench_ring_attention.py
"""python -m labsupport.bench ring_attention runs end to end (tiny sizes, no speed asserted)."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NUMBER = r"\d+\.\d+"


def _bench(*args, timeout=300):
    cmd = [sys.executable, "-m", "labsupport.bench", "ring_attention", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_it_ends_with_its_machine_readable_line_and_counts_blocks():
    out = _bench("--world-sizes", "2", "--seq-len", "64", "--heads", "2", "--head-dim", "8",
                 "--repeats", "1")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert re.fullmatch(rf"ring_attn_overlap_speedup={NUMBER} causal_imbalance_contiguous="
                        rf"{NUMBER} ring_attn_vs_sdpa_ms_ratio={NUMBER}", lines[-1]), out.stdout
    assert "[1, 2]" in out.stdout  # causal, contiguous: rank r computes r + 1 blocks


def test_one_rank_is_refused():
    out = _bench("--world-sizes", "1", timeout=60)
    assert out.returncode != 0 and "at least 2 ranks" in out.stderr
