"""torch's Flight Recorder, read from every rank of a hung run: where their calls part ways.

torch (2.13) keeps, in each process, a ring of the last collectives it issued
(its "Flight Recorder"; on by default for gloo: ``TORCH_FR_BUFFER_SIZE=0``
turns it off; a rank reads the variable when it makes its first group, after
the fork, so the kernel's environment at ``ls.start`` is the one that counts).
``torch._C._distributed_c10d._dump_fr_trace()`` returns it, pickled.

Rank side: ``install(path)`` starts a thread that writes the rank's record to
``path`` whenever the rank gets SIGUSR2. The thread is woken through
``signal.set_wakeup_fd``, so it answers while the rank's main thread is stuck
inside a collective (gloo's wait releases the GIL; a Python signal handler
would run only once the call returned, which it never does).

Kernel side: ``collect`` asks every rank of a stopped run for its record;
``normalise`` turns one rank's record into the plain entries of the
artefacts' "flight_recorder" (chapter 12, assignment 10) (group names, op names
without their backend's prefix, the user's frames innermost last);
``where_they_part`` says, per group, the first sequence number at which the
ranks' calls differ and each rank's call there: the line the launcher adds to
a hang's report (``cluster``).

What gloo's record can and cannot say (torch 2.13, tried): every entry stays
"scheduled" (gloo reports no start or completion events); point-to-point
sends and receives are not recorded at all; under
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` the entries lose their group names and the
wrapper's own fingerprint all-gathers are recorded beside them; and the
dump's ``pg_config`` is keyed ``''`` (with empty ranks) while its entries
name their group ``('0', 'default_pg')``, which is what stops torch's
analyzer ``torchfrtrace`` with ``KeyError``. So the group table travels with
the dump: ``dump`` adds ``groups`` {name: ranks} read from torch.distributed.
"""
import os
import pickle
import signal
import threading
import time

SIGNAL = signal.SIGUSR2
DUMP_WAIT = 2.0   # s: how long the kernel waits for the ranks' records

_torch_frames = (os.sep + "torch" + os.sep, os.sep + "labsupport" + os.sep + "launch" + os.sep,
                 "<frozen ", os.sep + "threading.py", os.sep + "runpy.py")


# -- rank side -------------------------------------------------------------------------

def dump() -> dict:
    """This rank's Flight Recorder record (torch's dict) plus ``groups`` {name: ranks}
    and ``rank``; ``entries`` is empty when the recorder is off."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    record = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    record.setdefault("entries", [])
    groups = {}
    if dist.is_initialized():
        for pg, name in list(c10d._world.pg_names.items()):
            try:
                groups[name] = dist.get_process_group_ranks(pg)
            except Exception:  # a group being destroyed
                continue
        record["rank"] = dist.get_rank()
    record["groups"] = groups
    return record


def write(path: str):
    """``dump()`` pickled into ``path`` (written whole, then renamed: a reader never
    sees half of it)."""
    data = pickle.dumps(dump())
    with open(path + ".part", "wb") as f:
        f.write(data)
    os.replace(path + ".part", path)


def install(path: str):
    """On this rank (its main thread): write the record to ``path`` on every SIGUSR2."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.signal(SIGNAL, lambda *_: None)          # Python's handler: nothing to do
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)

    def serve():
        while True:
            got = os.read(read_end, 64)
            if not got:
                return
            if SIGNAL in got:
                try:
                    write(path)
                except Exception as exc:   # say why in the file the kernel waits for
                    with open(path, "wb") as f:
                        f.write(pickle.dumps({"error": repr(exc), "entries": []}))

    threading.Thread(target=serve, name="labsupport-flight-recorder", daemon=True).start()


# -- kernel side -----------------------------------------------------------------------

def collect(server, paths: dict, wait_s: float = DUMP_WAIT) -> dict:
    """{pid: record or None} for ranks given as {pid: dump file}: signals them through the
    process server and waits up to ``wait_s`` for every file."""
    for path in paths.values():
        _remove(path)
    server.request("signal", list(paths), SIGNAL)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all(map(os.path.exists, paths.values())):
        time.sleep(0.02)
    out = {}
    for pid, path in paths.items():
        try:
            with open(path, "rb") as f:
                out[pid] = pickle.load(f)
        except (OSError, EOFError, pickle.UnpicklingError):
            out[pid] = None
        _remove(path)
    return out


def _remove(path):
    for p in (path, path + ".part"):
        try:
            os.remove(p)
        except FileNotFoundError:
            pass


def group_name(entry: dict) -> str | None:
    """A group's name as the reader knows it: its description ("default_pg", or the
    ``group_desc`` given to ``new_group``), else torch's name for it ("1", "2", ...);
    None for an entry without one (DETAIL's wrapper blanks them)."""
    name, desc = (tuple(entry.get("process_group") or ("", "")) + ("", ""))[:2]
    if desc and desc != "undefined":
        return desc
    return name or None


def normalise(record: dict) -> list[dict]:
    """One rank's record as plain entries, in the order the rank issued them:
    {seq, op, group, group_ranks, shapes, dtypes, state, frames, time_ns} (``time_ns``:
    when it was issued, on the machine's clock). Under DETAIL, whose wrapper blanks the
    groups' names, the default group's entries (``pg_id`` 0) keep their name and the
    others (the wrapper's fingerprint all-gathers, the groups made later) are left out."""
    if not record:
        return []
    names = {}
    for entry in record.get("entries", []):
        name, desc = (tuple(entry.get("process_group") or ("", "")) + ("", ""))[:2]
        if name:
            names[name] = group_name(entry)
    ranks_of = {names.get(n, n): list(r) for n, r in record.get("groups", {}).items()}
    if "0" in record.get("groups", {}):
        ranks_of.setdefault("default_pg", list(record["groups"]["0"]))
    out = []
    for entry in sorted(record.get("entries", []), key=lambda e: e.get("record_id", 0)):
        group = group_name(entry)
        if group is None and entry.get("pg_id") == 0:
            group = "default_pg"     # DETAIL blanks names; the first group made is the default
        if group is None:
            continue
        p2p = bool(entry.get("is_p2p"))
        op = str(entry.get("profiling_name", "")).split(":", 1)[-1]
        out.append(dict(
            seq=int(entry.get("p2p_seq_id" if p2p else "collective_seq_id", 0)),
            op=op, group=group, group_ranks=ranks_of.get(group, []),
            shapes=[list(s) for s in entry.get("input_sizes", [])],
            dtypes=list(entry.get("input_dtypes", [])),
            state=entry.get("state", ""), frames=user_frames(entry.get("frames", [])),
            time_ns=int(entry.get("time_created_ns") or 0)))
    return out


def user_frames(frames) -> list[dict]:
    """The frames of the caller's code, innermost last (torch lists them innermost
    first, with its own and the launcher's frames among them)."""
    keep = [dict(file=f.get("filename", ""), line=int(f.get("line", 0)), name=f.get("name", ""))
            for f in frames if not any(m in f.get("filename", "") for m in _torch_frames)]
    return keep[::-1]


def where_they_part(by_rank: dict) -> list[dict]:
    """For each group whose ranks' calls differ: {group, seq, calls: {rank: call or None}}.

    ``by_rank``: {rank: normalised entries}. Within a group, each rank's entries are
    compared by sequence number; the first number at which some member has no entry
    while another has one, or the members' op, shapes or dtypes differ, is where they
    part. Groups in the order their first difference was issued (the earliest
    ``time_ns`` of the calls there, where entries carry one)."""
    per_group: dict = {}
    for rank, entries in by_rank.items():
        for e in entries:
            per_group.setdefault(e["group"], {}).setdefault(rank, {})[e["seq"]] = e
    found = []
    for group, calls in per_group.items():
        members = _members(group, calls, by_rank)
        seqs = sorted(set().union(*(c.keys() for c in calls.values())))
        for seq in seqs:
            at = {r: calls.get(r, {}).get(seq) for r in members}
            keys = {None if e is None else (e["op"], _key(e["shapes"]), _key(e["dtypes"]))
                    for e in at.values()}
            if len(keys) > 1:
                issued = [e.get("time_ns", 0) for e in at.values() if e is not None]
                found.append(dict(group=group, seq=seq, calls=at, issued=min(issued)))
                break
    found.sort(key=lambda p: p["issued"])
    return [{k: v for k, v in p.items() if k != "issued"} for p in found]


def _members(group, calls, by_rank):
    for entries in by_rank.values():
        for e in entries:
            if e["group"] == group and e["group_ranks"]:
                return sorted(r for r in by_rank if int(r) in e["group_ranks"])
    return sorted(calls)


def _key(value):
    return tuple(tuple(v) if isinstance(v, list) else v for v in value)


def describe(by_rank: dict) -> str:
    """The lines a hang's report gets from the ranks' records ("" when they say nothing):
    where each group's ranks part, each rank's call there and the line that issued it."""
    parts = where_they_part(by_rank)
    if not parts:
        return ""
    lines = ["torch's Flight Recorder (every rank's record of the collectives it issued):"]
    for p in parts:
        lines.append(f"  group {p['group']}: the ranks part at sequence number {p['seq']}")
        for rank, e in p["calls"].items():
            if e is None:
                last = [x for x in by_rank[rank] if x["group"] == p["group"]]
                tail = (f"its last was #{last[-1]['seq']} {last[-1]['op']}" if last
                        else "none in this group")
                lines.append(f"    rank {rank}: issued no #{p['seq']} ({tail})")
            else:
                where = e["frames"][-1] if e["frames"] else None
                at = f" at {os.path.basename(where['file'])}:{where['line']} in {where['name']}" \
                    if where else ""
                lines.append(f"    rank {rank}: {e['op']} shapes={e['shapes']} "
                             f"dtypes={e['dtypes']}{at}")
    return "\n".join(lines)
