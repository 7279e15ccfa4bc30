"""A group of ranks that runs functions sent from the notebook.

    results = cluster.run(fn, x, y=2)         # fn(x, y=2) on every rank; a list by rank

Every run has a deadline. A rank that raises, dies or hangs ends the run with
one ``RankError`` that names the ranks and shows their tracebacks (or, for a
stuck rank, where it was). Ranks that were still running are stopped and a
fresh group is started in the background, so the next call works. The
deadline is the only one: the ranks' collectives outwait any (see ``limits``).
It is a number of seconds on the wall clock, or a ``progress.WorkDeadline``
(the graders'): a run stopped when its ranks all sit idle, or one has used
its CPU time, which load cannot bring about in a run that works.
"""
import contextlib
import itertools
import os
import pickle
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from labsupport.launch import flight, forkserver, progress
from labsupport.launch.errors import RankError, build_error, format_stack_dump
from labsupport.launch.lifetime import describe_status
from labsupport.launch.limits import (
    DEFAULT_TIMEOUT,
    GRACE,
    START_TIMEOUT,
    TAIL_CHARS,
    check_timeout,
)
from labsupport.launch.output import RankOutput, show
from labsupport.launch.placement import NCCL_ENV, Placement

_numbers = itertools.count(1)


@dataclass
class _Rank:
    rank: int
    pid: int
    conn: Connection
    output: RankOutput
    stack_path: str
    store_path: str
    fr_path: str


@dataclass
class _Outcome:
    results: dict = field(default_factory=dict)    # rank -> pickled value
    failures: dict = field(default_factory=dict)   # rank -> exception description
    running: list = field(default_factory=list)    # ranks that never answered
    stacks: dict = field(default_factory=dict)     # rank -> where a stopped rank was
    flight: dict = field(default_factory=dict)     # rank -> its Flight Recorder record
    reason: str = "deadline"  # why the running ranks were stopped (progress.Watch's)
    watch: progress.Watch | None = None


class Cluster:
    """A persistent group of ranks with an initialised process group (made by ``ls.start``,
    which checks ``placement`` and ``timeout``, the deadline of each run)."""

    def __init__(self, placement: Placement, timeout: float = DEFAULT_TIMEOUT):
        self.placement = placement
        self.world_size = placement.world_size
        self.backend = placement.backend
        self.timeout = timeout
        self._number = next(_numbers)  # unique in this kernel: names its files
        self._generation = 0
        self._ranks: list[_Rank] | None = None
        self._ready = False
        self._closed = False
        self._lock = threading.Lock()
        self._respawn = False  # a failed start leaves nothing behind
        try:
            self._spawn()
            self._wait_ready(START_TIMEOUT)
        except BaseException:
            self.shutdown()
            raise
        self._respawn = True

    def __repr__(self):
        state = "shut down" if self._closed else "ready" if self._ready else "starting"
        return f"<Cluster world_size={self.world_size} backend={self.backend!r} {state}>"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    @property
    def generation(self) -> int:
        """Counts the groups of ranks started so far (a restart makes a new one)."""
        return self._generation

    @property
    def pids(self) -> list[int]:
        """Process IDs of the ranks, by rank (empty while no group is running)."""
        return [r.pid for r in self._ranks or []]

    def run(self, fn, *args, timeout: float | None = None, stream: bool = False, **kwargs) -> list:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results as a list by rank.

        ``timeout`` (seconds, or a ``progress.WorkDeadline``) overrides the group's
        deadline for this call;
        ``stream=True`` shows output lines as they arrive instead of at the end.
        Tensors come back detached, on the CPU.
        """
        if not callable(fn):
            raise TypeError("run() needs a function to call on every rank, got "
                            f"{type(fn).__name__}")
        return self._round_trip(("run", _serialize(fn, args, kwargs)), timeout, stream)

    def exec_cell(self, source: str, filename: str, timeout=None, stream=False) -> list:
        """Run cell source on every rank in its persistent namespace (the %%ranks magic)."""
        return self._round_trip(("exec", (source, filename)), timeout, stream)

    def restart(self):
        """Replace the ranks with fresh ones (their namespaces are lost)."""
        self._check_open()
        self._stop_ranks()
        self._spawn()
        self._wait_ready(START_TIMEOUT)

    def shutdown(self):
        """Stop the ranks. Safe to call twice; the object cannot be used afterwards."""
        if self._closed:
            return
        self._closed = True
        self._stop_ranks()

    # -- one request to every rank ---------------------------------------------------

    def _round_trip(self, request, timeout, stream):
        self._check_open()
        watched = isinstance(timeout, progress.WorkDeadline)
        if watched:
            for seconds in (timeout.stall, timeout.cpu, timeout.ceiling):
                check_timeout(seconds)
        timeout = self.timeout if timeout is None else \
            timeout if watched else check_timeout(timeout)
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("another run is still in progress on this group")
        try:
            if self._ranks is None:
                self._spawn()
            if not self._ready:
                self._wait_ready(START_TIMEOUT)
            ranks, data = self._ranks, pickle.dumps(request)
            for r in ranks:
                try:
                    r.conn.send_bytes(data)
                except OSError:
                    pass  # a dead rank: its closed connection is reported below
            watch = progress.Watch([r.pid for r in ranks], timeout) if watched else None
            end = time.monotonic() + (timeout.ceiling if watched else timeout)
            outcome = self._collect_or_abort(end, stream, watch)
            show([r.output for r in ranks])  # (after an abort, already shown)
            self._raise_for(outcome, _deadline_text(timeout, outcome))
            return [_load_result(rank, outcome.results[rank]) for rank in range(self.world_size)]
        finally:
            self._lock.release()

    def _collect_or_abort(self, deadline, stream, watch=None) -> _Outcome:
        try:
            outcome = self._collect(deadline, stream, watch)
        except BaseException:  # KeyboardInterrupt: stop the ranks, keep the kernel usable
            n = len(self._ranks or [])
            self._abort(_Outcome())
            sys.stderr.write(f"labsupport: interrupted; stopped all {n} ranks\n")
            raise
        # After any failure the group is replaced: a rank may have sent a message
        # nobody received, or posted a receive that would swallow the next run's.
        if outcome.running or outcome.failures:
            self._abort(outcome)
        return outcome

    def _collect(self, deadline, stream, watch=None) -> _Outcome:
        """Wait for every rank's answer, a failure (plus a grace period), or the
        deadline (with a ``watch``: or its verdict that the ranks still running must
        stop)."""
        pending = {r.conn: r for r in self._ranks}
        outcome, failed_at = _Outcome(watch=watch), None
        while pending:
            end = deadline if failed_at is None else min(deadline, failed_at + GRACE)
            left = end - time.monotonic()
            if left <= 0:
                if watch is not None and failed_at is None:
                    outcome.reason = "ceiling"
                break
            if watch is not None and failed_at is None:
                reason = watch.check([r.pid for r in pending.values()])
                if reason is not None:
                    outcome.reason = reason
                    break
            poll = stream or watch is not None
            ready = wait(list(pending),
                         timeout=min(left, progress.POLL) if poll else left)
            for conn in ready:
                r = pending.pop(conn)
                kind, body = self._receive(r)
                if kind in ("ok", "ready"):
                    outcome.results[r.rank] = body
                else:
                    outcome.failures[r.rank] = body
                    failed_at = failed_at or time.monotonic()
            if stream:
                show([r.output for r in self._ranks], complete_lines_only=True)
        outcome.running = sorted(r.rank for r in pending.values())
        return outcome

    def _receive(self, r: _Rank):
        try:
            return pickle.loads(r.conn.recv_bytes())
        except (EOFError, OSError):
            status = forkserver.get().exit_status(r.pid)
            return "died", {"died": describe_status(status),
                            "tail": r.output.take("stderr")[-TAIL_CHARS:]}

    def _raise_for(self, outcome: _Outcome, deadline_text: str):
        if outcome.failures or outcome.running:
            records = {rank: flight.normalise(rec) for rank, rec in outcome.flight.items()}
            error = build_error(outcome.failures, outcome.running, outcome.stacks,
                                deadline_text, restarting=self._ranks is not None,
                                extra=flight.describe(records))
            error.reason = outcome.reason if outcome.running else None
            error.flight_recorder = outcome.flight   # {rank: torch's record}, raw
            raise error from None

    # -- starting and stopping ranks -------------------------------------------------

    def _spawn(self):
        server = forkserver.get()
        self._generation += 1
        specs = [self._spec(server.dir, rank) for rank in range(self.world_size)]
        pairs = [socket.socketpair() for _ in specs]
        try:
            pids = server.request("spawn", specs, fds=[theirs.fileno() for _, theirs in pairs])[1]
        finally:
            for _, theirs in pairs:
                theirs.close()
        self._ranks = [
            _Rank(rank, pid, Connection(ours.detach()),
                  RankOutput(rank, spec["out_path"], spec["err_path"]), spec["stack_path"],
                  spec["store_path"], spec["fr_path"])
            for rank, (pid, (ours, _), spec) in enumerate(zip(pids, pairs, specs))]
        self._ready = False

    def _spec(self, directory, rank) -> dict:
        prefix = os.path.join(directory, f"c{self._number}-g{self._generation}")
        env = dict({**NCCL_ENV, **os.environ},  # NCCL's defaults unless set
                   RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
                   WORLD_SIZE=str(self.world_size), LOCAL_WORLD_SIZE=str(self.world_size),
                   OMP_NUM_THREADS=str(self.placement.threads))
        # Gloo's and NCCL's own sockets on the loopback interface only.
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        return dict(rank=rank, world_size=self.world_size, backend=self.backend,
                    device=self.placement.devices[rank], threads=self.placement.threads,
                    env=env, sys_path=list(_sys_path()), cwd=os.getcwd(),
                    store_path=prefix + ".store",
                    out_path=f"{prefix}.r{rank}.out", err_path=f"{prefix}.r{rank}.err",
                    stack_path=f"{prefix}.r{rank}.stack", fr_path=f"{prefix}.r{rank}.fr")

    def _wait_ready(self, timeout):
        outcome = self._collect_or_abort(time.monotonic() + timeout, stream=False)
        show([r.output for r in self._ranks or []])
        self._raise_for(outcome, f"the {timeout:g} s start-up deadline")
        self._ready = True

    def _abort(self, outcome: _Outcome):
        """Stop every rank of this generation, noting first where the stuck ones were."""
        if outcome.running:
            stuck = [r for r in self._ranks if r.rank in outcome.running]
            dumps = forkserver.get().dump_stacks({r.pid: r.stack_path for r in stuck})
            outcome.stacks = {r.rank: format_stack_dump(dumps[r.pid]) for r in stuck}
            # every rank's record, the finished ones' too: where their calls part
            records = flight.collect(forkserver.get(), {r.pid: r.fr_path for r in self._ranks})
            outcome.flight = {r.rank: records[r.pid] for r in self._ranks
                              if records.get(r.pid) is not None}
        self._stop_ranks()
        if self._respawn and not self._closed:
            try:
                self._spawn()  # in the background: the next call finds it (nearly) ready
            except Exception:
                self._ranks = None  # the next call retries, with a clear error if it fails

    def _stop_ranks(self):
        """Kill this generation's ranks, show what they printed last, remove their files."""
        ranks, self._ranks, self._ready = self._ranks, None, False
        if not ranks:
            return
        server = forkserver.current()
        if server is not None:  # (without a server, its ranks died with it)
            try:
                server.request("kill", [r.pid for r in ranks])
            except forkserver.ProcessServerError:
                pass
        show([r.output for r in ranks])
        for r in ranks:
            r.conn.close()
            r.output.remove()
            for path in (r.stack_path, r.store_path, r.fr_path):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)

    def _check_open(self):
        if self._closed:
            raise RuntimeError(
                "this group of ranks was shut down (by shutdown(), the end of a `with` block, or "
                "a newer ls.start()). Use the group returned by the latest ls.start(), or "
                "ls.run(fn, world_size=...), which starts one.")


def _deadline_text(timeout, outcome: _Outcome) -> str:
    """What stopped the ranks still running, for the error's first line."""
    watch = outcome.watch
    if watch is None:
        return f"the run's {timeout:g} s deadline"
    if outcome.reason == "stall":
        return (f"the end of {watch.stalled_for:.0f} s in which they all waited, using "
                f"no CPU time (the limit: {timeout.stall:g} s)")
    if outcome.reason == "cpu":
        return (f"their {timeout.cpu:g} s of CPU time (one rank used "
                f"{watch.cpu_used:.1f} s)")
    return f"the run's {timeout.ceiling:g} s ceiling"


def _serialize(fn, args, kwargs) -> bytes:
    import cloudpickle
    try:
        return cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(
            f"cannot send {getattr(fn, '__name__', fn)!r} or its arguments to the ranks: {exc}. "
            "Everything a run uses must be picklable: pass tensors, numbers and plain "
            "containers, and create open files, locks, generators or process groups inside "
            "the function instead of capturing them.") from exc


def _load_result(rank, data):
    import cloudpickle
    try:
        return cloudpickle.loads(data)
    except Exception as exc:
        raise RankError(f"rank {rank}'s return value cannot be rebuilt in the notebook: "
                        f"{exc}") from exc


def _sys_path():
    return [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
