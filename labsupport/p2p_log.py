"""Record, on one rank, the messages it sends and waits for, in a file that outlives it.

    with p2p_log.record(path, buffer=tensor) as rec:   # on a rank
        student_ring(tensor)
    rec.collectives, rec.unwaited()   # {"all_reduce": 1}, isend/irecv never waited for
    p2p_log.rank_state(p2p_log.read(path))    # in the kernel, once the rank was stopped

Why a file: a rank stuck in ``recv`` is stopped by the launcher at its
deadline, and whatever it held in memory is lost with it. Each call is
written (unbuffered, appended) before it starts and again when it ends, so
the kernel can still say which message a stopped rank was waiting for,
"rank 1 waited for rank 0's chunk 2" (``labsupport.grading.deadlock``). Calls are
recorded where torch.distributed is called through its module
(``dist.recv(...)``), the way ``labsupport.traffic`` counts bytes. Under
``LABSUPPORT_P2P=strict`` (``labsupport.strict_p2p``) each operation's
completion is logged too ("done"), so the kernel can tell which earlier
operation a stopped rank's call was queued behind.
"""
import contextlib
import inspect
import json
import os
import threading
import time

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from labsupport import strict_p2p
from labsupport._patch import current, patched

P2P = ("send", "recv", "isend", "irecv")
# Everything that moves tensor data between ranks in one call (barrier does not).
COLLECTIVES = tuple(name for name in """all_reduce reduce broadcast all_gather
    all_gather_into_tensor all_gather_single reduce_scatter reduce_scatter_tensor
    reduce_scatter_single all_to_all all_to_all_single gather scatter all_gather_object
    broadcast_object_list gather_object scatter_object_list all_gather_coalesced
    all_reduce_coalesced""".split() if hasattr(c10d, name))
_active = threading.local()  # inside a recorded call: the calls it makes are not recorded


def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of ``tensor.tensor_split(world_size)``."""
    q, m = divmod(numel, world_size)
    starts = [i * q + min(i, m) for i in range(world_size + 1)]
    return list(zip(starts[:-1], starts[1:]))


def call_text(op: str, what: str, peer) -> str:
    """'dist.irecv of chunk 2 from rank 0'."""
    where = "any rank" if peer is None else f"rank {peer}"
    return f"dist.{op} of {what} {'to' if 'send' in op else 'from'} {where}"


def describe_tensor(tensor, buffer, world_size: int) -> str:
    """'chunk 2' when the tensor is a chunk of ``buffer``, else what it is."""
    n = tensor.numel()
    if buffer is None:
        return f"a {n}-element tensor"
    if tensor.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
        return f"a separate {n}-element tensor"
    start = tensor.storage_offset() - buffer.storage_offset()
    bounds = chunk_bounds(buffer.numel(), world_size)
    if (start, start + n) in bounds:
        return f"chunk {bounds.index((start, start + n))}"
    return f"elements {start}:{start + n} of the tensor"


class Recorder:
    """The calls of one ``record()`` block on this rank (see the module docstring)."""

    def __init__(self, path: str, buffer=None):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.buffer = buffer
        self.collectives: dict[str, int] = {}
        self.open: dict[int, str] = {}   # id of an isend/irecv not waited for -> what it was
        self.peers = {"send": set(), "recv": set()}  # the ranks sent to and received from
        self._next_id = 0
        self.closed = False

    def log(self, **event):
        if self.closed:  # a request waited for after its block: nothing left to explain
            return
        event["t"] = time.time()  # wall clock: the kernel compares it with its own
        os.write(self.fd, (json.dumps(event) + "\n").encode())

    def note(self, text: str):
        """What the rank works on ('a tensor of 10 elements'), for the reports."""
        self.log(ev="note", text=text)

    def new_call(self, op: str, peer=None, tensor=None, **extra) -> tuple[int, str]:
        """Log the start of a call; its id and what it moves ('chunk 2')."""
        self._next_id += 1
        if op in P2P and peer is not None:
            self.peers["send" if "send" in op else "recv"].add(peer)
        what = "" if tensor is None else describe_tensor(tensor, self.buffer,
                                                          dist.get_world_size())
        self.log(ev="start", id=self._next_id, op=op, peer=peer, what=what, **extra)
        return self._next_id, what

    def done_when(self, work, call_id: int):
        """Log when a strict-mode request completes, waited for or not."""
        if hasattr(work, "on_done"):  # a strict_p2p.StrictWork
            work.on_done(lambda: self.log(ev="done", id=call_id))

    def unwaited(self) -> list[str]:
        """Descriptions of the isend/irecv requests never waited for, in call order."""
        return [self.open[i] for i in sorted(self.open)]

    def close(self):
        self.closed = True
        os.close(self.fd)


class Request:
    """What a recorded isend/irecv returns: the request itself, with wait() logged."""

    def __init__(self, work, recorder: Recorder, call_id: int):
        self._work, self._rec, self._id = work, recorder, call_id

    def wait(self, *args, **kwargs):
        self._rec.log(ev="wait", id=self._id)
        result = self._work.wait(*args, **kwargs)
        self._rec.log(ev="end", id=self._id)
        self._rec.open.pop(self._id, None)
        return result

    def is_completed(self):
        completed = self._work.is_completed()
        if completed:  # polling until done is as good as waiting
            self._rec.open.pop(self._id, None)
        return completed

    def __getattr__(self, name):  # get_future(), exception(), ...
        return getattr(self._work, name)

    def __del__(self):  # dropped unwaited: gloo may cancel it, its peer then waits forever
        if self._id in self._rec.open:
            self._rec.log(ev="dropped", id=self._id)


@contextlib.contextmanager
def record(path: str, buffer=None):
    """Record this rank's point-to-point and collective calls in the block to ``path``."""
    rec = Recorder(path, buffer)
    rec.log(ev="begin", strict=strict_p2p.active())
    names = (*P2P, *COLLECTIVES, "batch_isend_irecv")
    try:
        with patched({name: _wrap(name, current(name), rec) for name in names}):
            yield rec
    finally:
        rec.log(ev="exit")
        rec.close()


def _wrap(name, fn, rec: Recorder):
    kind = "batch" if name == "batch_isend_irecv" else "p2p" if name in P2P else "collective"
    signature = inspect.signature(fn)

    def recorded(*args, **kwargs):
        if getattr(_active, "depth", 0):
            return fn(*args, **kwargs)
        _active.depth = 1
        try:
            if kind == "collective":
                return _collective(name, fn, rec, args, kwargs)
            if kind == "batch":
                return _batch(fn, rec, args, kwargs)
            return _p2p(name, fn, signature, rec, args, kwargs)
        finally:
            _active.depth = 0
    recorded.__wrapped__ = fn
    recorded.__name__ = recorded.__qualname__ = fn.__name__
    return recorded


def _collective(name, fn, rec: Recorder, args, kwargs):
    rec.collectives[name] = rec.collectives.get(name, 0) + 1
    call_id, _ = rec.new_call(name)
    result = fn(*args, **kwargs)
    rec.log(ev="end", id=call_id)  # (an async_op=True collective: "ended" when posted)
    return result


def _p2p(name, fn, signature, rec: Recorder, args, kwargs):
    try:
        bound = signature.bind(*args, **kwargs).arguments
    except TypeError:
        return fn(*args, **kwargs)  # torch's own error message for a wrong call
    peer_key = "dst" if "send" in name else "src"
    peer = bound.get(peer_key, bound.get("group_" + peer_key))
    call_id, what = rec.new_call(name, peer, bound["tensor"])
    result = fn(*args, **kwargs)
    if name in ("send", "recv"):
        rec.log(ev="end", id=call_id)
        return result
    rec.open[call_id] = call_text(name, what, peer)
    rec.done_when(result, call_id)
    return Request(result, rec, call_id)


def _batch(fn, rec: Recorder, args, kwargs):
    ops = args[0] if args else kwargs["p2p_op_list"]
    works = fn(*args, **kwargs)
    requests, first = [], rec._next_id + 1
    for op, work in zip(ops, works):
        name = getattr(op.op, "__name__", "isend")
        call_id, what = rec.new_call(name, op.peer, op.tensor, batch=first)
        rec.open[call_id] = "batched " + call_text(name, what, op.peer)
        rec.done_when(work, call_id)
        requests.append(Request(work, rec, call_id))
    return requests


# -- read in the kernel ---------------------------------------------------------------

def read(path: str) -> list[dict]:
    """The events a rank logged (a last line cut off by a kill is skipped)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.endswith("}")]


def rank_state(events: list[dict]) -> dict:
    """What a stopped rank was doing in its last recorded block: ``state`` is
    'blocked' (in ``call``, since ``since``), 'returned' or 'running' (Python
    code, no message awaited); ``unwaited``: its requests nobody waited for
    (when it returned), or that it dropped without waiting (at any time);
    ``behind``: under strict mode, the earlier operation, not yet complete,
    that the blocked call was queued behind (else None), and ``queued``: the
    later ones, which could not start before the blocked call completed."""
    started, pending, waited, dropped, exited, note = {}, {}, set(), set(), False, None
    done, strict = set(), False
    for e in events:
        ev = e["ev"]
        if ev == "begin":
            started, pending, waited, dropped, exited = {}, {}, set(), set(), False
            done, strict = set(), e.get("strict", False)
        elif ev == "done":
            done.add(e["id"])
        elif ev == "start":
            started[e["id"]] = e
            if e["op"] not in ("isend", "irecv"):  # those return at once; wait() blocks
                pending[e["id"]] = e["t"]
        elif ev == "wait":
            waited.add(e["id"])
            pending[e["id"]] = e["t"]
        elif ev == "end":
            waited.add(e["id"])
            pending.pop(e["id"], None)
        elif ev == "dropped":
            dropped.add(e["id"])
        elif ev == "note":
            note = e["text"]
        exited = exited or ev == "exit"
    unwaited = [call_text(c["op"], c["what"], c["peer"]) for i, c in started.items()
                if c["op"] in ("isend", "irecv") and i not in waited
                and (exited or i in dropped)]
    state = dict(state="returned" if exited else "running", call=None, since=None,
                 unwaited=unwaited, note=note, behind=None, queued=[])
    if pending and not exited:
        call_id = max(pending, key=pending.get)
        state.update(state="blocked", call=started[call_id], since=pending[call_id])
        if strict:  # NCCL's order: nothing starts before the earlier calls complete
            incomplete = [i for i, c in sorted(started.items()) if c["op"] in P2P
                          and i not in done and (i not in waited or i in pending)]
            earlier = [i for i in incomplete if i < call_id]
            state.update(behind=started[earlier[0]] if earlier else None,
                         queued=[started[i] for i in incomplete if i > call_id])
    return state
