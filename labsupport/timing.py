"""Time the work a device did, not the host's queueing of it: one clock for CPU and GPU.

    start = timing.now(device)           # time.perf_counter(), once `device` is idle
    loss = model(x); loss.backward()     # work on `device`
    seconds = timing.now(device) - start
    Timeline(rank, device=device)        # spans timed the same way (labsupport.timeline)
    calls.record(CallClock(device))      # each recorded collective timed the same way

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


class CallClock:
    """A ``calls.record`` listener that times each blocking call on the device's clock.

        clock = timing.CallClock(x.device)
        with calls.record(clock) as log:
            y = layer(x)                   # its all-reduces, recorded
        clock.total(log.calls)             # their seconds, the device's

    ``calls.record`` stamps a call when the host returns from it: on NCCL
    that is when the collective was queued. Here the device is waited for as
    the call starts (the work queued before it is not the call's) and as it
    ends, so each span is the device's. Blocking calls only: an asynchronous
    one ends on the backend's thread, where it is not timed.
    """

    def __init__(self, device=None):
        self.device = device
        self.seconds: dict[int, float] = {}   # call id -> seconds
        self._started: dict[int, float] = {}

    def __call__(self, event, call, tensor=None):
        if call["async_op"]:
            return
        if event == "start":
            self._started[call["id"]] = now(self.device)
        elif event == "end" and call["id"] in self._started:
            self.seconds[call["id"]] = now(self.device) - self._started.pop(call["id"])

    def total(self, calls) -> float:
        """Seconds of these calls (recorded dicts), each timed on the device."""
        return sum(self.seconds[c["id"]] for c in calls)


def alternated(measures: dict, repeats: int) -> dict:
    """Each of ``measures`` ({name: callable() -> a number, e.g. tokens/s}) called
    ``repeats`` times, in turn (a, b, a, b, ...): a shared machine's load drifts,
    and taking turns spreads the drift over every measure alike. Returns {name:
    the median}, and "runs": {name: every value, in order}."""
    import statistics
    if repeats < 1:
        raise ValueError(f"alternated needs repeats >= 1, got {repeats}")
    runs = {name: [] for name in measures}
    for _ in range(repeats):
        for name, measure in measures.items():
            runs[name].append(measure())
    return dict({name: statistics.median(v) for name, v in runs.items()}, runs=runs)
