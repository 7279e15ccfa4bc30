"""Run a student's function on the ranks with a deadline; turn what went wrong into advice.

    calls = run_on_ranks(rank_fn, args, world_size, timeout, name)   # one result per rank

``rank_fn(log_dir, *args)`` runs on every rank of a gloo group that fits (the
launcher's own rule, ``session.group_for``; gloo even on GPUs, whose blocking
``wait()`` is what lets a deadlock be explained), with the deadline ``timeout``
(default ``TIMEOUT``: $LABSUPPORT_GRADING_TIMEOUT or 20 s, read by
``launch.limits``). The deadline is sized from the work, never from the wall
clock alone (``limits.grading_deadline``, ``launch.progress``): the ranks
are stopped as deadlocked once every one still running has waited
``timeout`` seconds using no CPU time, which load cannot bring about in a run
that computes; a run that computes is stopped only after ``3 * timeout``
seconds of CPU time on one rank (an endless loop), and a last-resort
ceiling of ``30 * timeout`` wall seconds ends anything else. So a slow but
right answer on a loaded class hub is graded, and a deadlock still ends
``timeout`` seconds after its ranks stopped. An exception becomes an
AssertionError with the student's frames only; a deadlock, which message
each stuck rank waited for (recorded by ``labsupport.p2p_log``, explained by
``checking.deadlock``).
A chapter's untouched your-turn stub, ``raise ls.NotWritten(...)`` on every
failing rank, comes back as that NotWritten, so that ``your_turn.check``
says "not written yet" instead of failing.
"""
import os
import re
import shutil
import tempfile
import time

from labsupport import p2p_log
from labsupport.checking.deadlock import explain as explain_deadlock
from labsupport.launch import limits, session
from labsupport.launch.errors import RankError, RankTimeout
from labsupport.your_turn import NotWritten

TIMEOUT = limits.grading_timeout()


def name_of(fn) -> str:
    return getattr(fn, "__name__", None) or "the function"


def run_on_ranks(rank_fn, args, world_size, timeout, name):
    """rank_fn(log_path, *args) on every rank; failures become AssertionErrors."""
    timeout = TIMEOUT if timeout is None else timeout
    deadline = limits.grading_deadline(timeout)
    cluster = session.group_for(world_size, backend="gloo")
    log_dir = tempfile.mkdtemp(prefix="labsupport-grading-")
    try:
        return cluster.run(rank_fn, log_dir, *args, timeout=deadline)
    except RankError as err:
        stub = _not_written(err)
        if stub is not None:
            raise stub from None
        logs = {r: p2p_log.read(log_path(log_dir, r)) for r in range(world_size)}
        raise AssertionError(_explain(err, logs, name, world_size, deadline)) from None
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def _not_written(err: RankError):
    """The NotWritten every failing rank raised (an untouched stub), else None."""
    if isinstance(err, RankTimeout) or not err.ranks:
        return None
    raised = [err.exception(rank) for rank in err.ranks]
    return raised[0] if all(isinstance(e, NotWritten) for e in raised) else None


def log_path(log_dir, rank) -> str:
    return os.path.join(log_dir, f"rank{rank}.jsonl")


def _explain(err: RankError, logs: dict, name: str, world_size: int, deadline) -> str:
    ranks = sorted(err.stacks) if isinstance(err, RankTimeout) else err.ranks
    notes = {p2p_log.rank_state(logs[r])["note"] for r in ranks} - {None}
    during = f" (on {', '.join(sorted(notes))})" if notes else ""
    if not isinstance(err, RankTimeout):
        hint = ("\nWrite your solution in place of `raise NotImplementedError()`."
                if "NotImplementedError" in str(err) else "")
        return f"{name} failed on {world_size} ranks{during}: {_student_frames(str(err))}{hint}"
    where = _student_frames(str(err).split("\n\n", 1)[-1])
    stalled = err.reason == "stall"
    bounds = {"cpu": f"{deadline.cpu:g} s of CPU time",
              "ceiling": f"{deadline.ceiling:g} s"}
    within = bounds.get(err.reason, f"{deadline.stall:g} s")  # a stall: the deadline
    return (f"{name} did not finish within {within} on {world_size} ranks{during}; the "
            "stuck ranks were stopped:\n"
            + explain_deadlock(logs, ranks, time.time(), stalled=stalled)
            + "\n" + _why_stopped(err.reason, deadline)
            + "\nWhere each stopped rank was:\n" + where)


def _why_stopped(reason, deadline) -> str:
    """Why the grader stopped the ranks: a stall is a deadlock, not a slow answer."""
    if reason == "stall":
        return (f"(Stopped after {deadline.stall:g} s in which every rank still "
                "running waited, using no CPU time: nothing could make them "
                "progress. A slow answer is never stopped this way: a rank that "
                "computes is not waiting.)")
    if reason == "cpu":
        return (f"(Stopped once a rank had used {deadline.cpu:g} s of CPU time, far "
                "more than this check needs: a loop that never ends?)")
    return (f"(Stopped at the last-resort limit of {deadline.ceiling:g} s: the ranks "
            "neither finished nor sat waiting.)")


_FRAME = re.compile(r'^  (File "|Cell In)')
_PLUMBING = ('File "labsupport/', 'File "torch/')


def _student_frames(text: str) -> str:
    """A rank's traceback without the frames of labsupport and torch (the student's code stays)."""
    out, skipping = [], False
    for line in text.splitlines():
        if _FRAME.match(line):
            skipping = line.strip().startswith(_PLUMBING)
        elif not line.startswith("    "):
            skipping = False
        if not skipping:
            out.append(line)
    sections = "\n".join(out).split("\n\n")  # one per group of ranks
    return "\n\n".join(part for part in sections if "\n" in part.strip() or
                       not part.strip().startswith("---"))
