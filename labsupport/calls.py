"""The one recorder of a rank's torch.distributed calls: point-to-point and collectives.

    with calls.record() as log:                # on a rank
        dist.all_reduce(t, group=dp_group)
    log.calls            # [{"op": "all_reduce", "kind": "collective", "ranks": (0, 2), ...}]
    log.count()          # {"all_reduce": 1}
    log.bytes_by_group() # {(0, 2): 4096}: payload per group of ranks
    log.unwaited()       # the isend/irecv requests nobody waited for

Every measurement of calls is built on this one hook (installed through
``labsupport._patch``, the one way torch.distributed is replaced):
``traffic.count`` (payload of the point-to-point calls), ``p2p_log.record``
(each call also written to a file that outlives a stuck rank),
``ddp_probe.watch_all_reduce`` (all-reduces on a timeline) and the graders.
Blocks nest: a call made while two blocks are open is in both. A call
torch makes inside another recorded call (``batch_isend_irecv`` calling
``isend``) is not recorded again.

Each call is a dict: ``op``; ``kind`` ("p2p" or "collective"); ``id``;
``batch`` (the id of its ``batch_isend_irecv``, else None); ``ranks``, the
global ranks of its group; ``peer``, the global rank a send goes to or a
receive comes from; ``sizes``, the elements of each tensor argument in
order (a list of tensors counts as their sum); ``nbytes``, the payload S:
its largest tensor argument, the tensor of an all-reduce or a send, the
full tensor of an all-gather or a reduce-scatter; ``async_op``;
``in_backward``, whether autograd was running a backward pass (a gradient
hook); ``start`` and ``end`` (``time.perf_counter``): a blocking call ends
when it returns, an asynchronous collective when its work's future
completes (gloo: the data has moved; NCCL: it is queued on the stream), an
isend/irecv when it is waited for. Only calls made through the module
(``dist.all_reduce(...)``) are seen: DTensor's and FSDP2's functional
collectives and DDP's C++ reducer are not.
"""
import contextlib
import inspect
import itertools
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from labsupport._patch import current, patched

P2P = ("send", "recv", "isend", "irecv")
# Everything that moves tensor data between ranks in one call (barrier does not).
COLLECTIVES = tuple(name for name in """all_reduce reduce broadcast all_gather
    all_gather_into_tensor all_gather_single reduce_scatter reduce_scatter_tensor
    reduce_scatter_single all_to_all all_to_all_single gather scatter all_gather_object
    broadcast_object_list gather_object scatter_object_list all_gather_coalesced
    all_reduce_coalesced""".split() if hasattr(c10d, name))
_HOOKED = (*P2P, *COLLECTIVES, "batch_isend_irecv")

_open: list["Log"] = []          # the blocks open now, outermost first
_inside = threading.local()      # depth 1 while a recorded call runs: its inner calls are not
_ids = itertools.count(1)
_installed = {"depth": 0}


class Log:
    """The calls of one ``record()`` block. ``listener`` (optional) is told of each
    call as it starts, is waited for, ends or is dropped unwaited, and (strict
    mode, ``labsupport.launch.strict_p2p``) when an isend/irecv has completed, waited for
    or not: ``listener(event, call, tensor)`` with event "start", "wait", "end",
    "dropped" or "done"."""

    def __init__(self, listener=None):
        self.calls: list[dict] = []
        self.listener = listener
        self.waiting: dict[int, dict] = {}   # id -> isend/irecv not waited for yet

    def tell(self, event, call, tensor=None):
        if self.listener is not None:
            self.listener(event, call, tensor)

    def count(self, kind=None) -> dict:
        """{op: number of calls} (of one ``kind`` if given)."""
        out = {}
        for c in self.calls:
            if kind is None or c["kind"] == kind:
                out[c["op"]] = out.get(c["op"], 0) + 1
        return out

    def bytes_by_group(self) -> dict:
        """{ranks of a group: payload bytes of the collectives called on it}."""
        out = {}
        for c in self.calls:
            if c["kind"] == "collective":
                out[c["ranks"]] = out.get(c["ranks"], 0) + c["nbytes"]
        return out

    def unwaited(self) -> list[dict]:
        """The isend/irecv calls (batched or not) never waited for, in call order."""
        return [self.waiting[i] for i in sorted(self.waiting)]


@contextlib.contextmanager
def record(listener=None):
    """Record this rank's calls to torch.distributed during the block (module docstring)."""
    log = Log(listener)
    with _hooked():
        _open.append(log)
        try:
            yield log
        finally:
            _open.remove(log)


@contextlib.contextmanager
def _hooked():
    """The wrappers, installed by the outermost open block only."""
    if _installed["depth"]:
        _installed["depth"] += 1
        try:
            yield
        finally:
            _installed["depth"] -= 1
        return
    with patched({name: _wrap(name, current(name)) for name in _HOOKED}):
        _installed["depth"] = 1
        try:
            yield
        finally:
            _installed["depth"] = 0


def _wrap(name, fn):
    signature = inspect.signature(fn)

    def recorded(*args, **kwargs):
        if not _open or getattr(_inside, "depth", 0):
            return fn(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs).arguments
        except TypeError:
            return fn(*args, **kwargs)  # torch's own error message for a wrong call
        _inside.depth = 1
        try:
            if name == "batch_isend_irecv":
                return _batch(fn, bound, args, kwargs)
            return _call(name, fn, bound, args, kwargs)
        finally:
            _inside.depth = 0
    recorded.__wrapped__ = fn
    recorded.__name__ = recorded.__qualname__ = fn.__name__
    return recorded


def _call(name, fn, bound, args, kwargs):
    p2p = name in P2P
    group = bound.get("group")
    tensor = bound.get("tensor")
    nonblocking = name in ("isend", "irecv")
    call = _new(name, "p2p" if p2p else "collective", group, bound.values(),
                _peer(name, bound, group) if p2p else None,
                nonblocking or bool(bound.get("async_op")))
    logs = _started(call, tensor)
    result = fn(*args, **kwargs)
    if nonblocking:
        _done_when(result, [(call, logs)])
        return Request(result, [(call, logs)])
    if result is not None and hasattr(result, "get_future"):  # async_op=True
        _end_when_done(result, call, logs)
    else:
        _ended(call, logs)
    return result


def _batch(fn, bound, args, kwargs):
    ops = list(bound["p2p_op_list"])
    batch = next(_ids)
    calls = []
    for op in ops:
        name = getattr(op.op, "__name__", "isend")
        call = _new(name, "p2p", op.group, [op.tensor], op.peer, True)  # op.peer: global
        call["batch"] = batch
        calls.append((call, _started(call, op.tensor)))
    works = fn(*args, **kwargs)
    if len(works) == 1 < len(calls):  # NCCL: one work for the whole coalesced batch
        _done_when(works[0], calls)
        return [Request(works[0], calls)]
    for work, one in zip(works, calls):
        _done_when(work, [one])
    return [Request(work, [one]) for work, one in zip(works, calls)]


def _new(op, kind, group, values, peer, async_op) -> dict:
    sizes, nbytes = [], [0]
    for v in values:
        tensors = v if isinstance(v, (list, tuple)) else [v]
        if tensors and all(isinstance(t, torch.Tensor) for t in tensors):
            sizes.append(sum(t.numel() for t in tensors))
            nbytes.append(sum(t.numel() * t.element_size() for t in tensors))
    ranks = dist.get_process_group_ranks(dist.group.WORLD if group is None else group)
    return dict(op=op, kind=kind, id=next(_ids), batch=None, ranks=tuple(ranks), peer=peer,
                sizes=sizes, nbytes=max(nbytes), async_op=async_op,
                in_backward=torch._C._current_graph_task_id() != -1,
                start=time.perf_counter(), end=None)


def _peer(name, bound, group):
    """The global rank of a send's destination or a receive's source (None: any)."""
    key = "dst" if "send" in name else "src"
    if bound.get(key) is not None:
        return bound[key]
    return _global(group, bound.get("group_" + key))


def _global(group, group_rank):
    if group_rank is None or group is None:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def _started(call, tensor) -> list:
    logs = list(_open)
    for log in logs:
        log.calls.append(call)
        if call["op"] in ("isend", "irecv"):
            log.waiting[call["id"]] = call
        log.tell("start", call, tensor)
    return logs


def _ended(call, logs):
    call["end"] = time.perf_counter()
    for log in logs:
        log.waiting.pop(call["id"], None)
        log.tell("end", call)


def _done_when(work, calls):
    """Tell the logs when a strict-mode request has completed, waited for or not
    (a ``strict_p2p.StrictWork``; other works say nothing until waited for)."""
    if hasattr(work, "on_done"):
        work.on_done(lambda: [log.tell("done", call) for call, logs in calls for log in logs])


def _end_when_done(work, call, logs):
    try:
        work.get_future().then(lambda _: _ended(call, logs))
    except RuntimeError:  # a backend whose works have no future: ended when posted
        _ended(call, logs)


class Request:
    """What a recorded isend/irecv returns: the request itself, with wait() recorded.
    ``calls``: [(call, the logs that recorded it)], one per message it completes."""

    def __init__(self, work, calls):
        self._work, self._calls = work, calls

    def wait(self, *args, **kwargs):
        for call, logs in self._calls:
            for log in logs:
                log.tell("wait", call)
        result = self._work.wait(*args, **kwargs)
        for call, logs in self._calls:
            _ended(call, logs)
        return result

    def is_completed(self):
        completed = self._work.is_completed()
        for call, logs in self._calls:
            if completed and call["end"] is None:  # polling until done is waiting
                _ended(call, logs)
        return completed

    def __getattr__(self, name):  # get_future(), exception(), ...
        return getattr(self._work, name)

    def __del__(self):  # dropped unwaited: gloo may cancel it, its peer then waits forever
        for call, logs in self._calls:
            if call["end"] is None:
                for log in logs:
                    log.tell("dropped", call)
