"""Checks of assignment 10: diagnose the job, from what a failed or slow run left behind.

    from labsupport.grading import diagnose_the_job as dj
    cases = dj.examples()                    # the notebook's visible cases, verdicts known
    dj.check_examples(diagnose)              # every field of every example right, or fails
    dj.grade(diagnose, "hangs", seed=7)      # hidden cases made now: partial points

The student writes ``diagnose(artefacts) -> verdict`` over the dicts of
/work/shared's contract between chapter 12 and this assignment (the
Flight Recorder's entries per rank, the ranks' error texts, the collectives'
timings, the phase times, the replicas' checksums) and returns
``{"kind", "ranks", "op", "seq", "group", "step"}``. Each case is made by
``cases``: a healthy run with one fault injected, so its verdict is the
fault itself, known by construction; the package holds no diagnosis.

``grade`` makes its cases at grading time from a seed (world sizes 2 to 16,
other ranks, several groups, healthy noise), none of which the notebook
holds, and gives points per case and, within a case, per field (``WEIGHTS``);
it returns the points, which nbgrader takes as partial credit, and prints
what was wrong in each case; a diagnose that earns nothing fails the cell
with that report. The student's function runs on one rank through
``diagnosis.run_on_ranks`` (the graders' deadline: a loop is stopped by its
CPU time, never by the wall clock), its printing kept out of the cell's
output; an exception in one case costs that case, with its line.
"""
import contextlib
import copy
import io
import traceback

from labsupport import p2p_log
from labsupport.checking.diagnosis import log_path, name_of, run_on_ranks
from labsupport.grading.diagnose_the_job import cases as _cases
from labsupport.grading.diagnose_the_job.cases import DIVERGED_RTOL, OP_TYPE, STRAGGLER_SHARE
from labsupport.your_turn import NotWritten

__all__ = ["DIVERGED_RTOL", "OP_TYPE", "STRAGGLER_SHARE", "WEIGHTS", "check_examples",
           "examples", "grade", "hidden_cases", "try_examples"]

FIELDS = ("kind", "ranks", "op", "seq", "group", "step")
KINDS = ("desync", "mismatch", "straggler", "divergence", "healthy")
_HANG = {"kind": 0.25, "ranks": 0.3, "seq": 0.25, "op": 0.1, "group": 0.1}
WEIGHTS = {"desync": _HANG, "mismatch": _HANG, "straggler": {"kind": 0.4, "ranks": 0.6},
           "divergence": {"kind": 0.3, "ranks": 0.4, "step": 0.3},
           "healthy": {"kind": 0.5, "ranks": 0.5}}
PARTS = ("hangs", "quiet")


# -- the cases ------------------------------------------------------------------------

def examples() -> list:
    """The notebook's visible cases, one per kind of fault and then some: a desync
    read from a pipeline's recorder (sends and receives beside the collectives), a
    mismatch in a tensor-parallel group, DETAIL's messages alone, a straggler,
    a diverged replica, a healthy run. Their seeds are the notebook's, never a
    hidden case's (``grade`` takes seeds of 100 and more)."""
    b = _cases.build
    return [b("desync", 1, 5, style="pipeline", how="extra", faulty=[3]),
            b("mismatch", 2, 8, style="dp_tp", how="shape", faulty=[5], nccl=True),
            b("desync", 3, 4, detail=True, how="skip", faulty=[2], recorder=False),
            b("straggler", 4, 6, faulty=4),
            b("divergence", 5, 8, style="dp_tp", faulty=6),
            b("healthy", 6, 4, style="dp_tp")]


def hidden_cases(part: str, seed: int) -> list:
    """Six cases of ``part``, made from ``seed`` (>= 100): "hangs" (desyncs and
    mismatches: flat, tensor-parallel and pipeline runs, two deviating ranks, NCCL's
    states and watchdog, DETAIL alone) or "quiet" (stragglers, diverged replicas,
    healthy runs, each with a healthy rank late once and phase times that mislead)."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    if not isinstance(seed, int) or seed < 100:
        raise ValueError(f"hidden seeds are integers of 100 and more (the examples' are "
                         f"below), got {seed!r}")
    import random
    rng = random.Random(f"{part}-{seed}")
    b = _cases.build
    if part == "hangs":
        return [b("desync", seed, rng.randint(3, 16), how="extra", faulty=[0]),
                b("desync", seed, rng.choice([6, 8, 9, 12, 16]), style="dp_tp", how="skip",
                  nccl=True),
                b("desync", seed, rng.randint(7, 16), how="extra",
                  faulty=[rng.randint(4, 6)], second=True),
                b("mismatch", seed, rng.randint(3, 8), style="pipeline", how="shape"),
                b("mismatch", seed, rng.choice([6, 8, 12, 16]), style="dp_tp", how="dtype",
                  nccl=rng.random() < 0.5),
                b(rng.choice(["desync", "mismatch"]), seed, rng.randint(3, 12), detail=True,
                  recorder=rng.random() < 0.5)]
    return [b("straggler", seed, rng.randint(2, 16)),
            b("straggler", seed, rng.choice([4, 6, 8, 12, 16]), style="dp_tp",
              recorder=rng.random() < 0.5),
            b("divergence", seed, rng.randint(3, 16)),
            b("divergence", seed, rng.choice([6, 8, 9, 12, 16]), style="dp_tp"),
            b("healthy", seed, rng.randint(2, 8), style="pipeline"),
            b("healthy", seed, rng.choice([4, 6, 8, 9, 12, 16]), style="dp_tp")]


# -- the checks -------------------------------------------------------------------------

def check_examples(diagnose, timeout=None):
    """Every field of every example's verdict right; else AssertionError with each
    wrong case and what was wrong in it."""
    cases = examples()
    marks = _marked(diagnose, cases, 1.0, timeout)
    wrong = [m for m in marks if m["earned"] < m["worth"]]
    if wrong:
        raise AssertionError(f"{len(wrong)} of the {len(cases)} examples are not right:\n"
                             + "\n".join(m["text"] for m in wrong))
    print(f"✓ {name_of(diagnose)}: every field of the {len(cases)} examples right")


def try_examples(diagnose, timeout=None) -> None:
    """For a try-out: each example's verdict, its marks and what is wrong; never fails
    on a wrong answer (a loop still ends at the deadline)."""
    for m in _marked(diagnose, examples(), 1.0, timeout):
        print(m["text"])


def grade(diagnose, part: str, seed: int, points: float = 4.0, timeout=None) -> float:
    """The points of ``diagnose`` on ``hidden_cases(part, seed)``, each case worth
    points / 6, split over its fields (``WEIGHTS``); prints each case's marks and
    what was wrong. Earning nothing raises AssertionError with that report."""
    cases = hidden_cases(part, seed)
    marks = _marked(diagnose, cases, points / len(cases), timeout)
    earned = round(sum(m["earned"] for m in marks), 2)
    report = "\n".join(m["text"] for m in marks)
    if earned == 0:
        raise AssertionError(f"{name_of(diagnose)} earned 0 of {points:g} points on "
                             f"{len(cases)} cases made at grading time:\n{report}"
                             + _stub_hint(marks))
    print(f"{name_of(diagnose)}: {earned:g} of {points:g} points on {len(cases)} cases "
          f"made at grading time\n{report}")
    return earned


def _stub_hint(marks) -> str:
    if all(m.get("unwritten") for m in marks):
        return ("\nWrite your solution in place of `raise NotImplementedError()` "
                "(every case raised it).")
    return ""


# -- marking one verdict ---------------------------------------------------------------

def _marked(diagnose, cases, worth, timeout) -> list[dict]:
    """Per case: {"earned", "worth", "text"} (the text names the case and what was
    wrong), from the student's verdicts on one rank."""
    results = _run(diagnose, cases, timeout)
    out = []
    for i, (case, result) in enumerate(zip(cases, results), 1):
        where = f"case {i} ({case.label})"
        if "error" in result:
            text = f"{where}: 0/{worth:.2f}: {name_of(diagnose)} raised {result['error']}"
            out.append(dict(earned=0.0, worth=worth, text=text,
                            unwritten=result.get("unwritten", False)))
            continue
        share, problems = mark(case, result["verdict"])
        earned = round(worth * share, 4)
        text = f"{where}: {earned:.2f}/{worth:.2f}"
        out.append(dict(earned=earned, worth=worth,
                        text=text + ("".join(f"\n  - {p}" for p in problems)
                                     if problems else " ✓")))
    return out


def mark(case, got) -> tuple[float, list[str]]:
    """(share of the case's points earned, what was wrong) for the verdict ``got``."""
    if not isinstance(got, dict):
        return 0.0, [f"diagnose returned {_show(got)}; return a dict with the keys "
                     + ", ".join(FIELDS)]
    want, weights = case.verdict, WEIGHTS[case.kind]
    share, problems = 0.0, []
    for field, weight in weights.items():
        value, problem = _read(field, got)
        if problem is None and value == want[field]:
            share += weight
            continue
        problems.append(problem or _hint(field, value, case))
    return round(share, 6), problems


def _read(field, got):
    """(the field's value, normalised; or a problem with its type)."""
    if field not in got:
        return None, f"the verdict has no {field!r}"
    value = got[field]
    if field == "ranks":
        if not isinstance(value, list) or not all(isinstance(r, int) and not isinstance(
                r, bool) for r in value):
            return None, f"ranks is {_show(value)}; give a list of ints (global ranks)"
        return sorted(set(value)), None
    if field in ("seq", "step"):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            return None, f"{field} is {_show(value)}; give an int, or None"
        return value, None
    if value is not None and not isinstance(value, str):
        return None, f"{field} is {_show(value)}; give a str" + (
            "" if field == "kind" else ", or None")
    return value, None


_KIND_HINT = {
    "desync": "the ranks issued different sequences of calls: at the first seq where one "
              "group's entries disagree, the ops differ",
    "mismatch": "at the first seq where one group's entries disagree the op is the same, "
                "and the shapes or the dtypes differ",
    "straggler": "the run did not hang, and one rank waits least inside nearly every "
                 "collective (collective_times: exit - enter)",
    "divergence": "the run did not hang, and one replica's checksum differs from the rest "
                  f"of its replica group (by more than {DIVERGED_RTOL:g}, relative) from "
                  "some step on",
    "healthy": "nothing is wrong in this run: no group's entries disagree, no rank waits "
               f"least in {STRAGGLER_SHARE:.0%} of its collectives (timings jitter, and a "
               "healthy rank may be late once), replicas agree to "
               f"{DIVERGED_RTOL:g}",
}
_RANKS_HINT = {
    "desync": "the ranks at fault are the odd ones out at the first seq where the group's "
              "entries disagree, those whose entry differs from the majority's there (not "
              "the ranks that reported a timeout: they waited)",
    "straggler": "the late rank is the one that waits least inside each collective "
                 "(exit - enter in collective_times); phase times cannot show it, the "
                 "collectives even the ranks out",
    "divergence": "the diverged rank is the one whose checksum differs from the rest of "
                  "its replica group (replica_groups), not from other groups' ranks, "
                  "which hold other weights",
    "healthy": "a healthy run names no rank: ranks = []",
}
_RANKS_HINT["mismatch"] = _RANKS_HINT["desync"]


def _hint(field, value, case) -> str:
    """What was wrong with ``field`` (its value ``value``) in this case, and where to look,
    without the answer."""
    want, notes = case.verdict, case.notes
    said = f"you said {field} = {_show(value)}"
    if field == "kind":
        detail = "flight_recorder" not in case.artefacts and case.kind in ("desync", "mismatch")
        where = (". This run left no flight_recorder: DETAIL's messages give each rank's "
                 "fingerprint (SequenceNumber, counted from 0, OpType, TensorShape, "
                 "TensorDtypes)"
                 if detail else "")
        return f"{said}, but {_KIND_HINT[case.kind]}{where}"
    if field == "ranks":
        if case.kind == "straggler" and value == [notes.get("decoy")]:
            return (f"{said}: that rank looks slowest in phase_times and is late at one "
                    "collective only; " + _RANKS_HINT["straggler"])
        if case.kind in ("desync", "mismatch") and value == [notes.get("scan")] \
                and value != want["ranks"]:
            return (f"{said}: that rank's entries differ only at a later seq; walk the "
                    "seqs in order, not the ranks: " + _RANKS_HINT[case.kind])
        return f"{said}; " + _RANKS_HINT[case.kind]
    if field == "seq":
        if value is not None and value == notes.get("last_seq") != want["seq"]:
            return (f"{said}: the last seq where the entries disagree; the first one "
                    "is the fault (after it the calls are shifted, and ranks go on "
                    "queueing calls before they block)")
        return (f"{said}; the seq to name is the first one at which the ranks' entries of "
                f"group {want['group']} disagree (seqs count per group; sends and receives "
                "keep a count of their own)")
    if field == "op":
        return (f"{said}; name the op the odd rank(s) issued at the first disagreeing seq, "
                "as the recorder names it (all_reduce, broadcast, all_gather, "
                "reduce_scatter, barrier; DETAIL's OpType ALLREDUCE is all_reduce)")
    if field == "group":
        return f"{said}; name the group (the entry's \"group\") whose entries disagree"
    return (f"{said}; the step is the first index of replica_checksums (0-based) at "
            "which the diverged rank differs from its replica group")


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -- running the student's function -------------------------------------------------------

def _run(diagnose, cases, timeout) -> list[dict]:
    """One result per case, {"verdict": ...} or {"error": text}, from one rank; a loop
    ends at the graders' deadline with an AssertionError that names the case."""
    if not callable(diagnose):
        raise TypeError(f"pass your function, e.g. grade(diagnose, ...); got "
                        f"{type(diagnose).__name__}")
    labels = [f"case {i} ({c.label})" for i, c in enumerate(cases, 1)]
    name = name_of(diagnose)
    try:
        [results] = run_on_ranks(_on_rank, (diagnose, [c.artefacts for c in cases], labels),
                                 1, timeout, name)
    except AssertionError as failure:
        raise AssertionError(
            f"{name} did not return: {failure}\nEvery case is a few hundred kilobytes "
            "of dicts; a diagnose that reads each entry a few times returns in well "
            "under a second. Look for a loop whose condition never changes.") from None
    return results


def _on_rank(log_dir, diagnose, artefacts, labels):
    """Each case through the student's function, its printing kept aside, its
    exceptions turned into text (the case scores zero, the others go on)."""
    out = []
    with p2p_log.record(log_path(log_dir, 0)) as rec:
        for case, label in zip(artefacts, labels):
            rec.note(label)  # the deadline's report names the case a loop was on
            with contextlib.redirect_stdout(io.StringIO()), \
                    contextlib.redirect_stderr(io.StringIO()):
                try:
                    out.append({"verdict": _plain(diagnose(copy.deepcopy(case)))})
                except Exception as err:  # the student's: reported, then the next case
                    out.append({"error": _raised(err),
                                "unwritten": isinstance(err, (NotImplementedError,
                                                              NotWritten))})
    return out


def _plain(value, depth=0):
    """The verdict as plain data (it crosses back from the rank), anything else as
    its text, so that garbage is reported, never a crash of the grader."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth < 3 and isinstance(value, dict):
        return {k if isinstance(k, str) else repr(k): _plain(v, depth + 1)
                for k, v in list(value.items())[:20]}
    if depth < 3 and isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v, depth + 1) for v in list(value)[:64]]
    if hasattr(value, "__index__"):  # numpy's and torch's integers
        try:
            return int(value.__index__())
        except Exception:
            pass
    try:
        return _Shown(repr(value)[:80])
    except Exception:
        return _Shown(f"a {type(value).__name__}")


class _Shown(str):
    """Something that was not plain data, by its text: equal to no field's value."""

    def __eq__(self, other):
        return False

    __hash__ = str.__hash__

    def __repr__(self):
        return f"<{str(self)}>"


def _raised(err) -> str:
    """'KeyError: ...' and the student's last frames (labsupport's left out)."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if "labsupport" not in f.filename.replace("\\", "/").split("/")]
    where = "".join(f"\n    line {f.lineno}, in {f.name}" + (
        f": {f.line.strip()}" if f.line and f.line.strip() else "") for f in frames[-3:])
    text = type(err).__name__ + (f": {err}" if str(err) else "")
    if isinstance(err, KeyError) and err.args and err.args[0] in (
            "flight_recorder", "messages", "collective_times", "phase_times",
            "replica_checksums", "replica_groups", "timeout_s"):
        text += (" (every key but world_size may be absent from a case: "
                 "artefacts.get(key))")
    return text + where
