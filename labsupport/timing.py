"""Time the work a device did, not the host's queueing of it: one clock for CPU and GPU.

    start = timing.now(device)           # time.perf_counter(), once `device` is idle
    loss = model(x); loss.backward()     # work on `device`
    seconds = timing.now(device) - start
    Timeline(rank, device=device)        # spans timed the same way (labsupport.timeline)

On a CPU the work is done when the Python call returns, so ``now`` is plain
``time.perf_counter()``. On a GPU a call only queues kernels, which run
later ("CUDA operations are executed asynchronously",
https://pytorch.org/docs/stable/notes/cuda.html#asynchronous-execution):
``now`` first waits for the device (``torch.cuda.synchronize``), so the time
measured is the GPU's. Every rank reads the same clock (``perf_counter``,
CLOCK_MONOTONIC), so the timelines of the ranks of a machine line up.
"""
import time


def sync(device=None):
    """Wait until ``device`` has run what was queued on it (nothing to wait for on a CPU)."""
    if device is None:
        return
    import torch
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device=None) -> float:
    """``time.perf_counter()`` once ``device`` has finished its queued work."""
    sync(device)
    return time.perf_counter()
