# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_benchmarks.py
"""Every benchmark script (python -m labsupport.bench <name>) runs end to end.

Small sizes and one repeat: these tests assert no speed (machines are noisy),
only that each script finishes and ends with its machine-readable line, so
the numbers quoted in closing notes and the README come from scripts that work.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NUMBER = r"\d+\.\d+"


def _bench(*args, timeout=300):
    cmd = [sys.executable, "-m", "labsupport.bench", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, last", [
    (("ring", "--world-sizes", "2", "4", "--max-mib", "1", "--repeats", "1", "--backend",
      "gloo"), rf"ring_busbw_ratio_1MiB={NUMBER} ring_busbw_ratio_1MiB_w4={NUMBER}"),
    (("p2p", "--world-sizes", "2", "--exchanges", "5", "--repeats", "1", "--backend", "gloo"),
     rf"p2p_exchange_ms_w2={NUMBER}"),
    (("collectives", "--world-sizes", "2", "--max-mib", "1", "--repeats", "1", "--backend",
      "gloo"),
     rf"busbw_GBps_all_reduce_w2={NUMBER} .*busbw_GBps_sendrecv_w2={NUMBER}"),
    (("launcher", "--world-sizes", "2", "--repeats", "1"),
     rf"startup_ratio={NUMBER} noop_ms_w2={NUMBER} recover_s_w2={NUMBER} "
     rf"allreduce_ratio={NUMBER}"),
    (("ddp", "--world-sizes", "2", "--rounds", "1", "--steps", "2", "--width", "32", "--depth",
      "2"),
     rf"naive_w2={NUMBER} overlapped_w2={NUMBER} bucketed_w2={NUMBER}"),
    (("pipeline", "--world-sizes", "2", "--ms", "2", "--runs", "1", "--width", "64", "--rows",
      "8"),
     r"\d+ of 4 configurations within 10% of the formula; took \d+ s"),
], ids=lambda v: v[0] if isinstance(v, tuple) else None)
def test_each_benchmark_ends_with_its_machine_readable_line(args, last):
    out = _bench(*args)
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.fullmatch(last, out.stdout.strip().splitlines()[-1]), out.stdout[-2000:]


def test_the_ring_benchmark_needs_two_ranks():
    out = _bench("ring", "--world-sizes", "4", timeout=60)
    assert out.returncode != 0 and "include 2" in out.stderr


def test_the_hub_benchmark_refuses_an_empty_class():
    """Its full run needs root and creates Unix users (numbers in book/jupyterhub.md)."""
    out = _bench("hub", "--students", "0", timeout=60)
    assert out.returncode == 2 and "--students and --restarts must be at least 1" in out.stderr


def test_an_unknown_benchmark_lists_the_known_ones():
    out = _bench("nosuch", timeout=60)
    assert out.returncode != 0 and "launcher" in out.stderr and "pipeline" in out.stderr


# -- python -m labsupport.bench overlap -------------------------------------------------

OVERLAP_LAST = (rf"crossing_measured_over_formula_max=({NUMBER}|none) "
                rf"ring_attn_overlap_speedup_large_block=({NUMBER}|none)")


def test_the_overlap_benchmark_ends_with_both_keys_and_fails_on_a_missing_value():
    """Chapters 4 and 6's small sweeps (the full run is the benchmark's): the last
    line carries both keys; a value a sweep could not give reads `none` and the
    script then exits non-zero, saying which."""
    out = _bench("overlap", "--chapters", "4", "6", timeout=600)
    last = out.stdout.strip().splitlines()[-1]
    assert re.fullmatch(OVERLAP_LAST, last), out.stdout[-2000:] + out.stderr[-2000:]
    assert "(bound x" in out.stdout                       # each speed-up beside its bound
    assert (out.returncode != 0) == ("none" in last), out.stderr[-2000:]
    assert out.returncode == 0 or "not measured" in out.stderr


def _fake_crossing(technique, measured, large_block):
    from labsupport.crossings import Crossing
    extra = dict(speedup=[1.0, 1.2], bound=[1.3, 1.4], large_block=large_block,
                 overlap_speedup_large_block=1.2 if large_block else None)
    return Crossing(technique, "size", [1, 2], [1.0, 2.0], [2.0, 1.0], measured, 1.0, extra)


@pytest.mark.parametrize("measured, large, last, fails", [
    (1.5, 2, "crossing_measured_over_formula_max=1.500 "
     "ring_attn_overlap_speedup_large_block=1.200",
     False),
    (None, 2, "crossing_measured_over_formula_max=none "
     "ring_attn_overlap_speedup_large_block=1.200",
     True),
    (0.5, None, "crossing_measured_over_formula_max=2.000 "
     "ring_attn_overlap_speedup_large_block=none",
     True)])
def test_a_missing_crossing_or_large_block_is_printed_and_is_an_error(
        monkeypatch, capsys, measured, large, last, fails):
    from labsupport.bench import overlap
    monkeypatch.setattr(overlap.SWEEPS[6], "sweep", lambda small: _fake_crossing(
        "context_parallel", measured, large))
    if fails:
        with pytest.raises(SystemExit, match="not measured"):
            overlap.main(["--chapters", "6"])
    else:
        overlap.main(["--chapters", "6"])
    assert capsys.readouterr().out.strip().splitlines()[-1] == last


def test_the_capstone_benchmark_ends_with_its_line():
    """Tiny: parity on one layout, the speed pair once, the resume at 8 ranks."""
    out = _bench("capstone", "--layouts", "2,1,1,1", "--steps", "1", "--speed-layout",
                 "2", "1", "1", "1", "--speed-steps", "3", "--repeats", "1", "--hidden",
                 "32", "--layers", "2", "--batch", "8", "--seq-len", "32",
                 "--micro-batches", "2", "--clip-layouts", "1,1,3,1",
                 "--memory-layouts", "2,1,1,1")
    assert out.returncode == 0, out.stderr[-2000:]
    num = r"\d+\.\d+(e[-+]\d+)?"
    last = out.stdout.strip().splitlines()[-1]
    assert re.fullmatch(rf"capstone_step0_rel_diff={num} capstone_curve_rel_diff={num} "
                        rf"capstone_step_ratio_vs_native={num} "
                        rf"capstone_mfu_measured_peak={num} capstone_resume_equal=1 "
                        rf"capstone_clip_rel_diff={num} capstone_memory_vs_formula={num} "
                        rf"capstone_one_rank_overhead={num}",
                        last), out.stdout[-2000:]
    step0 = float(re.search(rf"capstone_step0_rel_diff=({num})", last).group(1))
    assert step0 <= 1e-6, last
    clip_rel = float(re.search(rf"capstone_clip_rel_diff=({num})", last).group(1))
    assert clip_rel <= 1e-12, last                     # float64: rounding only
    memory = float(re.search(rf"capstone_memory_vs_formula=({num})", last).group(1))
    assert 0.95 <= memory <= 1.05, last


def test_the_debug_benchmark_ends_with_its_line():
    """Two faults (a hang and a straggler), one alternated run of each mode."""
    out = _bench("debug", "--faults", "eval_on_rank_zero", "straggler", "--repeats", "1",
                 "--steps", "3")
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    assert re.fullmatch(rf"debug_faults_named=2/2 debug_worst_seconds_to_name={NUMBER} "
                        rf"debug_detail_overhead={NUMBER} debug_fr_overhead={NUMBER}",
                        last), out.stdout[-2000:]
