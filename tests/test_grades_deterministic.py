# Run: PYTHONPATH=$PWD .venv/bin/python -m pytest tests/test_grades_deterministic.py  (~5 s)
"""No grade reads a clock or the allocator where load could change it.

Every grader in labsupport/grading/, the checking core they run on (labsupport/checking/)
and every chapter's your-turn checker (labsupport/<topic>/checks.py) is read as code,
comments and strings left out, for what would make a verdict depend on the
machine's load: a clock (``time.time``, ``perf_counter``, ``monotonic``,
``sleep``, ``labsupport.timing``, a timeline's durations, a recorded call's
``start``/``end``), or the allocator and liveness (``torch.cuda`` memory
counters, ``memory.PeakTally``, a tally's ``live``, ``gc``, ``weakref``,
``tracemalloc``, reference counts). Each read found must be in ALLOWED, with
the number of times it appears in that file and the reason load cannot
change a grade through it (book/instructors.md, "Grades independent of
load", has the same list as a table); a new read, or one more of a listed
kind, fails the test, and so does an entry that no longer matches (the list
stays exact). The second half checks ``labsupport.checking.held``, the count
by reference that replaced the tallies of live storages.
"""
import io
import re
import tokenize
from pathlib import Path

import pytest
import torch

from labsupport.checking import held

ROOT = Path(__file__).resolve().parents[1]
GRADERS = ROOT / "labsupport" / "grading"
CORE = ROOT / "labsupport" / "checking"        # the checking core every grader runs on

READS = {  # name -> the pattern of a read in code (strings and comments removed)
    "wall clock": r"\btime\s*\.\s*(time|time_ns|monotonic|monotonic_ns|perf_counter"
                  r"|perf_counter_ns|process_time|thread_time)\b|\bperf_counter\b"
                  r"|\bdatetime\b|^\s*(import time\b|from time import)",
    "sleep": r"\bsleep\s*\(",
    "timing module": r"\btiming\s*\.|\bimport\s+timing\b|from labsupport import .*\btiming\b",
    "timeline": r"\btimeline\s*\.|\bimport\s+timeline\b"
                r"|from labsupport import .*\btimeline\b",
    "call start/end": r"\[\s*[\"'](start|end)[\"']\s*\]",
    "timeline durations": r"\[\s*[\"'](window|busy|idle|fraction|duration|elapsed|seconds"
                          r"|wall)[\"']\s*\]",
    "fixed-length compute": r"\bUNIT\b",
    "allocator": r"\bmemory_(allocated|reserved|stats|snapshot|summary)\b"
                 r"|\bmax_memory_\w+|\bcuda\s*\.\s*mem_get_info\b|\btracemalloc\b"
                 r"|\bgetrusage\b|\bpsutil\b",
    "live-storage tally": r"\bPeakTally\b|\bpeak_tally\b|\.\s*live\b",
    "gc and liveness": r"\bgc\s*\.|\bimport\s+gc\b|\bweakref\b|\bgetrefcount\b",
}

LOGICAL_A3 = ("timeline.bubble of LOGICAL events: the recorded order played with F = B = "
              "W = 1 unit (idle_fraction) and 1F1B's ideal events on the same clock; no "
              "time is measured")
IDEAL_CH5 = ("timeline.bubble of pipeline_sim's ideal events (t_f = 1, t_b = 2 units): the "
             "reader's formula against the module's on computed, not measured, times")
ALLOWED = {  # (file under labsupport/grading, read) -> (lines in code, why load cannot flip)
    ("checking/diagnosis.py", "wall clock"): (
        2, "time.time() only in a deadlocked run's message ('rank 0 waited 20 s'): "
           "the verdict, the deadline, was already reached; the seconds are text"),
    ("zero_bubble_pipeline.py", "timeline"): (3, LOGICAL_A3),
    ("zero_bubble_pipeline.py", "timeline durations"): (2, LOGICAL_A3),
    ("zero_bubble_pipeline.py", "call start/end"): (
        6, "events of the IDEAL machine (pipeline_sim: F = B = W = 1 unit) in "
           "check_schedule_order and its hint: logical time, computed, never measured"),
    ("pipeline/checks.py", "timeline"): (2, IDEAL_CH5),
    ("pipeline/checks.py", "timeline durations"): (1, IDEAL_CH5),
    ("checkpoints/checks.py", "call start/end"): (
        2, "p['start'] is an element offset in a checkpoint's plan, not a time"),
    ("reshard_to_tensor_parallel.py", "call start/end"): (
        1, "p['start'] is an element offset in a checkpoint's plan, not a time"),
}


def code_only(source: str) -> str:
    """``source`` with comments and string literals (docstrings, messages) blanked out;
    a literal that is one word stays (a key, as in ``e["end"]``)."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.STRING and re.fullmatch(r"[\"']\w{1,30}[\"']", tok.string):
            out.append((tok.type, tok.string))             # a key: e["end"] is code
        elif tok.type in (tokenize.COMMENT, tokenize.STRING):
            out.append((tok.type, '""' if tok.type == tokenize.STRING else ""))
        elif tok.type == getattr(tokenize, "FSTRING_START", -1):
            out.append((tokenize.STRING, '""'))
        elif tok.type in (getattr(tokenize, "FSTRING_MIDDLE", -1),
                          getattr(tokenize, "FSTRING_END", -1)):
            continue
        else:
            out.append((tok.type, tok.string))
    return tokenize.untokenize(out)


def reads_in(source: str) -> dict:
    """{read: lines} of the code of ``source`` where each kind of read appears."""
    found = {}
    for line in code_only(source).splitlines():
        for name, pattern in READS.items():
            if re.search(pattern, line):
                found[name] = found.get(name, 0) + 1
    return found


def graders(root=GRADERS):
    """(name, path) of every grader: grading/*.py by their path under it, the checking
    core's as 'checking/<file>', and each chapter topic's checks.py as '<topic>/checks.py'."""
    for path in sorted(root.rglob("*.py")):
        yield str(path.relative_to(root)), path
    if root == GRADERS:
        for path in sorted(CORE.glob("*.py")):
            yield f"checking/{path.name}", path
        for path in sorted((root.parent).glob("*/checks.py")):
            yield f"{path.parent.name}/checks.py", path


def all_reads(root=GRADERS) -> dict:
    """{(file, read): times} over every grader's code."""
    return {(name, read): n for name, path in graders(root)
            for read, n in reads_in(path.read_text()).items()}


def unlisted(found: dict, allowed: dict) -> list[str]:
    """What ``found`` has that ``allowed`` does not list exactly: new reads, more of a
    listed read, or a listed read that is gone."""
    problems = [f"{path}: {n} x {name}, listed {allowed.get((path, name), (0,))[0]}"
                for (path, name), n in found.items() if allowed.get((path, name), (0,))[0] != n]
    problems += [f"{path}: {name} is listed ({allowed[path, name][0]} x) but not read"
                 for path, name in allowed if (path, name) not in found]
    return problems


def test_every_clock_or_allocator_read_of_a_grader_is_listed_with_its_reason():
    problems = unlisted(all_reads(), ALLOWED)
    assert not problems, (
        "a grader reads a clock or the allocator outside the allow-list (or the list is "
        "stale); make the check deterministic, or list it in ALLOWED and in "
        "book/instructors.md with why load cannot change a grade:\n" + "\n".join(problems))


def test_every_allowance_says_why():
    for key, (times, reason) in ALLOWED.items():
        assert times > 0 and len(reason) > 30, key


@pytest.mark.parametrize("line, read", [
    ("t0 = time.perf_counter()", "wall clock"),
    ("from time import perf_counter", "wall clock"),
    ("import time", "wall clock"),
    ("deadline = time.monotonic() + 5", "wall clock"),
    ("time.sleep(SETTLE_S)", "sleep"),
    ("with timing.timed() as t:", "timing module"),
    ("from labsupport import models, timeline", "timeline"),
    ("span = max(e['end'] for e in events)", "call start/end"),
    ("if bubble['window'] < best['window']:", "timeline durations"),
    ("def check(schedule, unit=UNIT):", "fixed-length compute"),
    ("used = torch.cuda.max_memory_allocated()", "allocator"),
    ("tally = memory.PeakTally()", "live-storage tally"),
    ("left = grads.tally.live", "live-storage tally"),
    ("gc.collect()", "gc and liveness"),
    ("weakref.finalize(storage, free)", "gc and liveness"),
])
def test_a_new_read_in_a_grader_is_caught(line, read):
    """The scan on a synthetic grader: each kind of read found, and failed as unlisted."""
    source = f'"""A grader; time.time() in a docstring is not a read."""\n{line}  # ok\n'
    found = {("synthetic.py", name): n for name, n in reads_in(source).items()}
    assert ("synthetic.py", read) in found
    assert unlisted(found, ALLOWED) == [f"synthetic.py: 1 x {read}, listed 0"] + [
        f"{p}: {n} is listed ({ALLOWED[p, n][0]} x) but not read" for p, n in ALLOWED]
    assert unlisted(found, {("synthetic.py", read): (1, "a reason")}) == []
    assert unlisted(found, {("synthetic.py", read): (2, "a reason")}) != []


def test_strings_and_comments_are_not_reads():
    source = ('"""Reads time.perf_counter() and memory.PeakTally."""\n'
              'x = f"{n:g} s, time.time()"  # gc.collect()\n')
    assert reads_in(source) == {}


# -- the deadline of every graded run (labsupport.launch.progress) ---------------------

def test_every_graded_run_is_stopped_by_its_work_not_by_a_flat_wall_clock(monkeypatch):
    """The one way a grader runs ranks (diagnosis.run_on_ranks) hands the launcher a
    WorkDeadline: a deadlock is a stall of the ranks' CPU time, a loop their CPU
    time; the wall clock only as the last resort (tests/test_launcher_deadlines.py
    tests the launcher's verdicts, tests/test_grades_under_load.py under load)."""
    from labsupport import grading
    from labsupport.checking import diagnosis
    from labsupport.launch import limits, progress

    given = []

    class Cluster:
        def run(self, fn, *args, timeout):
            given.append(timeout)
            return []

    monkeypatch.setattr(diagnosis.session, "group_for", lambda n, backend: Cluster())
    grading.run(len, world_size=2, timeout=5)
    grading.run(len, world_size=2)
    t = grading.TIMEOUT
    assert given == [limits.grading_deadline(5), limits.grading_deadline(t)]
    assert all(isinstance(d, progress.WorkDeadline) for d in given)
    assert given[1] == progress.WorkDeadline(stall=t, cpu=3 * t, ceiling=30 * t)


# -- the count by reference (labsupport.checking.held) ------------------------------------

class Student:
    """A stand-in for a student's object: tensors in attributes, containers, closures."""

    def __init__(self):
        self.param = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
        self.optimizer = torch.optim.AdamW([self.param])
        self.buffers = {}


def test_held_counts_what_the_code_reaches_by_reference_only():
    s = Student()
    h = held.Held()
    h.snapshot([s])                                        # the parameter: there before
    s.param.grad = torch.ones(4, dtype=torch.float64)      # 32 B, reached through .grad
    s.buffers["a"] = [torch.ones(8, dtype=torch.float64)]  # 64 B in a dict of lists
    view = s.buffers["a"][0][:2]
    s.closure = (lambda: view)                             # a view: the same storage
    assert h.count([s]) == 32 + 64
    elsewhere = s.buffers.pop("a")                         # still alive, not reached
    assert h.count([s]) == 32 + 64                         # the closure's view holds it
    del s.closure
    assert h.count([s]) == 32                              # alive (elsewhere) but not held
    assert elsewhere[0].untyped_storage().nbytes() == 64


def test_held_leaves_optimizer_state_and_what_was_there_before():
    s = Student()
    s.param.grad = torch.ones(4, dtype=torch.float64)
    s.optimizer.step()                                     # exp_avg, exp_avg_sq: state
    h = held.Held()
    h.snapshot([s])
    assert h.count([s]) == 0
    s.param.grad = torch.ones(4, dtype=torch.float64)      # new since the snapshot
    assert h.count([s]) == 32
