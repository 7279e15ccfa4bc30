"""Graded assignments: run a student's function on several ranks and fail helpfully.

    ls.grading.check_allreduce(ring_all_reduce, traffic=True)   # checks.py: the collectives
    calls = ls.grading.run(fn, x, world_size=4)                 # any function, recorded
    ls.grading.assert_rules(calls, "fn", allowed=("all_reduce",))

- ``checks``: each check, its cases and the messages for a wrong answer;
- ``diagnosis``: running on the ranks with a deadline (``TIMEOUT``, a stall of
  the ranks' CPU time, not a flat wall clock: ``launch.progress``) and turning
  an exception or a hang into advice;
- ``deadlock``: which message each stuck rank waited for, from its ``p2p_log``;
- ``held``: what a student's code holds by reference, the memory count of
  assignments 4 and 5 (the same under any load, unlike a tally of live storages);
- one module per assignment, named after its folder in
  notebooks/assignments/source (``ls.grading.<folder>``, imported on first
  use): see ``_CHECKS``; the chapters' your-turn checks in ``chapters``.
"""
import importlib

from labsupport.grading.checks import (SIZES, WORLD_SIZES, assert_rules, check_all_gather,
                                       check_allreduce, check_reduce_scatter, run)
from labsupport.grading.diagnosis import TIMEOUT

__all__ = ["SIZES", "TIMEOUT", "WORLD_SIZES", "assert_rules", "check_all_gather",
           "check_allreduce", "check_reduce_scatter", "run"]

# The checks of later assignments and chapters' your-turn cells, reached as
# ``ls.grading.<name>`` and imported on first use (they import torch's extras).
_CHECKS = {"chapters", "diagnose_the_job", "grad_sync_4d", "hybrid_sharded_dp", "padded_expert_dispatch", "rabenseifner_allreduce",
           "reshard_to_tensor_parallel", "vocab_parallel_xent", "zero2_overlap",
           "zero_bubble_pipeline", "zigzag_ring_attention"}


def __getattr__(name):
    if name in _CHECKS:
        return importlib.import_module(f"labsupport.grading.{name}")
    raise AttributeError(f"module 'labsupport.grading' has no attribute {name!r}")
