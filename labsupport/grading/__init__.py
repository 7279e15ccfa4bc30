"""Graded assignments: one module per assignment, on the checking core (``labsupport.checking``).

    ls.grading.check_allreduce(ring_all_reduce, traffic=True)   # checking.collective_checks
    calls = ls.grading.run(fn, x, world_size=4)                 # any function, recorded
    ls.grading.assert_rules(calls, "fn", allowed=("all_reduce",))

One module per assignment, named after its folder in
notebooks/assignments/source (``ls.grading.<folder>``, imported on first use):
``_GRADERS`` lists them. The names above and ``TIMEOUT`` are re-exported from
``labsupport.checking`` for the assignment notebooks already released, which
reach them as ``ls.grading.<name>``; the core's old module paths
(``labsupport.grading.checks``, ``.diagnosis``, ``.deadlock``, ``.held``) are
aliases for one term (``labsupport/_aliases.py``).
"""
import importlib
import pkgutil

from labsupport import _aliases
from labsupport.checking.collective_checks import (
    SIZES,
    WORLD_SIZES,
    assert_rules,
    check_all_gather,
    check_allreduce,
    check_reduce_scatter,
    run,
)
from labsupport.checking.diagnosis import TIMEOUT

__all__ = ["SIZES", "TIMEOUT", "WORLD_SIZES", "assert_rules", "check_all_gather",
           "check_allreduce", "check_reduce_scatter", "run"]

# The graders of the assignments, every module of this folder, reached as
# ``ls.grading.<name>`` and imported on first use (they import torch's extras).
_GRADERS = {m.name for m in pkgutil.iter_modules(__path__)}


def __getattr__(name):
    if name in _GRADERS:
        return importlib.import_module(f"labsupport.grading.{name}")
    if f"labsupport.grading.{name}" in _aliases.OLD_PATHS:      # the core's old path
        return _aliases.resolve(f"labsupport.grading.{name}")
    raise AttributeError(f"module 'labsupport.grading' has no attribute {name!r}")
