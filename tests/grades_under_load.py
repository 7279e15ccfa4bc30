"""The verdicts of every grade that once read a clock or the allocator, as one JSON-able dict.

    python tests/grades_under_load.py      # prints them (run beside another grading)

Assignment 3's idle fraction (logical time), assignment 4's and 5's memory
(counted by reference): each assignment's reference and one wrong answer per
such check. A verdict is the check's return value, or its AssertionError's
text for an answer that fails: two runs agree only if every number and every
message is the same. ``tests/test_grades_under_load.py`` grades this under
load, three times and beside a second process doing the same.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # sources, the cases

import grading_zero_bubble_pipeline_cases as a3_cases  # noqa: E402
import labsupport.grading.hybrid_sharded_dp as gh  # noqa: E402
import labsupport.grading.zero2_overlap as g5  # noqa: E402
import sources  # noqa: E402
from labsupport.grading import zero_bubble_pipeline as g3  # noqa: E402


def verdict(check, *args, **kwargs):
    try:
        return {"passed": _plain(check(*args, **kwargs))}
    except AssertionError as failure:
        return {"failed": str(failure)}


def _plain(value):
    """A check's return value as JSON: numbers, lists and dicts (floats exact)."""
    return json.loads(json.dumps(value, default=repr))


def a5_class(name):
    from test_grading_zero2_overlap import CLASSES  # the reference and its edits
    return CLASSES[name]


def a4_module(name):
    from test_grading_hybrid_sharded_dp import MODULES, ref
    return ref if name == "reference" else MODULES[name]


def verdicts() -> dict:
    a3 = sources.reference("zero_bubble_pipeline")
    out = {
        "a3 reference idle": verdict(g3.check_idle_fraction, a3.train_step_zb_h1),
        "a3 W at once idle": verdict(g3.check_idle_fraction,
                                     a3_cases.train_step_w_at_once),
    }
    for name in ("reference", "all_reduce", "keep_buffers"):
        out[f"a5 {name} memory"] = verdict(g5.check_memory, a5_class(name))
    for name in ("reference", "keep_full_grads"):
        m = a4_module(name)
        out[f"a4 {name} memory"] = verdict(gh.check_memory, m.hsdp_groups, m.HSDP)
    return out


if __name__ == "__main__":
    print("grading", file=sys.stderr, flush=True)   # imports done (for the load test)
    print(json.dumps(verdicts(), sort_keys=True))
