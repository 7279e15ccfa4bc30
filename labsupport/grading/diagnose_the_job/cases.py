"""Artefacts of faulty runs, synthesised from a fault injected on purpose: assignment 10's cases.

    case = build("desync", seed=3, world_size=8)    # one case of a kind
    case.artefacts          # the contract's dict (/work/shared artefacts: JSON-safe, str keys)
    case.verdict            # what diagnose must say: the fault that was injected
    case.label              # "desync, 8 ranks" for the messages

A healthy run is written first, as the calls each rank issues in order
(``_program``: data parallel, data x tensor parallel, or a pipeline whose
sends and receives sit beside the collectives); a fault is then injected
into it (a call added, skipped or changed on some ranks, one rank made late,
one replica's parameters changed from some step on) and the artefacts are
what that run leaves, cut where its ranks would hang. The expected verdict
is the injected fault itself, known by construction: nothing here reads the
artefacts back to decide it. Healthy noise is added on purpose: jittered
timings, a healthy rank late at one collective only, phase times that point
at a healthy rank, checksums equal only to rounding, timeout and watchdog
texts that name the ranks that waited, sends and receives that only two
ranks record, ranks that stop in different places.

Only ``random.Random(seed)``: the same seed gives the same case on any
machine, and no clock is read (the times are made up, on one clock).
"""
import random
from dataclasses import dataclass

# What the Flight Recorder's entries call each op (profiling_name without "gloo:"),
# and DETAIL's OpType for it (c10d's opTypeToString).
OP_TYPE = {"all_reduce": "ALLREDUCE", "broadcast": "BROADCAST", "all_gather": "ALLGATHER",
           "reduce_scatter": "REDUCE_SCATTER", "barrier": "BARRIER", "send": "SEND",
           "recv": "RECV"}
P2P = ("send", "recv")
DIVERGED_RTOL = 1e-6   # replicas differing by more than this (relative) have diverged
STRAGGLER_SHARE = 0.75  # a straggler waits least in at least this share of its collectives
HEALTHY_SHARE = 0.6     # no healthy rank waits least in more than this share (by construction)
C10D = "torch/distributed/distributed_c10d.py"
_C10D_LINE = {"all_reduce": 2871, "broadcast": 2792, "all_gather": 3446, "barrier": 4803,
              "reduce_scatter": 4277, "send": 2412, "recv": 2471}


@dataclass
class Case:
    kind: str
    label: str
    artefacts: dict
    verdict: dict
    notes: dict  # what was injected, for the messages (e.g. the last conflicting seq)


@dataclass(frozen=True)
class Call:
    op: str
    group: str          # the group's name; p2p calls: the group they go through
    shape: tuple
    dtype: str
    site: tuple         # (file, line, function) of the user's call
    phase: str
    peer: int | None = None


# -- the healthy run -------------------------------------------------------------------

def _groups(style, n, rng, min_dp=2):
    """{name: ranks} of a run's process groups, and the replica groups (same weights)."""
    groups = {"default_pg": list(range(n))}
    if style == "dp_tp":
        tp = rng.choice([t for t in (2, 3, 4) if n % t == 0 and n // t >= min_dp])
        for i in range(n // tp):
            groups[f"tp{i}"] = list(range(i * tp, (i + 1) * tp))
        for j in range(tp):
            groups[f"dp{j}"] = list(range(j, n, tp))
        replicas = [groups[f"dp{j}"] for j in range(tp)]
    elif style == "pipeline":
        replicas = [[r] for r in range(n)]
    else:
        replicas = [list(range(n))]
    return groups, replicas


def _mine(groups, prefix, rank):
    return next(g for g, ranks in groups.items() if g.startswith(prefix) and rank in ranks)


def _program(style, n, rank, groups, steps, sizes):
    """The calls ``rank`` issues in a healthy run, in order."""
    h, p, bucket = sizes
    calls = [Call("broadcast", "default_pg", (p,), "Float", ("train.py", 61, "main"), "setup")]
    for _ in range(steps):
        if style == "dp_tp":  # sequence parallel in tp, ZeRO-1 over dp
            tp, dp = _mine(groups, "tp", rank), _mine(groups, "dp", rank)
            for phase, line in (("forward", 118), ("backward", 131)):
                for layer in range(2):
                    site = ("model.py", line + 40 * layer, phase)
                    calls.append(Call("all_gather", tp, (8, h), "Float", site, phase))
                    calls.append(Call("reduce_scatter", tp, (8 * len(groups[tp]), h),
                                      "Float", (site[0], site[1] + 6, site[2]), phase))
            calls.append(Call("reduce_scatter", dp, (p,), "Float",
                              ("trainer.py", 74, "sync_gradients"), "communication"))
            calls.append(Call("all_gather", dp, (p // len(groups[dp]),), "Float",
                              ("optimizer.py", 88, "gather_parameters"), "optimizer"))
        elif style == "pipeline":
            for _micro in range(2):
                if rank > 0:
                    calls.append(Call("recv", "default_pg", (4, h), "Float",
                                      ("pipeline.py", 52, "forward_step"), "forward", rank - 1))
                if rank < n - 1:
                    calls.append(Call("send", "default_pg", (4, h), "Float",
                                      ("pipeline.py", 57, "forward_step"), "forward", rank + 1))
            for _micro in range(2):
                if rank < n - 1:
                    calls.append(Call("recv", "default_pg", (4, h), "Float",
                                      ("pipeline.py", 83, "backward_step"), "backward", rank + 1))
                if rank > 0:
                    calls.append(Call("send", "default_pg", (4, h), "Float",
                                      ("pipeline.py", 88, "backward_step"), "backward", rank - 1))
            calls.append(Call("all_reduce", "default_pg", (bucket,), "Float",
                              ("pipeline.py", 101, "sync_tied_embedding"), "communication"))
        else:  # data parallel with ZeRO-style sharded gradients
            calls.append(Call("reduce_scatter", "default_pg", (p,), "Float",
                              ("zero.py", 45, "reduce_gradients"), "communication"))
            calls.append(Call("all_gather", "default_pg", (p // n,), "Float",
                              ("zero.py", 63, "gather_parameters"), "communication"))
        calls.append(Call("all_reduce", "default_pg", (1,), "Float",
                          ("train.py", 97, "log_loss"), "optimizer"))
    calls.append(Call("barrier", "default_pg", (), "Float", ("train.py", 112, "main"), "setup"))
    return calls


def _entries(calls, groups, state="scheduled"):
    """The Flight Recorder's entries of one rank's calls: seq counted per group, p2p apart."""
    seq, p2p, out = {}, {}, []
    for c in calls:
        if c.op in P2P:
            p2p[c.group] = p2p.get(c.group, 0) + 1
            number = p2p[c.group]
        else:
            seq[c.group] = seq.get(c.group, 0) + 1
            number = seq[c.group]
        frames = [{"file": "train.py", "line": 88, "name": "main"},
                  {"file": "trainer.py", "line": 57, "name": "train_step"}]
        frames += [{"file": c.site[0], "line": c.site[1], "name": c.site[2]},
                   {"file": C10D, "line": _C10D_LINE[c.op], "name": c.op}]
        out.append({"seq": number, "op": c.op, "group": c.group,
                    "group_ranks": list(groups[c.group]),
                    "shapes": [list(c.shape)] if c.op != "barrier" else [[1]],
                    "dtypes": [c.dtype], "state": state, "frames": frames})
    return out


def _sizes(rng):
    h = rng.choice([16, 32, 64])
    bucket = rng.choice([1024, 2048, 4096])
    return h, bucket * rng.choice([3, 4, 5]), bucket


# -- hangs: a call added, skipped or changed on some ranks -------------------------------

_EXTRA = [Call("all_reduce", "", (1,), "Float", ("evaluate.py", 23, "evaluate"), "eval"),
          Call("barrier", "", (), "Float", ("checkpoint.py", 40, "save"), "eval"),
          Call("broadcast", "", (3,), "Long", ("data.py", 77, "next_batch"), "eval")]


def hang(seed, world_size, *, style="flat", how="extra", faulty=None, second=False,
         nccl=False, detail=False, recorder=True):
    """A run that hangs: on ``faulty`` ranks (a strict minority of one group of 3 or more
    ranks) a collective is added (``how="extra"``: an evaluation on some ranks only),
    skipped ("skip": a branch on a rank-local value), or issued with another shape
    ("shape": an uneven last batch) or dtype ("dtype": autocast on one rank). The
    ranks go on issuing a few calls (asynchronous collectives) before they block.
    ``second``: one more rank, numbered lower, deviates two seqs later (the verdict
    names only the first). ``detail``: DETAIL's fingerprints stop the run instead."""
    rng = random.Random(f"hang-{seed}-{world_size}-{style}-{how}")
    n = world_size
    groups, _ = _groups("flat" if detail else style, n, rng)
    sizes, steps = _sizes(rng), rng.randint(3, 5)
    programs = {r: _program("flat" if detail else style, n, r, groups, steps, sizes)
                for r in range(n)}
    group, faulty = _faulty_group(rng, groups, programs, faulty)
    members = groups[group]
    normal = _calls_in(programs[members[0]], group)
    index, bad = _fault_point(rng, normal, how, len(normal) // 3,
                              len(normal) - (6 if second else 2))
    for r in faulty:
        programs[r] = _inject(programs[r], group, index, how, bad)
    later, ahead = None, index
    if second:  # a lower-numbered rank deviates two calls further on
        others = [r for r in members if r not in faulty and r < faulty[0]]
        assert others and 2 * (len(faulty) + 1) < len(members), (faulty, members)
        later = others[0]
        ahead, bad2 = _fault_point(rng, normal, "shape", index + 2)
        programs[later] = _inject(programs[later], group, ahead, "shape", bad2)
    first = {r: _calls_in(programs[r], group)[index] for r in members}
    kind = "mismatch" if how in ("shape", "dtype") else "desync"
    verdict = dict(kind=kind, ranks=faulty, op=first[faulty[0]].op, seq=index + 1,
                   group=group, step=None)
    artefacts = {"world_size": n, "timeout_s": float(rng.choice([5, 10, 30, 600]))}
    if detail:
        artefacts["messages"] = _detail_messages(first, index + 1, members)
        if recorder:  # DETAIL stops the faulty call before the recorder sees it
            artefacts["flight_recorder"] = {
                str(r): _entries(_cut_before(programs[r], group, index), groups)
                for r in range(n)}
        notes = dict(last_seq=index + 1, scan=None)
    else:
        cut = _cut_hang(rng, programs, groups, group, index, ahead, n)
        fr = {str(r): _entries(cut[r], groups) for r in range(n)}
        if nccl:
            _nccl_states(fr, group, index + 1)
        artefacts["flight_recorder"] = fr
        artefacts["messages"] = _timeout_messages(rng, fr, faulty, artefacts, nccl)
        notes = dict(last_seq=_last_conflict(fr, group), scan=later)
    if rng.random() < 0.5:
        decoy = rng.choice([r for r in range(n) if r not in faulty])
        artefacts["phase_times"] = _phase_times(rng, n, decoy)
    label = f"{kind}, {n} ranks" + (f", group {group}" if group != "default_pg" else "")
    return Case(kind, label, artefacts, verdict, notes)


def _faulty_group(rng, groups, programs, faulty):
    """(the group the fault hits, its faulty ranks): a group of 3 ranks or more with
    collectives, a subgroup where there is one, and faulty ranks that are a strict
    minority of it (so the odd ones out are well defined), never its first rank
    unless asked for."""
    fits = [g for g, ranks in groups.items() if len(ranks) >= 3 and
            _calls_in(programs[ranks[0]], g) and
            (faulty is None or set(faulty) <= set(ranks) and 2 * len(faulty) < len(ranks))]
    group = rng.choice([g for g in fits if g != "default_pg"] or fits)
    members = groups[group]
    if faulty is None:
        count = 2 if len(members) >= 5 and rng.random() < 0.4 else 1
        faulty = rng.sample(members[1:], count)
    assert 2 * len(faulty) < len(members) and set(faulty) <= set(members), (faulty, members)
    return group, sorted(faulty)


def _calls_in(calls, group):
    return [c for c in calls if c.group == group and c.op not in P2P]


def _fault_point(rng, normal, how, start, end=None):
    """(index of the group's call the fault hits, what replaces it): a fault that shows
    at that seq (another op for extra/skip, the same op for shape/dtype)."""
    for _ in range(100):
        i = rng.randrange(max(1, start), end or len(normal) - 2)
        c = normal[i]
        if how == "extra":
            extra = rng.choice([e for e in _EXTRA if e.op != c.op])
            return i, Call(extra.op, c.group, extra.shape, extra.dtype, extra.site, "eval")
        if how == "skip" and normal[i + 1].op != c.op:
            return i, None
        if how == "shape" and c.op != "barrier" and c.shape and c.shape[0] >= 4:
            shape = (max(1, c.shape[0] - rng.randint(1, 3)),) + c.shape[1:]
            return i, Call(c.op, c.group, shape, c.dtype, c.site, c.phase)
        if how == "dtype" and c.op != "barrier":
            return i, Call(c.op, c.group, c.shape, rng.choice(["BFloat16", "Half", "Double"]),
                           c.site, c.phase)
    raise AssertionError(f"no call fits a {how} fault")


def _inject(calls, group, index, how, bad):
    """``calls`` with the group's ``index``-th collective changed as ``how`` says."""
    seen, out = -1, []
    for c in calls:
        if c.group == group and c.op not in P2P:
            seen += 1
            if seen == index:
                if how == "extra":
                    out += [bad, c]
                elif how in ("shape", "dtype"):
                    out.append(bad)
                continue  # skip: dropped
        out.append(c)
    return out


def _position(calls, group, index):
    """Where the group's ``index``-th collective is in ``calls`` (len(calls) if none)."""
    seen = -1
    for i, c in enumerate(calls):
        if c.group == group and c.op not in P2P:
            seen += 1
            if seen == index:
                return i
    return len(calls)


def _cut_before(calls, group, index):
    return calls[:_position(calls, group, index)]


def _cut_hang(rng, programs, groups, group, index, ahead, n):
    """Each rank's calls up to where it blocks: the group's members a few seqs past
    the fault (queued asynchronously), every other rank somewhere later, in a
    collective that waits for a member (so no rank reaches the end)."""
    members, cut = groups[group], {}
    for r in range(n):
        calls = programs[r]
        if r in members:
            stop = _position(calls, group, ahead + rng.randint(0, 2)) + 1
        else:
            anchor = _position(programs[members[0]], group, index)
            stop = min(len(calls) - 2, anchor + rng.randint(0, 3))
        cut[r] = calls[:min(stop, len(calls) - 1)]
    return cut


def _last_conflict(fr, group):
    """The largest seq of ``group`` at which two ranks' entries differ (for a message)."""
    seen, last = {}, None
    for entries in fr.values():
        for e in entries:
            if e["group"] == group and e["op"] not in P2P:
                key = (e["op"], tuple(map(tuple, e["shapes"])), tuple(e["dtypes"]))
                seen.setdefault(e["seq"], set()).add(key)
    for s, keys in seen.items():
        if len(keys) > 1:
            last = s if last is None else max(last, s)
    return last


def _nccl_states(fr, group, seq):
    """NCCL's states: what ran before the fault completed; the rest stays scheduled."""
    for entries in fr.values():
        done = True
        for e in entries:
            if e["group"] == group and e["seq"] >= seq and e["op"] not in P2P:
                done = False
            e["state"] = "completed" if done else "scheduled"
        if entries and not done:
            entries[-1]["state"] = "started"


def _timeout_messages(rng, fr, faulty, artefacts, nccl):
    """What the waiting ranks reported: gloo's timeout, or NCCL's watchdog line, which
    name the rank that waited, not the one at fault; "" where a rank said nothing."""
    ms = int(artefacts["timeout_s"] * 1000)
    out = {}
    for r, entries in fr.items():
        last = entries[-1] if entries else None
        if last is None or int(r) in faulty and rng.random() < 0.5:
            out[r] = ""
        elif nccl:
            numel = 1
            for d in last["shapes"][0]:
                numel *= d
            out[r] = (f"[Rank {r}] Watchdog caught collective operation timeout: WorkNCCL("
                      f"SeqNum={last['seq']}, OpType={OP_TYPE[last['op']]}, NumelIn={numel}, "
                      f"NumelOut={numel}, Timeout(ms)={ms}) ran for {ms + rng.randint(3, 90)} "
                      "milliseconds before timing out.")
        else:
            way = "recv" if rng.random() < 0.7 else "send"
            out[r] = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer."
                      f"cc:{81 if way == 'recv' else 133}] Timed out waiting {ms}ms for "
                      f"{way} operation to complete")
    return out


def fingerprint(call, seq) -> str:
    """DETAIL's text for one rank's collective (ProcessGroupWrapper's CollectiveFingerPrint).
    Its SequenceNumber counts from 0 where the recorder's seq counts from 1 (torch 2.13:
    chapter 12's shape mismatch at the second all-reduce prints SequenceNumber=1)."""
    shape = ", ".join(str(d) for d in (call.shape or (1,)))
    return (f"CollectiveFingerPrint(SequenceNumber={seq - 1}, OpType={OP_TYPE[call.op]}, "
            f"TensorShape=[{shape}], TensorDtypes={call.dtype}, TensorDeviceTypes=cpu)")


def _detail_messages(first, seq, members):
    """Each rank's error: its fingerprint against the first rank whose differs."""
    out = {}
    for r in members:
        mine = fingerprint(first[r], seq)
        other = next(q for q in members if fingerprint(first[q], seq) != mine)
        theirs = fingerprint(first[other], seq)
        aspects = []
        if first[r].op != first[other].op:
            aspects.append(f"  Op type: {OP_TYPE[first[r].op]}vs {OP_TYPE[first[other].op]}")
        if first[r].shape != first[other].shape:
            aspects.append("  Tensor Tensor shapes: " + _dims(first[r]) + "vs " +
                           _dims(first[other]))
        if first[r].dtype != first[other].dtype:
            aspects.append(f"  Tensor Tensor dtypes: {first[r].dtype}vs {first[other].dtype}")
        out[str(r)] = ("RuntimeError: Detected mismatch between collectives on ranks. Rank "
                       f"{r} is running collective: {mine}, but Rank {other} is running "
                       f"collective: {theirs}.Collectives differ in the following aspects: "
                       + "".join(aspects))
    return out


def _dims(call):
    return "".join(f"{d}" for d in (call.shape or (1,)))


# -- runs that do not hang: the timings, the phases, the replicas' checksums --------------

def quiet(kind, seed, world_size, *, style="flat", faulty=None, recorder=True):
    """A run that ends: "straggler" (rank ``faulty`` late at every collective),
    "divergence" (replica ``faulty`` differs from step ``step`` on) or "healthy"."""
    rng = random.Random(f"{kind}-{seed}-{world_size}-{style}")
    n = world_size
    groups, replicas = _groups(style, n, rng, 3 if kind == "divergence" else 2)
    if faulty is None and kind != "healthy":  # never rank 0: a constant answer must fail
        faulty = rng.choice([r for g in replicas for r in g if r and (
            kind == "straggler" or len(g) >= 3)])
    sizes, steps = _sizes(rng), rng.randint(4, 7)
    programs = {r: _program(style, n, r, groups, steps, sizes) for r in range(n)}
    verdict = dict(kind=kind, ranks=[], op=None, seq=None, group=None, step=None)
    late = faulty if kind == "straggler" else None
    decoy = rng.choice([r for r in range(n) if r != late and (r != faulty or n == 1)])
    artefacts = {"world_size": n}
    if recorder:
        state = rng.choice(["scheduled", "completed"])
        artefacts["flight_recorder"] = {str(r): _entries(programs[r], groups, state)
                                        for r in range(n)}
    if rng.random() < 0.5:
        artefacts["messages"] = {str(r): "" for r in range(n)}
    artefacts["collective_times"] = _times(rng, programs, groups, late, decoy)
    artefacts["phase_times"] = _phase_times(rng, n, decoy)
    if kind == "straggler":
        verdict["ranks"] = [late]
    if kind == "divergence" or rng.random() < 0.5:
        if kind == "divergence":
            group = next(g for g in replicas if faulty in g)
            assert len(group) >= 3, "a replica group of 3 ranks or more says which one differs"
            step = rng.randint(1, steps - 2)
            verdict.update(ranks=[faulty], step=step)
        else:
            step = None
        artefacts["replica_checksums"] = _checksums(rng, replicas, steps, faulty, step)
        artefacts["replica_groups"] = [list(g) for g in replicas]
    label = f"{kind}, {n} ranks"
    return Case(kind, label, artefacts, verdict, dict(decoy=decoy))


def _times(rng, programs, groups, late, decoy):
    """Each rank's collectives on one clock: the k-th collective of every rank is the
    same step of the program, run by each group on its members. In a group, every
    member leaves when the last one has arrived (plus the transfer); the last to
    arrive waits least. The late rank arrives last at each of its collectives; the
    decoy, once, later still; otherwise the last arrival goes round the members."""
    n = len(programs)
    colls = {r: [c for c in programs[r] if c.op not in P2P] for r in range(n)}
    seqs = {r: {} for r in range(n)}
    out = {str(r): [] for r in range(n)}
    clock = 1000.0 + rng.uniform(0, 50)
    turn = {}
    once = rng.randrange(1, len(colls[0]) - 1)
    for k in range(len(colls[0])):
        ends = []
        for group, ranks in groups.items():
            here = [r for r in ranks if colls[r][k].group == group]
            if not here:
                continue
            arrive = {r: rng.uniform(0, 0.001) for r in here}
            top = max(arrive.values())
            if late in here:
                arrive[late] = top + rng.uniform(0.004, 0.040)
            else:
                turn[group] = turn.get(group, rng.randrange(len(here))) + 1
                arrive[here[turn[group] % len(here)]] = top + rng.uniform(0.0002, 0.0015)
            if k == once and decoy in here:
                arrive[decoy] = max(arrive.values()) + rng.uniform(0.02, 0.06)
            leave = max(arrive.values()) + rng.uniform(0.0005, 0.003)
            for r in here:
                c = colls[r][k]
                seqs[r][group] = seqs[r].get(group, 0) + 1
                out[str(r)].append({"seq": seqs[r][group], "op": c.op, "group": group,
                                    "enter": round(clock + arrive[r], 6),
                                    "exit": round(clock + leave + rng.uniform(0, 1e-4), 6)})
            ends.append(leave)
        clock += max(ends) + rng.uniform(0.002, 0.02)
    _assert_margin(out, late)
    return out


def _assert_margin(times, late):
    """The construction's promise: the late rank waits least in at least STRAGGLER_SHARE
    of its collectives, every other rank in at most HEALTHY_SHARE."""
    least, count = {}, {}
    calls = {}
    for r, entries in times.items():
        for e in entries:
            calls.setdefault((e["group"], e["seq"]), []).append((e["exit"] - e["enter"], r))
            count[r] = count.get(r, 0) + 1
    for waits in calls.values():
        r = min(waits)[1]
        least[r] = least.get(r, 0) + 1
    for r, c in count.items():
        share = least.get(r, 0) / c
        if late is not None and int(r) == late:
            assert share >= STRAGGLER_SHARE, (r, share)
        else:
            assert share <= HEALTHY_SHARE, (r, share, least, count)


def _phase_times(rng, n, decoy):
    """Per-rank phase totals as a per-rank profiler reports them: the collectives
    inside each phase even the ranks out, so they are equal up to jitter, except the
    decoy, a healthy rank whose forward and backward look longest."""
    base = dict(forward=rng.uniform(0.08, 0.2), backward=rng.uniform(0.15, 0.4),
                communication=rng.uniform(0.05, 0.3), optimizer=rng.uniform(0.005, 0.02))
    out = {}
    for r in range(n):
        grow = 1.06 if r == decoy else 1.0
        out[str(r)] = {p: round(t * rng.uniform(0.98, 1.02) * (grow if p in (
            "forward", "backward") else 1.0), 6) for p, t in base.items()}
    return out


def _checksums(rng, replicas, steps, faulty, step):
    """A checksum of each rank's parameters after each step: equal within a replica
    group up to rounding (1e-9 relative, sums taken in other orders), another value
    for each group; ``faulty`` drifts away from ``step`` on."""
    out = {}
    for group in replicas:
        value, walk = rng.choice([-1, 1]) * rng.uniform(10, 50), []
        for _ in range(steps):
            value += rng.uniform(-1, 1)
            walk.append(value)
        drift = rng.choice([-1, 1]) * rng.uniform(1e-4, 1e-3)
        for r in group:
            row = []
            for t, v in enumerate(walk):
                noise = rng.choice([0.0, 0.0, rng.uniform(-1e-9, 1e-9)])
                if r == faulty and step is not None and t >= step:
                    noise = drift * (1 + t - step)
                row.append(v * (1 + noise))
            out[str(r)] = row
    return out


# -- the cases of the notebook and of the grader -----------------------------------------

def build(kind, seed, world_size, **options):
    if kind in ("desync", "mismatch"):
        how = options.pop("how", "extra" if kind == "desync" else "shape")
        return hang(seed, world_size, how=how, **options)
    return quiet(kind, seed, world_size, **options)
