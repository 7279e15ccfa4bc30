"""Record, on one rank, the messages it sends and waits for, in a file that outlives it.

    with p2p_log.record(path, buffer=tensor) as rec:   # on a rank
        student_ring(tensor)
    rec.collectives, rec.unwaited()   # {"all_reduce": 1}, isend/irecv never waited for
    p2p_log.rank_state(p2p_log.read(path))    # in the kernel, once the rank was stopped

Why a file: a rank stuck in ``recv`` is stopped by the launcher at its
deadline, and whatever it held in memory is lost with it. Each call is
written (unbuffered, appended) before it starts and again when it ends, so
the kernel can still say which message a stopped rank was waiting for,
"rank 1 waited for rank 0's chunk 2" (``labsupport.checking.deadlock``). The
calls are those of ``labsupport.calls``, the one recorder of a rank's calls
to torch.distributed; this module is its listener that writes them down.
Under ``LABSUPPORT_P2P=strict`` (``labsupport.launch.strict_p2p``) each operation's
completion is written too ("done"), so the kernel can tell which earlier
operation a stopped rank's call was queued behind.
"""
import contextlib
import json
import os
import threading
import time

import torch.distributed as dist

from labsupport import calls
from labsupport.calls import COLLECTIVES, P2P  # noqa: F401 (what checking.deadlock names)
from labsupport.launch import strict_p2p


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
    """The calls of one ``record()`` block on this rank, written to ``path`` as they go."""

    def __init__(self, path: str, buffer=None):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.buffer = buffer
        self.log = calls.Log()
        self.closed = False
        # strict mode completes requests on its own thread: it may write while the
        # block closes the file, so writing and closing take turns
        self.lock = threading.Lock()

    def write(self, **event):
        event["t"] = time.time()  # wall clock: the kernel compares it with its own
        with self.lock:
            if self.closed:  # a request finished after its block: nothing left to explain
                return
            os.write(self.fd, (json.dumps(event) + "\n").encode())

    def note(self, text: str):
        """What the rank works on ('a tensor of 10 elements'), for the reports."""
        self.write(ev="note", text=text)

    def __call__(self, event, call, tensor=None):
        """calls.record's listener: each call's start, wait, end, completion (strict
        mode) or drop, written down."""
        if event != "start":
            self.write(ev=event, id=call["id"])
            return
        if call["kind"] == "p2p" and tensor is not None:
            call["what"] = describe_tensor(tensor, self.buffer, dist.get_world_size())
        extra = {} if call["batch"] is None else {"batch": call["batch"]}
        self.write(ev="start", id=call["id"], op=call["op"], peer=call["peer"],
                   what=call.get("what", ""), ranks=call["ranks"], **extra)

    @property
    def collectives(self) -> dict:
        """{collective: calls} made in the block."""
        return self.log.count("collective")

    @property
    def peers(self) -> dict:
        """{"send": ranks sent to, "recv": ranks received from} with point-to-point calls."""
        out = {"send": set(), "recv": set()}
        for c in self.log.calls:
            if c["kind"] == "p2p" and c["peer"] is not None:
                out["send" if "send" in c["op"] else "recv"].add(c["peer"])
        return out

    def unwaited(self) -> list[str]:
        """Descriptions of the isend/irecv requests never waited for, in call order."""
        return [("batched " if c["batch"] else "") + call_text(c["op"], c.get("what", ""),
                                                               c["peer"])
                for c in self.log.unwaited()]

    def close(self):
        with self.lock:
            self.closed = True
            os.close(self.fd)


@contextlib.contextmanager
def record(path: str, buffer=None):
    """Record this rank's point-to-point and collective calls in the block to ``path``."""
    rec = Recorder(path, buffer)
    rec.write(ev="begin", strict=strict_p2p.active())
    try:
        with calls.record(rec) as log:
            rec.log = log
            yield rec
    finally:
        rec.write(ev="exit")
        rec.close()


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
