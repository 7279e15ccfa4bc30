# Run: PYTHONPATH=$PWD flock /tmp/heavy.lock .venv/bin/python scripts/grade_a5_under_load.py
#   once idle, once with `python -c 'while 1: pass' &` running three times; compare.
"""Grade assignment 5's reference and its all-reduce answer as the notebook's cells do
(each graded cell's checks, in one process), and print each one's score, cells and
gradient bytes per rank and step: book/instructors.md, "Grades independent of load".
The wall time of the slowest cell is printed to size the deadline's margin; it enters
no score."""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import labsupport.grading.zero2_overlap as gz  # noqa: E402
import test_grading_zero2_overlap as t  # noqa: E402 - the reference and its edits
from labsupport.checking import collective_checks  # noqa: E402

CELLS = [  # (test cell, points, its checks): as in the source notebook
    ("test_parity", 3, lambda c: gz.check_parity(c, world_sizes=(2, 4), bucket_numel=1000)),
    ("test_parity_buckets", 1, lambda c: (
        gz.check_parity(c, world_sizes=(4,), bucket_numel=1),
        gz.check_parity(c, world_sizes=(2,), bucket_numel=10**9))),
    ("test_reduce_scatter", 2,
     lambda c: gz.check_reduce_scatter(c, world_sizes=(2, 4), bucket_numel=1000)),
    ("test_overlap", 2, lambda c: gz.check_overlap(c, bucket_numel=1000)),
    ("test_memory", 2, lambda c: gz.check_memory(c, bucket_numel=1000)),
]


def grade(name) -> dict:
    cls, score, cells, slowest = t.CLASSES[name], 0, {}, 0.0
    for cell, points, check in CELLS:
        t0 = time.monotonic()
        try:
            check(cls)
            score += points
            cells[cell] = points
        except AssertionError as e:
            cells[cell] = f"0: {str(e)[:60]}"
        slowest = max(slowest, time.monotonic() - t0)
    runs = [c["value"] for c in collective_checks.run(gz._train, cls, 1000, gz.STEPS,
                                                      world_size=2)]
    return dict(score=score, cells=cells, slowest_cell_s=round(slowest, 1),
                bytes=[dict(peak=r["peak_grad_bytes"], after_finish=r["after"]["held"],
                            steps=r["steps"]) for r in runs])


if __name__ == "__main__":
    print(json.dumps({name: grade(name) for name in ("reference", "all_reduce")}, indent=1))
