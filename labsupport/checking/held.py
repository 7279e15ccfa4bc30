"""What a student's code holds BY REFERENCE: storages reachable from its objects.

    held = Held()
    held.snapshot([obj])          # before the phase: all of this was there already
    ...                           # the student's code runs
    held.count([obj])             # bytes of storages reachable now, first reached since

A grader that judges memory from live storages (a tally of allocations,
``memory.PeakTally``, or ``torch.cuda.memory_allocated``) sees a buffer for as
long as anything holds it, a collective's work included: gloo's worker thread
lets go of a finished work's tensors a moment after ``wait()`` returns (it
needs the GIL), so the count depends on the scheduler, and a loaded machine
changes it. This counts instead what the student's code still reaches by
Python references, walked from given roots at fixed points of the program:
references change only as the rank's own code runs, so the count is the same
on an idle laptop and on a saturated class hub. What only C++ holds (a work's
buffers, autograd's graph) is not reached; a grader that must count a
collective's buffers while it is in flight passes them as a root (their
collective not yet waited for is a fact of the program's order, not of a
thread's timing: ``zero2_overlap``).
"""
import collections
import functools
import types

import torch

_OPAQUE = (types.ModuleType, type, types.BuiltinFunctionType, str, bytes, int, float,
           complex, bool, type(None), torch.dtype, torch.device, torch.Size)


def reachable(roots, skip=()) -> dict:
    """{storage key: storage} of the tensors reachable from ``roots`` by Python
    references: containers, instance attributes (``__dict__``, ``__slots__``), a
    leaf tensor's ``.grad``, bound methods, closures and partials; an optimizer's
    ``param_groups`` (its state is not the student's data); not modules, classes,
    nor what only C++ holds. ``skip``: objects not to walk into (a grader's own)."""
    seen, found, stack = {id(s) for s in skip}, {}, list(roots)
    kept = []                                   # the walked stay alive: ids stay unique
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        kept.append(obj)
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.nbytes():
                found[storage._cdata] = storage  # the C++ StorageImpl's address
            if obj.is_leaf and obj.grad is not None:
                stack.append(obj.grad)
            stack.extend(vars(obj).values())
        elif isinstance(obj, torch.optim.Optimizer):
            stack.extend(g["params"] for g in obj.param_groups)
        elif isinstance(obj, (dict, types.MappingProxyType)):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            stack.extend(obj)
        elif isinstance(obj, types.MethodType):
            stack += [obj.__self__, obj.__func__]
        elif isinstance(obj, types.FunctionType):
            stack.extend(c.cell_contents for c in obj.__closure__ or () if _filled(c))
        elif isinstance(obj, functools.partial):
            stack += [obj.func, obj.args, obj.keywords]
        else:
            stack.extend(getattr(obj, "__dict__", {}).values())
            stack.extend(getattr(obj, name, None)
                         for name in getattr(type(obj), "__slots__", ()))
    return found


def _filled(cell) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:                          # a closure variable not yet assigned
        return False
    return True


class Held:
    """Storages classified once, at the first walk that reaches them: by
    ``snapshot`` (there before: parameters, buffers, optimizer state) or by
    ``count`` (new: what the phase under test made and kept). Each is kept
    here once classified, so its address, the key, is never reused by another
    storage during the run; when a storage is freed never enters a count, only
    whether the roots still reach it."""

    def __init__(self, skip=()):
        self.skip = skip
        self.kind: dict[int, tuple] = {}        # key -> (new?, storage)

    def snapshot(self, roots):
        for key, storage in reachable(roots, self.skip).items():
            self.kind.setdefault(key, (False, storage))

    def count(self, roots) -> int:
        total = 0
        for key, storage in reachable(roots, self.skip).items():
            if self.kind.setdefault(key, (True, storage))[0]:
                total += storage.nbytes()
        return total
