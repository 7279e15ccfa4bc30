"""What a failed or slow run left, gathered from every rank into one plain dict (its artefacts).

    from labsupport.debugging import gather, zoo
    art, seconds, error = gather.run_fault(zoo.FAULTS["eval_on_rank_zero"])
    art["flight_recorder"]["0"][-1]      # rank 0's last collective: seq, op, group, frames ...
    gather.named(zoo.FAULTS["eval_on_rank_zero"], art, error)   # what the tooling said, checked

The artefacts follow the contract between chapter 12 and assignment 10
(the table in chapter 12's section on artefacts and in assignment 10's
first cell): ``world_size``,
``timeout_s``, ``flight_recorder`` (each rank's record, normalised by
``launch.flight.normalise``), ``messages`` (what each rank or the launcher
said), ``collective_times`` (enter and exit of each collective, from the
call recorder), ``phase_times``, ``replica_checksums``, ``replica_groups``.
Ranks are strings, so the dict survives JSON.

``named(fault, artefacts, error)`` checks the one report that the fault's
rung of the ladder gives (the launcher's Flight Recorder lines, DETAIL's
fingerprints, gloo's error, the launcher's stacks, the call recorder, the
replicas' checksums) against what the fault is known to be: it does not
classify an unknown run (that is assignment 10's exercise).
"""
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time

from labsupport.debugging import straggler
from labsupport.launch import flight, session
from labsupport.launch.errors import RankError


@contextlib.contextmanager
def environment(**values):
    """Set environment variables for the block (ranks started inside read them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start(world_size, detail=False):
    """A fresh group of ``world_size`` ranks, with TORCH_DISTRIBUTED_DEBUG=DETAIL if asked
    (the ranks read it as they start: ``launch.rank_main``)."""
    with environment(TORCH_DISTRIBUTED_DEBUG="DETAIL" if detail else "OFF"):
        return session.start(world_size=world_size, backend="gloo")


NO_HANG_DEADLINE = 120.0   # s: a fault that ends by itself is never cut short by load


def run_fault(fault, timeout=4.0, cluster=None):
    """Run ``fault`` on a fresh group (or ``cluster``) with a ``timeout`` s deadline if it
    hangs (a fault that ends by itself, slow or raising, gets ``NO_HANG_DEADLINE``).
    Returns (artefacts, seconds from the start of the run to its report, the RankError or
    None)."""
    cluster = cluster or start(fault.world_size, fault.detail)
    deadline = timeout if fault.hangs else max(timeout, NO_HANG_DEADLINE)
    t0 = time.perf_counter()
    try:
        outs, error = cluster.run(fault.fn, timeout=deadline, **fault.kwargs), None
    except RankError as exc:
        outs, error = None, exc
    seconds = time.perf_counter() - t0
    return artefacts(fault.world_size, deadline, outs, error), seconds, error


def artefacts(world_size, timeout, outs=None, error=None) -> dict:
    """The artefacts of one run: from the ranks' results (``outs``, a list by rank) or the
    launcher's error."""
    art = dict(world_size=world_size, timeout_s=float(timeout))
    if error is not None:
        records = getattr(error, "flight_recorder", {}) or {}
        art["flight_recorder"] = {str(r): strip(flight.normalise(rec))
                                  for r, rec in sorted(records.items())}
        art["messages"] = messages(error, world_size)
    for rank, out in enumerate(outs or []):
        if not isinstance(out, dict):
            continue
        if "calls" in out:
            art.setdefault("collective_times", {})[str(rank)] = out["calls"]
        if "phase_times" in out:
            art.setdefault("phase_times", {})[str(rank)] = out["phase_times"]
        if "checksums" in out:
            art.setdefault("replica_checksums", {})[str(rank)] = out["checksums"]
            art["replica_groups"] = [list(range(world_size))]
    return art


def strip(entries):
    """Entries as the contract has them (without the issue time, which the reader
    of a dump cannot compare across machines)."""
    return [{k: v for k, v in e.items() if k != "time_ns"} for e in entries]


def messages(error, world_size) -> dict:
    """{rank: what it raised, how it died, or where the launcher found it stuck}."""
    out = {str(r): "" for r in range(world_size)}
    for rank, failure in error.failures.items():
        out[str(rank)] = failure.get("text") or failure.get("tail") or failure.get("died", "")
    for rank, stack in error.stacks.items():
        out[str(rank)] = "stopped at the deadline, here:\n" + stack
    return out


# -- what the tooling named, checked against the fault ----------------------------------

def named(fault, art, error) -> dict:
    """{named: bool, said: the report's words} for the fault's rung of the ladder."""
    expect, tool = fault.expect, fault.tool
    if "Flight Recorder" in tool:
        return _by_flight_recorder(expect, error)
    if "DETAIL" in tool:
        return _by_text(expect, art, r"Detected mismatch between collectives", error)
    if "gloo's" in tool:
        pattern = r"Timed out waiting" if expect["kind"] == "hang" else r"enforce fail"
        return _by_text(expect, art, pattern, error)
    if "stacks" in tool:
        said = str(error) if error is not None else ""
        stuck = sorted(error.stacks) if error is not None else []
        ok = error is not None and f"in {expect['op']}" in said \
            and (expect["ranks"] is None or stuck == expect["ranks"])
        return dict(named=ok, said=said.split("\n")[0])
    if "call recorder" in tool:
        late = straggler.late_rank(art.get("collective_times", {}))
        return dict(named=[late] == expect["ranks"], said=f"rank {late} waits least")
    if "checksums" in tool:
        step, ranks = first_replica_difference(art)
        return dict(named=(step, ranks) == (expect["step"], expect["ranks"]),
                    said=f"replicas differ from step {step}: ranks {ranks}")
    raise ValueError(f"no reader for the tool {tool!r}")


def _by_flight_recorder(expect, error):
    if error is None or not error.flight_recorder:
        return dict(named=False, said="no Flight Recorder record came back")
    by_rank = {r: flight.normalise(rec) for r, rec in error.flight_recorder.items()}
    parts = flight.where_they_part(by_rank)
    if not parts:
        return dict(named=False, said="the ranks' records agree")
    # The report lists every group where the ranks part, in the order the calls were
    # issued; a loaded machine can reorder calls issued a few milliseconds apart on
    # two ranks, so the fault is named if its parting is anywhere in the list.
    shown = next((p for p in parts if _is_expected(p, expect)), parts[0])
    calls = shown["calls"]
    return dict(named=_is_expected(shown, expect),
                said=f"group {shown['group']} parts at #{shown['seq']}: " + ", ".join(
                    f"rank {r} {(c or {}).get('op') or 'nothing'}" for r, c in calls.items()))


def _is_expected(part, expect) -> bool:
    """The parting in ``expect``'s group where its odd ranks issued its op and
    the others something else (or nothing)."""
    calls, odd = part["calls"], expect["ranks"]
    key = {r: None if c is None else (c["op"], str(c["shapes"]), str(c["dtypes"]))
           for r, c in calls.items()}
    return part["group"] == expect["group"] \
        and all((calls.get(r) or {}).get("op") == expect["op"] for r in odd) \
        and all(key.get(r) != key[o] for r in odd for o in calls if o not in odd)


def _by_text(expect, art, pattern, error):
    said = " | ".join(m for m in art.get("messages", {}).values() if re.search(pattern, m))
    if not said:
        return dict(named=False, said="no message matched " + pattern)
    if expect.get("ranks") and expect["kind"] == "mismatch" and "Rank" in said:
        # DETAIL: "Rank 0 is running collective: ... but Rank 1 is running ..."
        ok = all(f"Rank {r} is running" in said for r in expect["ranks"])
    elif expect.get("ranks"):
        ok = all(re.search(pattern, art["messages"].get(str(r), "")) for r in expect["ranks"])
    else:
        ok = True
    first = said.split("\n")[0]
    return dict(named=ok, said=first[:200])


def first_replica_difference(art, tol=1e-9):
    """(first step whose replicas' checksums differ, the ranks that differ from the rest of
    their replica group) or (None, []). The earliest step over every replica group: a group
    listed later may have parted first."""
    sums = art.get("replica_checksums", {})
    groups = art.get("replica_groups", [])
    steps = max((min(len(sums[str(r)]) for r in group) for group in groups), default=0)
    for k in range(steps):
        odd = []
        for group in groups:
            if k >= min(len(sums[str(r)]) for r in group):
                continue
            values = {r: round(sums[str(r)][k] / tol) for r in group}
            counts = {}
            for v in values.values():
                counts[v] = counts.get(v, 0) + 1
            if len(counts) > 1:
                common = max(counts, key=counts.get)
                odd += [r for r, v in values.items() if v != common]
        if odd:
            return k, sorted(odd)
    return None, []


# -- torch's analyzer, on the ranks' dumps -----------------------------------------------

def torchfrtrace(records: dict, repair=False, extra_args=()) -> subprocess.CompletedProcess:
    """Write each rank's raw record where torch's analyzer looks for them
    (``<folder>/rank_<n>``, pickled) and run ``torchfrtrace <folder>``; returns the
    finished process (its stdout, stderr and return code).

    torch 2.13's gloo dumps key ``pg_config`` by ``''`` with no ranks, while their
    entries name groups ``('0', 'default_pg')``: the analyzer stops with ``KeyError``.
    ``repair=True`` rebuilds ``pg_config`` from the entries' names and the group table
    that ``launch.flight.dump`` adds, the way an NCCL dump has it."""
    import pickle
    folder = tempfile.mkdtemp(prefix="fr-")
    for rank, rec in records.items():
        rec = {k: v for k, v in rec.items() if k not in ("groups", "rank")}
        if repair:
            rec["pg_config"] = pg_config(records[rank])
        with open(os.path.join(folder, f"rank_{rank}"), "wb") as f:
            pickle.dump(rec, f)
    exe = os.path.join(os.path.dirname(sys.executable), "torchfrtrace")
    cmd = [exe if os.path.exists(exe) else "torchfrtrace", folder, "--prefix", "rank_",
           *extra_args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def pg_config(record: dict) -> dict:
    """{group name: {name, desc, ranks}} as the analyzer expects it, from the record's
    entries and its group table."""
    out = {}
    for entry in record.get("entries", []):
        name, desc = (tuple(entry.get("process_group") or ("", "")) + ("", ""))[:2]
        if name and name in record.get("groups", {}):
            out[name] = dict(name=name, desc=desc, ranks=str(record["groups"][name]))
    return out
