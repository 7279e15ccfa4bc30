"""Bytes of training state: counted from real tensors, and the formulas beside them.

Shared by the memory chapter (0), ZeRO (7) and the DeviceMesh planner (8), so
that every chapter's calculator gives the same answer:

    ls.memory.tally.storage_bytes(model.parameters())        # counted: unique storages
    ls.memory.tally.model_state_bytes(psi, precision="mixed", zero_stage=2, dp=64)
    with ls.memory.tally.saved_tensors(exclude=model.parameters()) as saved:
        loss = model(ids, targets)                      # saved.bytes: activations
    with ls.memory.tally.peak_tally(model.parameters()) as tally:
        step()                                          # tally.peak: live bytes, CPU

Formulas follow Rajbhandari et al., "ZeRO" (arXiv 1910.02054), Section 3.1 and
Figure 1: with Adam, K = 12 bytes of optimizer state per parameter in mixed
precision (fp32 master weights, momentum, variance), 2 + 2 bytes of 16-bit
weights and gradients; in fp32 training the weights are their own master copy,
so 4 + 4 + 8. The activations' formula is ``memory_calc.activation_bytes_per_layer``.
"""
import contextlib
import weakref

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

# Bytes per parameter of each category: (weights, gradients, optimizer state).
PRECISIONS = {
    "fp32": (4, 4, 8),          # fp32 weights and grads; Adam's m and v
    "mixed": (2, 2, 12),        # bf16/fp16 weights and grads; fp32 master, m, v
    "mixed_fp32_grads": (2, 4, 12),  # 16-bit weights, gradients accumulated in fp32
}


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and tied weights count once).

    A tally of what is really allocated, not numel times itemsize: a slice of a
    flat buffer counts the whole buffer, as the allocator does.
    """
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.device)
        if key not in seen and storage.nbytes():
            seen.add(key)
            total += storage.nbytes()
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor an optimizer keeps in its state (Adam: step, m, v)."""
    return storage_bytes(v for state in optimizer.state.values()
                         for v in state.values() if torch.is_tensor(v))


def model_state_bytes(psi: int, precision: str = "mixed", zero_stage: int = 0,
                      dp: int = 1) -> dict:
    """Per-rank bytes of weights, gradients and optimizer state for ``psi`` parameters.

    ZeRO stage 1 shards the optimizer state over the ``dp`` ranks, stage 2 also
    the gradients, stage 3 also the weights (the paper's P_os, P_os+g, P_os+g+p).
    Returns {"params", "grads", "optimizer", "total"} in bytes.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: use one of {sorted(PRECISIONS)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage}: use 0 (plain data parallel), 1, 2 or 3")
    if dp < 1 or psi < 0:
        raise ValueError(f"need dp >= 1 and psi >= 0, got dp={dp}, psi={psi}")
    w, g, k = PRECISIONS[precision]
    share = [1 / dp if zero_stage >= stage else 1 for stage in (3, 2, 1)]
    out = {"params": w * psi * share[0], "grads": g * psi * share[1],
           "optimizer": k * psi * share[2]}
    out["total"] = sum(out.values())
    return out


class SavedTensors:
    """What autograd saved for backward inside a :func:`saved_tensors` block."""

    def __init__(self, exclude=()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.tensors: list[torch.Tensor] = []

    def pack(self, tensor):
        # Detached: a saved view that keeps its grad_fn would make a reference
        # cycle through the graph, and a forward never followed by backward
        # would then leak all its activations. Autograd restores the grad_fn
        # when it unpacks.
        tensor = tensor.detach()
        if tensor.untyped_storage().data_ptr() not in self._exclude:
            self.tensors.append(tensor)
        return tensor

    @property
    def bytes(self) -> int:
        """Distinct storages saved (a tensor saved by two operations counts once)."""
        return storage_bytes(self.tensors)


@contextlib.contextmanager
def saved_tensors(exclude=()):
    """Record every tensor autograd saves for backward in the block (activations).

    Uses ``torch.autograd.graph.saved_tensors_hooks``. Tensors sharing storage
    with ``exclude`` (pass the model's parameters) are weights, not
    activations, and are left out.
    """
    tally = SavedTensors(exclude)
    with torch.autograd.graph.saved_tensors_hooks(tally.pack, lambda t: t):
        yield tally


class PeakTally(TorchDispatchMode):
    """A tally of live storages while a block runs: ``live`` bytes now, ``peak`` so far.

    A CPU stand-in for ``torch.cuda.max_memory_allocated``, which on GPUs asks
    the caching allocator itself. Here every ATen operation is seen (below
    autograd, so backward, recomputation and the optimizer too): a storage an
    operation returns that no input shares is a new allocation, counted until
    Python's weak reference to it says it was freed (a storage only C++ still
    holds, in autograd's graph or a collective's work, is not freed yet). With
    ``counting`` False, new storages are seen but not counted, until ``add``
    counts them. The peak is taken between operations, so a kernel's internal
    scratch space is not seen;
    storages made before the block count only if passed as ``baseline``, and
    ``torch.tensor(3.0)`` (built from Python data, no operation) is not seen.
    """

    def __init__(self, baseline=(), record=False):
        super().__init__()
        self._bytes = {}                      # storage key -> bytes counted
        self.live = 0
        self.counting = True                  # False: new storages are seen, not counted
        self.trace = [] if record else None   # (operation name, live bytes after it)
        self.add(baseline)
        self.peak = self.live

    def add(self, tensors):
        """Count the storages of ``tensors`` from now on, until each is freed (also
        those seen before and left uncounted: made while ``counting`` was False)."""
        for t in tensors:
            if t is None:
                continue
            storage = t.untyped_storage()
            self._track(storage, count=True)
            if not self._bytes[storage._cdata]:  # seen before, uncounted
                self._bytes[storage._cdata] = storage.nbytes()
                self.live += storage.nbytes()

    def _track(self, storage, count):
        key = storage._cdata                  # the C++ StorageImpl's address
        if key in self._bytes:
            return
        nbytes = storage.nbytes() if count else 0
        self._bytes[key] = nbytes
        self.live += nbytes
        weakref.finalize(storage, self._free, key)

    def _free(self, key):
        self.live -= self._bytes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if torch.is_tensor(t)]
        for t in inputs:                      # existed before: an alias, not new
            self._track(t.untyped_storage(), count=False)
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if torch.is_tensor(t):
                self._track(t.untyped_storage(), count=self.counting)
        self.peak = max(self.peak, self.live)
        if self.trace is not None:
            self.trace.append((func.__name__, self.live))
        return out


def peak_tally(baseline=(), record=False) -> PeakTally:
    """``with peak_tally(model.parameters()) as tally: step()`` -> tally.peak, tally.live.

    ``record=True`` also keeps ``tally.trace``, the live bytes after every operation.
    On CPU this tallies live storages (see :class:`PeakTally`); on a GPU, use
    ``torch.cuda.reset_peak_memory_stats()`` and ``torch.cuda.max_memory_allocated()``,
    the allocator's own count.
    """
    return PeakTally(baseline, record)
