"""Watch a data-parallel training step from inside a rank (chapter 3's measurements).

    with watch_all_reduce(tl) as log:        # every dist.all_reduce: bytes, start, end
        ...
    log.count, log.nbytes                    # calls and payload bytes in the block
    profile_steps(make_model, wrap, x, y)    # step times and a recorded timeline
    profile_versions(make_model, {"a": wrap_a, "b": wrap_b}, x, y)  # the same, taking turns
    count_step(make_model, wrap, x, y)       # one step's calls, payload and wire bytes
    state_bytes(model, optimizer)            # bytes of parameters, gradients, optimizer state

Timestamps are ``time.perf_counter()``, one clock for every rank of a
machine (see labsupport.timeline), read once the rank's device has finished
its queued work (``labsupport.timing``): step times and the forward's and the
optimizer's spans are the GPU's on a GPU; the backward's segments are the
host's (``GradReadyProbe``). An asynchronous all-reduce is timed from
the call to its completion, stamped by a callback on the work's future (run
by the backend's thread when the work completes), so its bar on the timeline
is when the communication really ran, not when someone waited for it. That
holds for gloo; NCCL completes a work's future once the collective is queued
on its CUDA stream, so on GPUs these bars are host-side times (a CUDA
profiler shows the device's).
"""
import contextlib
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labsupport import calls, traffic
from labsupport.timeline import Timeline


class AllReduceLog:
    """The all-reduce calls of one ``watch_all_reduce`` block, in call order."""

    def __init__(self):
        self.calls: list[dict] = []   # labsupport.calls' dicts: nbytes, start, end (None
        #                               until completed), ...

    @property
    def count(self) -> int:
        return len(self.calls)

    @property
    def nbytes(self) -> int:
        """Payload bytes handed to all_reduce (the tensors' sizes)."""
        return sum(c["nbytes"] for c in self.calls)

    def __repr__(self):
        return f"AllReduceLog(count={self.count}, nbytes={self.nbytes})"


@contextlib.contextmanager
def watch_all_reduce(timeline: Timeline | None = None):
    """Log every ``dist.all_reduce`` of this rank in the block (and draw it on ``timeline``).

    Calls made through the module (``dist.all_reduce(...)``), as the
    hand-written versions and DDP's Python comm hooks do, are seen
    (``labsupport.calls``, the one recorder); DDP's built-in all-reduce runs
    in C++ and is not.
    """
    log = AllReduceLog()

    def seen(event, call, tensor=None):
        if call["op"] != "all_reduce":
            return
        if event == "start":
            log.calls.append(call)
        elif event == "end" and timeline is not None:
            timeline.record("comm", "all-reduce", call["start"], call["end"],
                            kib=call["nbytes"] / 1024)
    with calls.record(seen):
        yield log


class GradReadyProbe:
    """Backward's compute as segments: from one gradient ready to the next.

    Call ``start()`` right before ``loss.backward()``. Register the probe on
    the bare model *before* wrapping it, so its hook runs before the wrapper's
    (hooks of a tensor run in registration order) and a segment ends when the
    gradient is ready, not after its all-reduce was launched. Its stamps are
    the host's (``time.perf_counter`` as autograd runs the hook): waiting for
    a GPU there would wait for the all-reduces in flight too and undo the
    overlap being measured, so on a GPU a segment is when that part of the
    backward was queued (a CUDA profiler shows the device's).
    """

    def __init__(self, module, timeline: Timeline):
        self.timeline, self.last = timeline, None
        self.handles = [p.register_post_accumulate_grad_hook(self._ready)
                        for p in module.parameters() if p.requires_grad]

    def start(self):
        self.last = time.perf_counter()

    def _ready(self, param):
        now = time.perf_counter()
        if self.last is not None:
            self.timeline.record("compute", "backward", self.last, now)
        self.last = now

    def remove(self):
        for handle in self.handles:
            handle.remove()


def _step(model, optimizer, x, y, tl: Timeline, probe: GradReadyProbe):
    """One training step, each phase on the timeline."""
    with tl.span("compute", "forward"):
        loss = F.mse_loss(model(x), y)
    probe.start()
    loss.backward()
    sync = getattr(model, "sync_gradients", None)  # DDP syncs inside backward
    if sync is not None:
        with tl.span("wait", "sync_gradients"):
            sync()
    with tl.span("compute", "optimizer"):
        optimizer.step()
        optimizer.zero_grad()


def _setup(make_model, wrap, lr, device):
    tl = Timeline(device=device)  # spans end when the device's work is done
    module = make_model().to(device)
    probe = GradReadyProbe(module, tl)
    model = wrap(module)
    return model, torch.optim.SGD(model.parameters(), lr=lr), tl, probe


def profile_steps(make_model, wrap, x, y, steps=10, warmup=3, lr=0.01) -> dict:
    """Time ``steps`` training steps of ``wrap(make_model())`` on this rank's (x, y).

    Every step starts after a barrier, so the ranks start together. Returns
    this rank's step times (seconds), the events of each timed step
    (``step_events``) and of the last (``events``), and that step's
    all-reduce calls and payload bytes.
    """
    return profile_versions(make_model, {"run": wrap}, x, y, steps, warmup, lr)["run"]


def profile_versions(make_model, wraps: dict, x, y, steps=10, warmup=3, lr=0.01) -> dict:
    """``profile_steps`` of several wrappers ({name: wrap}) at once, {name: its dict}:
    their steps take turns, so that a burst of load on a shared machine falls
    on all of them rather than on one."""
    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    setups = {name: _setup(make_model, wrap, lr, x.device) for name, wrap in wraps.items()}
    out = {name: dict(times=[], step_events=[]) for name in wraps}
    for i in range(warmup + steps):
        for name, (model, optimizer, tl, probe) in setups.items():
            tl.events = []
            dist.barrier()
            with watch_all_reduce(tl) as log:
                start = tl.now()
                _step(model, optimizer, x, y, tl, probe)
                elapsed = tl.now() - start
            if i >= warmup:
                out[name]["times"].append(elapsed)
                out[name]["step_events"].append(tl.events)
            out[name].update(events=tl.events, calls=log.count, nbytes=log.nbytes)
    for *_, probe in setups.values():
        probe.remove()
    return out


def count_step(make_model, wrap, x, y, warmup=3, lr=0.01, settle=0.1) -> dict:
    """All-reduce calls, payload bytes and wire bytes sent by this rank in one step.

    The counted step follows ``warmup`` steps (DDP rebuilds its buckets after
    the first) and a barrier plus ``settle`` seconds of quiet, so no byte of
    an earlier collective lands in the count.
    """
    model, optimizer, tl, probe = _setup(make_model, wrap, lr, x.device)
    for _ in range(warmup):
        _step(model, optimizer, x, y, tl, probe)
    dist.barrier()
    time.sleep(settle)
    with traffic.count(settle=settle) as wire, watch_all_reduce() as log:
        _step(model, optimizer, x, y, tl, probe)
    probe.remove()
    return dict(calls=log.count, nbytes=log.nbytes, wire_sent=wire.wire_sent)


def step_time(results: list[dict]) -> float:
    """A run's step time: the median over steps of the slowest rank's time."""
    per_step = [max(ts) for ts in zip(*(r["times"] for r in results))]
    return statistics.median(per_step)


def state_bytes(model, optimizer) -> dict:
    """Bytes this rank holds for parameters, gradients and optimizer state."""
    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return dict(params=nbytes(params),
                grads=nbytes(p.grad for p in params if p.grad is not None),
                optimizer=nbytes(state))
