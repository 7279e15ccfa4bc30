"""NCCL's point-to-point rules on gloo, so that a CPU run hangs where a GPU run would.

    LABSUPPORT_P2P=strict      # in the environment of ls.start / ls.main / pytest

On GPUs the ranks' point-to-point messages obey NCCL, whose rules gloo does
not enforce. With the eager initialisation labsupport uses (``device_id``
given to ``init_process_group``), torch's NCCL backend runs "unbatched P2P
ops [...] as independent collective ops, [...] serialized with all other ops
on this ProcessGroup, including other P2P ops" (its warning, in
torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp); NCCL's ``ncclSend`` and
``ncclRecv`` have no tag and are "blocking for the GPU": a send completes
only with its peer's matching receive, and operations that must progress
together must be grouped (https://docs.nvidia.com/deeplearning/nccl/
user-guide/docs/usage/p2p.html; torch's ``isend`` says "tag is not
supported with the NCCL backend").

In strict mode each rank replays those rules on gloo, through one queue per
process group (NCCL's stream), run by a helper thread in issue order:

- tags are ignored: messages between two ranks match in issue order;
- each unbatched ``isend``/``irecv``/``send``/``recv`` completes before the
  group's next operation starts. A gloo send completes only once its peer has
  posted the matching receive (gloo's TCP pair sends data after the peer's
  "receive ready" notice, gloo/transport/tcp/pair.cc), so nothing relies on
  buffering;
- the operations of one ``batch_isend_irecv`` progress together;
- a collective of the group waits for the group's earlier operations, and
  the group's later ones wait for it (NCCL's one stream). That is stricter
  than needed for CPU tensors under ``cpu:gloo,cuda:nccl`` (gloo's own
  threads), never looser;
- and gloo's own trap stays a trap: a request waited for a second time
  raises (on gloo that wait never returns), so code that passes here runs
  on both.

So a pattern that can hang on NCCL hangs here too, on a CPU, and
``labsupport.p2p_log`` records what each operation was queued behind
(``checking.deadlock`` explains it). ``install`` is called by every rank at
start (``launch.rank_main``, ``launch.torchrun``) and does nothing unless
the environment asks for strict mode.
"""
import collections
import inspect
import os
import threading

import torch
import torch.distributed.distributed_c10d as c10d

from labsupport import _patch

ENV = "LABSUPPORT_P2P"
MODES = ("", "gloo", "strict")  # unset or "gloo": gloo's own rules
P2P = ("isend", "irecv")  # torch's send and recv are isend and irecv, waited for
ORDERED = ("barrier", "all_reduce", "reduce", "broadcast", "all_gather",
           "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
           "all_to_all", "all_to_all_single", "gather", "scatter")
_state = {"installed": False}
_streams: dict = {}  # process group -> _Stream
_streams_lock = threading.Lock()


def requested() -> bool:
    """Whether the environment asks for strict mode; a clear error for a typo."""
    value = os.environ.get(ENV, "").strip().lower()
    if value not in MODES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: use 'strict' (NCCL's point-to-point "
                         "rules on gloo) or leave it unset (gloo's own rules)")
    return value == "strict"


def active() -> bool:
    """Whether this process runs point-to-point by NCCL's rules."""
    return _state["installed"]


def install():
    """Replace dist's point-to-point functions by strict ones, if ``requested()``."""
    if _state["installed"] or not requested():
        return
    from labsupport.launch.identity import backend_of
    if backend_of() == "nccl":
        raise RuntimeError(f"{ENV}=strict runs gloo by NCCL's rules, and these ranks run "
                           f"NCCL itself: unset {ENV}, or use LABSUPPORT_BACKEND=gloo")
    originals = {name: _patch.current(name) for name in (*P2P, *ORDERED, "batch_isend_irecv")}
    strict = {name: _unbatched(name, originals) for name in P2P}
    strict["batch_isend_irecv"] = _batch(originals)
    strict.update({name: _ordered(originals[name]) for name in ORDERED})
    _patch.install(strict)
    _state["installed"] = True


class StrictWork:
    """What a strict isend/irecv returns: done when its queue has run it."""

    def __init__(self):
        self._lock, self._done = threading.RLock(), threading.Event()
        self._error, self._callbacks, self._waited = None, [], False

    def wait(self, timeout=None):
        if self._waited:  # NCCL would not mind; gloo would never return
            raise RuntimeError(
                "this point-to-point request was already waited for: on gloo a second "
                "wait() of an isend/irecv request blocks forever (its buffer waits for "
                "another completion). Wait for each request once.")
        seconds = getattr(timeout, "total_seconds", lambda: timeout)()
        if not self._done.wait(seconds):
            raise RuntimeError(f"the operation did not complete within {seconds} s")
        self._waited = True
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        """Done without an error (torch's ``Work.is_success``)."""
        return self._done.is_set() and self._error is None

    def exception(self):
        return self._error

    def on_done(self, callback):
        """Call ``callback()`` once the operation has completed (now, if it has)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def get_future(self):
        future = torch.futures.Future()
        self.on_done(lambda: future.set_exception(self._error) if self._error
                     else future.set_result(None))
        return future

    def _finish(self, error):
        with self._lock:  # callbacks first: wait() returns once they have run
            self._error = error
            try:  # (calls' "done" is written before the waiter's record closes)
                for callback in self._callbacks:
                    callback()
            finally:
                self._callbacks = []
                self._done.set()  # even if a callback raised: no waiter hangs


# How long an idle helper thread waits for more work before it ends (a timed
# wait on an event, not a poll). Starting a thread costs about 0.2 ms on the
# course's 2-core machine, most of what strict mode added to a batch when it
# started two per batch; a pipeline or a ring issues its next batch within
# microseconds, so the threads that ran the last one take it.
LINGER_S = 1.0


class _Stream:
    """One group's operations, run one at a time in issue order by a helper thread.

    The thread lives while the queue holds work and ``LINGER_S`` after, so
    an idle rank keeps no thread per group and a busy one starts none per
    operation. Collectives run on the caller's thread: each waits until the
    queue is empty, and the queue's next item waits for them.
    """

    def __init__(self):
        self._cv, self._items = threading.Condition(), collections.deque()
        self._running = False   # an item is being run
        self._thread = False    # a helper thread is alive (running or lingering)
        self._collectives = []  # asynchronous ones, maybe still running

    def idle(self) -> bool:
        with self._cv:
            return not self._items and not self._running

    def behind(self, work):
        """The next item starts after ``work`` (an asynchronous collective)."""
        with self._cv:
            self._collectives = [w for w in self._collectives if not w.is_completed()]
            self._collectives.append(work)

    def put(self, run) -> StrictWork:
        work = StrictWork()
        with self._cv:
            self._items.append((run, work))
            if self._thread:
                self._cv.notify()
            else:
                self._thread = True
                threading.Thread(target=self._drain, daemon=True,
                                 name="labsupport-strict-p2p").start()
        return work

    def _drain(self):
        while True:
            with self._cv:
                self._running = False
                if not self._items:
                    self._cv.wait(LINGER_S)
                if not self._items:  # idle for LINGER_S: end (put starts another)
                    self._thread = False
                    return
                run, work = self._items.popleft()
                self._running = True
                collectives, self._collectives = self._collectives, []
            try:
                for collective in collectives:
                    collective.wait()
                run()
            except BaseException as error:  # the caller's wait() raises it
                work._finish(error)
            else:
                work._finish(None)


class _Waiters:
    """Threads that each wait for one gloo request, reused: a batch's requests
    complete on their own without a thread started per request. An idle
    thread is handed its next request directly (its own slot), so no request
    waits in a queue behind another that may never complete."""

    def __init__(self):
        self._lock, self._idle = threading.Lock(), []  # idle threads' slots

    def wait(self, work, request):
        """Wait for ``work`` on a helper thread, then finish ``request``."""
        with self._lock:
            if self._idle:
                slot = self._idle.pop()
                slot.job = (work, request)
                slot.ready.set()
                return
        threading.Thread(target=self._serve, args=((work, request),), daemon=True,
                         name="labsupport-strict-p2p-wait").start()

    def _serve(self, job):
        slot = _Slot()
        while True:
            _complete_one(*job)
            slot.ready.clear()
            with self._lock:
                self._idle.append(slot)
            if not slot.ready.wait(LINGER_S):
                with self._lock:
                    if slot in self._idle:  # nothing handed over: end
                        self._idle.remove(slot)
                        return
                slot.ready.wait()  # handed a job as the wait ended
            job = slot.job


class _Slot:
    """An idle waiter thread's mailbox (compared by identity)."""

    def __init__(self):
        self.ready, self.job = threading.Event(), None


_waiters = _Waiters()


def _forget_threads():
    """A forked child has none of its parent's helper threads: start afresh."""
    global _waiters
    _streams.clear()
    _waiters = _Waiters()


os.register_at_fork(after_in_child=_forget_threads)


def _stream(group) -> _Stream:
    group = c10d._group_or_default_group(group)
    with _streams_lock:
        return _streams.setdefault(group, _Stream())


def _unbatched(name, originals):
    """isend/irecv (and so send/recv, which torch builds from them): queued
    alone, run to completion, tag ignored."""
    post = originals[name]
    signature = inspect.signature(post)

    def strict(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        arguments = dict(call.arguments, tag=0)  # NCCL has no tags
        _refuse_any_source(name, arguments)
        return _stream(arguments["group"]).put(lambda: _complete(post(**arguments)))
    strict.__name__ = strict.__qualname__ = name
    strict.__signature__ = signature  # for the recorders
    strict.__doc__ = f"dist.{name} by NCCL's rules (LABSUPPORT_P2P=strict)."
    return strict


def _batch(originals):
    """batch_isend_irecv: every operation posted at once, the batch queued as one.

    Each operation's request completes on its own (so a report can name the
    one that never did); the group's next operation waits for all of them.
    """
    def batch_isend_irecv(p2p_op_list):
        ops = list(p2p_op_list)
        c10d._check_p2p_op_list(ops)
        requests = [StrictWork() for _ in ops]

        def run():
            try:
                works = [originals[_kind(op)](op.tensor, group=op.group, tag=0,
                                              **{_peer_key(op): op.group_peer})
                         for op in ops]
            except BaseException as error:
                for request in requests:
                    request._finish(error)
                raise
            _complete_all(works, requests)
        _stream(ops[0].group).put(run)
        return list(requests)  # the caller's own list (send_object_list pops it)
    batch_isend_irecv.__doc__ = "dist.batch_isend_irecv by NCCL's rules (LABSUPPORT_P2P=strict)."
    return batch_isend_irecv


def _complete_all(works, requests):
    """Wait for every work, each finishing its request as soon as it is done."""
    for pair in zip(works[1:], requests[1:]):
        _waiters.wait(*pair)
    _complete_one(works[0], requests[0])
    for request in requests[1:]:
        request._done.wait()


def _complete_one(work, request):
    try:
        _complete(work)
    except BaseException as error:
        return request._finish(error)
    request._finish(None)


def _ordered(original):
    """A collective, after the group's earlier operations and before its later ones."""
    signature = inspect.signature(original)

    def strict(*args, **kwargs):
        if not _streams:  # no point-to-point yet: nothing to order against
            return original(*args, **kwargs)
        group = signature.bind(*args, **kwargs).arguments.get("group")
        stream = _stream(group)
        if not stream.idle():  # the group's earlier operations first
            stream.put(lambda: None).wait()
        result = original(*args, **kwargs)
        if hasattr(result, "wait"):  # async_op=True: later operations wait for it
            stream.behind(result)
        return result
    strict.__name__ = strict.__qualname__ = original.__name__
    strict.__wrapped__ = original
    return strict


def _kind(op) -> str:
    """'isend' or 'irecv': what a P2POp does (its op may be a recorder's wrapper)."""
    return "isend" if "send" in getattr(op.op, "__name__", "isend") else "irecv"


def _peer_key(op) -> str:
    return "group_dst" if _kind(op) == "isend" else "group_src"


def _refuse_any_source(name, arguments):
    if "recv" in name and arguments.get("src") is None and arguments.get("group_src") is None:
        raise ValueError("a receive without src takes a message from any rank, which NCCL "
                         "cannot do (LABSUPPORT_P2P=strict runs by its rules): name the "
                         "sender, dist.recv(tensor, src)")


def _complete(work):
    if work is not None:  # None: this rank is not in the group
        work.wait()
