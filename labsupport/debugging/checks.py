"""Checks of chapter 12's your-turn cells (labsupport.your_turn runs them).

- ``check_lateness(fn, collective_times)``: the reader's ``lateness(collective_times)``,
  {rank: seconds the others waited for this rank}, on the chapter's straggler run and
  on made-up timings, each usual slip named (the time inside read as lateness, the
  mean taken for the first arrival, calls of different collectives compared);
- ``check_parting_lines(fn, flight_recorder)``: the reader's
  ``parting_lines(flight_recorder)``, {rank: "file:line" of the call it issued where
  the ranks part, or None}, on a run's real records and on made-up ones, each slip
  named (the outermost frame, each rank's last entry, the first entry of the group).
"""
import math
import os

from labsupport.launch import flight


def _lateness(collective_times):
    """The reference: per shared collective, a rank's enter minus the first enter."""
    firsts = {}
    for calls in collective_times.values():
        for c in calls:
            key = (c["group"], c["seq"])
            firsts[key] = min(firsts.get(key, math.inf), c["enter"])
    return {r: sum(c["enter"] - firsts[(c["group"], c["seq"])] for c in calls)
            for r, calls in collective_times.items()}


def _made_up_times():
    """Four ranks, rank 3 late by 0.3 s in every call; the ranks' calls listed in different
    orders and the groups' sequence numbers overlapping (two groups)."""
    times = {str(r): [] for r in range(4)}
    for seq in range(1, 4):
        t = 10.0 * seq
        for r in range(4):
            late = 0.3 if r == 3 else 0.01 * r
            times[str(r)].append(dict(seq=seq, op="all_reduce", group="default_pg",
                                      enter=t + late, exit=t + 0.5))
        for r in (0, 1):     # a second group with the same sequence numbers, earlier clock
            times[str(r)].append(dict(seq=seq, op="broadcast", group="pair",
                                      enter=t - 5 + 0.2 * r, exit=t - 4.5))
    times["2"].reverse()
    return times


def _slips(collective_times):
    waits = {r: sum(c["exit"] - c["enter"] for c in calls)
             for r, calls in collective_times.items()}
    mean_based = {}
    sums, counts = {}, {}
    for calls in collective_times.values():
        for c in calls:
            key = (c["group"], c["seq"])
            sums[key] = sums.get(key, 0.0) + c["enter"]
            counts[key] = counts.get(key, 0) + 1
    for r, calls in collective_times.items():
        mean_based[r] = sum(c["enter"] - sums[(c["group"], c["seq"])] / counts[(c["group"],
                            c["seq"])] for c in calls)
    by_position = {}
    for r, calls in collective_times.items():
        total = 0.0
        for i, c in enumerate(calls):
            first = min(other[i]["enter"] for other in collective_times.values()
                        if i < len(other))
            total += c["enter"] - first
        by_position[r] = total
    return {
        "that is each rank's time inside the collectives (exit - enter): the late rank "
        "has the least of it; lateness is how much later than the first rank it entered":
            waits,
        "measured from the mean arrival: lateness is counted from the first rank to enter "
        "the same collective (who waited for whom), so no rank is negative": mean_based,
        "calls compared by their position in each rank's list: match a collective across "
        "ranks by its (group, seq), since ranks list their calls in their own order and "
        "groups number their calls separately": by_position,
    }


def check_lateness(fn, collective_times):
    for name, times in (("the chapter's straggler run", collective_times),
                        ("made-up timings (two groups, lists in different orders)",
                         _made_up_times())):
        got = fn(times)
        want = _lateness(times)
        if not isinstance(got, dict) or set(map(str, got)) != set(want):
            raise AssertionError(f"lateness on {name} should return {{rank: seconds}} for "
                                 f"ranks {sorted(want)}, got {got!r}")
        got = {str(r): float(v) for r, v in got.items()}
        if all(math.isclose(got[r], want[r], rel_tol=1e-6, abs_tol=1e-9) for r in want):
            continue
        for slip, value in _slips(times).items():
            if all(math.isclose(got[r], value[r], rel_tol=1e-6, abs_tol=1e-9) for r in want):
                raise AssertionError(f"lateness on {name}: {slip}")
        worst = max(want, key=lambda r: abs(got[r] - want[r]))
        raise AssertionError(f"lateness on {name}: rank {worst} got {got[worst]:.6f} s, "
                             f"expected {want[worst]:.6f} s")
    return True


def _where(entry):
    if entry is None or not entry["frames"]:
        return None
    f = entry["frames"][-1]
    return f"{os.path.basename(f['file'])}:{f['line']}"


def _parting_lines(records):
    parts = flight.where_they_part({r: e for r, e in records.items()})
    if not parts:
        return {}
    return {str(r): _where(e) for r, e in parts[0]["calls"].items()}


def _entry(seq, op, line, group="default_pg", shape=(4,), outer=("train.py", 7)):
    return dict(seq=seq, op=op, group=group, group_ranks=[0, 1, 2], shapes=[list(shape)],
                dtypes=["Float"], state="scheduled",
                frames=[dict(file=outer[0], line=outer[1], name="main"),
                        dict(file="model.py", line=line, name="step")])


def _made_up_records():
    """Rank 2 issues an extra broadcast at #3 from line 40; afterwards every rank goes on."""
    recs = {}
    for r in range(3):
        entries = [_entry(1, "all_reduce", 10), _entry(2, "all_reduce", 10)]
        if r == 2:
            entries.append(_entry(3, "broadcast", 40))
            entries.append(_entry(4, "all_reduce", 10))
        else:
            entries.append(_entry(3, "all_reduce", 10))
        entries.append(_entry(1, "all_gather", 55, group="pair"))
        recs[str(r)] = entries
    return recs


def _record_slips(records):
    def outer(e):
        if e is None or not e["frames"]:
            return None
        return f"{os.path.basename(e['frames'][0]['file'])}:{e['frames'][0]['line']}"
    parts = flight.where_they_part(records)
    calls = parts[0]["calls"] if parts else {}
    return {
        "the outermost frame: a record's frames are innermost last, so the line that "
        "issued the call is frames[-1]": {str(r): outer(e) for r, e in calls.items()},
        "each rank's last entry: the ranks go on after they part, so the line to read is "
        "the one of the first sequence number where they differ":
            {str(r): _where(records[r][-1] if records[r] else None) for r in calls},
    }


def check_parting_lines(fn, flight_recorder):
    for name, recs in (("the run's records", flight_recorder),
                       ("made-up records (rank 2's extra broadcast, then all go on)",
                        _made_up_records())):
        got = fn(recs)
        want = _parting_lines(recs)
        if not isinstance(got, dict):
            raise AssertionError(f"parting_lines on {name} should return "
                                 f"{{rank: 'file:line' or None}}, got {got!r}")
        got = {str(r): v for r, v in got.items()}
        if got == want:
            continue
        for slip, value in _record_slips(recs).items():
            if got == value:
                raise AssertionError(f"parting_lines on {name}: {slip}")
        raise AssertionError(f"parting_lines on {name}: got {got}, expected {want} (the "
                             "call each rank issued at the first sequence number where "
                             "the ranks' records differ; None for a rank that issued none)")
    return True
