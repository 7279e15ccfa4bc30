# Run: PYTHONPATH=$PWD .venv/bin/python -m pytest tests/test_grading_diagnose_the_job.py \
#   -p no:xdist   (~2 min; -m "not slow": the cases and the checks alone, ~40 s)
"""Graded assignment 10 (diagnose the job): labsupport.grading.diagnose_the_job, then nbgrader.

Layer 1 (unit): the cases are what the contract says and hold what each kind
of fault leaves (a disagreement at the injected seq only where it was
injected, a late rank, a diverged replica, the noise that misleads), none
of the hidden ones is in the notebook; the reference (the source notebook's,
``sources.reference``) gets every point on the examples and on the hidden
cases of several seeds; the untouched notebook gets 0 with a message that
says where to write; each plausible wrong answer, written as an edit of the
reference, loses the points of the cases it gets wrong, with a message that
says what was wrong in each: a verdict that always names rank 0; the last
disagreeing seq instead of the first; the ranks scanned before the seqs; a
straggler named from the phase times; the Flight Recorder alone; a diagnose
that raises (KeyError on an absent key) and one that loops (stopped by the
graders' deadline, the case named). Layer 4 (slow): `nbgrader
generate_assignment`, `autograde` and `export` with seven submissions whose
scores, per cell (partial credit: the points a hidden cell returns) and in
the exported CSV, are known.
"""
import json
import os
import re
import subprocess
import sys
import time

import pytest

import sources
from failing import fails
from labsupport.grading import diagnose_the_job as dj
from labsupport.grading.diagnose_the_job import cases as dc
from nbgrader_run import RoundTrip, assert_release_only, errors, scores

ASSIGNMENT = "diagnose_the_job"
SEEDS = (4817, 100, 31337)  # the notebook's hidden seed, then others
SHORT = 2.0  # s, deadline of the unit test that loops on purpose
ref = sources.reference(ASSIGNMENT)

SCAN_RANKS = '''
def first_conflict(flight_recorder):
    """Each rank in turn: its first entry that differs from the others' at that seq."""
    by_call = {}
    for rank, entries in flight_recorder.items():
        for e in entries:
            if e["op"] not in ("send", "recv"):
                by_call.setdefault((e["group"], e["seq"]), {})[int(rank)] = e
    for rank in sorted(flight_recorder, key=int):
        for e in flight_recorder[rank]:
            if e["op"] in ("send", "recv"):
                continue
            calls = by_call[e["group"], e["seq"]]
            sig = {r: (c["op"], str(c["shapes"]), str(c["dtypes"])) for r, c in calls.items()}
            odd, usual = odd_ones_out(sig)
            if int(rank) in odd:
                kind = "desync" if e["op"] != usual[0] else "mismatch"
                return verdict(kind, [int(rank)], op=e["op"], seq=e["seq"], group=e["group"])
    return None
'''.strip()
PHASES = '''
def straggler(phase_times):
    """The rank that looks slowest in the phase times."""
    totals = {int(r): sum(p.values()) for r, p in phase_times.items()}
    if not totals:
        return None
    top = max(totals, key=totals.get)
    return top if totals[top] > 1.02 * sorted(totals.values())[len(totals) // 2] else None
'''.strip()
LOOP = '''
def straggler(collective_times):
    """Counts which rank waits least: forgets to move on to the next entry."""
    least = Counter()
    for rank, entries in collective_times.items():
        i = 0
        while i < len(entries):
            least[rank] += 0
    return None
'''.strip()


def _function(name, new):
    """An edit that replaces the function ``name`` of the solution cell by ``new``."""
    def edit(src):
        start = src.index(f"def {name}(")
        end = src.find("\n\n\ndef ", start)
        return src[:start] + new + ("" if end < 0 else src[end:])
    return edit


def _phases(src):
    src = _function("straggler", PHASES)(src)
    return sources.replaced(('straggler(artefacts.get("collective_times") or {})',
                             'straggler(artefacts.get("phase_times") or {})'))(src)


EDITS = {  # name -> the reference's solution cell, edited
    "rank0": sources.replaced(('    return found or verdict("healthy")',
                               '    return dict(found or verdict("healthy"), ranks=[0])')),
    "last_seq": sources.replaced(("min(conflicts, key=lambda key: key[1])",
                                  "max(conflicts, key=lambda key: key[1])")),
    "scan_ranks": _function("first_conflict", SCAN_RANKS),
    "phases": _phases,
    "fr_only": sources.replaced(("    if found is None:\n        found = from_detail",
                                 '    return found or verdict("healthy")\n'
                                 "    if found is None:\n        found = from_detail")),
    "raises": sources.replaced(('first_conflict(artefacts.get("flight_recorder") or {})',
                                'first_conflict(artefacts["flight_recorder"])')),
    "loops": _function("straggler", LOOP),
}


def untouched_source(src):
    """The student version of the solution cell: each region replaced by the stub."""
    out, inside = [], False
    for line in src.splitlines():
        if line.strip() == "### BEGIN SOLUTION":
            inside = True
            out.append(line[:line.index("#")] + "raise NotImplementedError()")
        elif line.strip() == "### END SOLUTION":
            inside = False
        elif not inside:
            out.append(line)
    return "\n".join(out)


def wrong(name):
    edit = untouched_source if name == "untouched" else EDITS[name]
    return sources.reference(ASSIGNMENT, {"diagnose": edit}, name).diagnose


def points(diagnose, part, seed=SEEDS[0]):
    return dj.grade(diagnose, part, seed, points=4)


# -- layer 1: the cases ------------------------------------------------------------------

def test_the_cases_are_the_contracts_dicts_and_survive_json():
    for case in dj.examples() + dj.hidden_cases("hangs", 100) + dj.hidden_cases("quiet", 100):
        a = case.artefacts
        assert json.loads(json.dumps(a)) == a
        assert set(a) <= {"world_size", "timeout_s", "flight_recorder", "messages",
                          "collective_times", "phase_times", "replica_checksums",
                          "replica_groups"}
        assert 2 <= a["world_size"] <= 16
        for key in ("flight_recorder", "messages", "collective_times", "phase_times"):
            assert set(a.get(key, {})) <= {str(r) for r in range(a["world_size"])}, key
        for entries in a.get("flight_recorder", {}).values():
            for e in entries:
                assert set(e) == {"seq", "op", "group", "group_ranks", "shapes", "dtypes",
                                  "state", "frames"}
                assert e["op"] in dc.OP_TYPE and e["frames"][-1]["name"] == e["op"]
        assert set(case.verdict) == set(dj.FIELDS) and case.verdict["kind"] in dj.KINDS


def test_each_seed_makes_other_cases_and_the_same_seed_the_same_ones():
    for part in dj.PARTS:
        a, b = dj.hidden_cases(part, 100), dj.hidden_cases(part, 100)
        assert [c.artefacts for c in a] == [c.artefacts for c in b]
        other = dj.hidden_cases(part, 101)
        assert all(x.artefacts != y.artefacts for x, y in zip(a, other))
    assert len(dj.hidden_cases("hangs", 100) + dj.hidden_cases("quiet", 100)) >= 10
    with pytest.raises(ValueError, match="100 and more"):
        dj.hidden_cases("hangs", 7)


def test_the_same_seed_gives_the_same_cases_in_another_process():
    """No hash order, no clock: another process (another PYTHONHASHSEED) makes the
    same bytes, so a regrade on another machine gives the same marks."""
    code = ("import hashlib, json; from labsupport.grading import diagnose_the_job as dj; "
            "print(hashlib.sha256(json.dumps([[c.artefacts, c.verdict] for p in dj.PARTS "
            "for c in dj.hidden_cases(p, 4817)]).encode()).hexdigest())")
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True, cwd=sources.ROOT,
                              env=dict(os.environ, PYTHONHASHSEED=seed)).stdout
               for seed in ("1", "2")}
    assert len(digests) == 1, digests


def test_no_hidden_case_is_in_the_notebook():
    shown = [json.dumps(c.artefacts, sort_keys=True) for c in dj.examples()]
    for seed in SEEDS:
        for part in dj.PARTS:
            for case in dj.hidden_cases(part, seed):
                assert json.dumps(case.artefacts, sort_keys=True) not in shown


def _signatures(fr, group, seq):
    return {r: (e["op"], str(e["shapes"]), str(e["dtypes"])) for r, entries in fr.items()
            for e in entries if e["group"] == group and e["seq"] == seq
            and e["op"] not in dc.P2P}


def test_a_hang_disagrees_first_at_the_injected_seq_on_the_injected_ranks():
    for case in dj.hidden_cases("hangs", 100)[:5]:   # the sixth is DETAIL's
        v, fr = case.verdict, case.artefacts["flight_recorder"]
        for seq in range(1, v["seq"]):
            assert len(set(_signatures(fr, v["group"], seq).values())) == 1, (case.label, seq)
        at = _signatures(fr, v["group"], v["seq"])
        odd = sorted(int(r) for r, s in at.items()
                     if list(at.values()).count(s) <= len(at) // 2)
        assert odd == v["ranks"], case.label
        for group in {e["group"] for entries in fr.values() for e in entries} - {v["group"]}:
            seqs = {e["seq"] for entries in fr.values() for e in entries if e["group"] == group}
            assert all(len(set(_signatures(fr, group, s).values())) == 1 for s in seqs)


def test_the_traps_are_in_the_hidden_cases():
    hangs = dj.hidden_cases("hangs", 100)
    assert hangs[2].notes["last_seq"] > hangs[2].verdict["seq"]        # later conflicts
    assert hangs[2].notes["scan"] < hangs[2].verdict["ranks"][0]      # a lower rank, later
    assert any(e["op"] in dc.P2P for entries in hangs[3].artefacts["flight_recorder"].values()
               for e in entries)
    assert "Detected mismatch between collectives" in hangs[5].artefacts["messages"]["0"]
    quiet = dj.hidden_cases("quiet", 100)
    for case in quiet:
        phases = case.artefacts["phase_times"]
        total = {int(r): sum(p.values()) for r, p in phases.items()}
        assert max(total, key=total.get) == case.notes["decoy"] not in case.verdict["ranks"]
    assert all(0 not in c.verdict["ranks"] for c in quiet)  # always rank 0 must fail them


def test_a_straggler_waits_least_where_the_others_wait_and_a_healthy_run_has_none():
    for case in dj.hidden_cases("quiet", 100):
        late = case.verdict["ranks"][0] if case.kind == "straggler" else None
        dc._assert_margin(case.artefacts["collective_times"], late)   # raises if not


# -- layer 1: the checks -----------------------------------------------------------------

def test_the_reference_gets_every_point_on_the_examples_and_hidden_cases():
    dj.check_examples(ref.diagnose)
    for seed in SEEDS:
        for part in dj.PARTS:
            assert points(ref.diagnose, part, seed) == 4.0, (part, seed)


def test_the_untouched_notebook_scores_zero_and_says_where_to_write():
    text = fails(points, wrong("untouched"), "hangs")
    assert "earned 0 of 4 points" in text and "raised NotImplementedError" in text
    assert text.endswith("Write your solution in place of `raise NotImplementedError()` "
                         "(every case raised it).")
    assert "examples are not right" in fails(dj.check_examples, wrong("untouched"))


def test_always_rank_0_fails_the_stragglers_and_the_replicas(capsys):
    rank0 = wrong("rank0")
    assert points(rank0, "hangs") == 3.0       # right where rank 0 is at fault
    assert points(rank0, "quiet") == 2.0       # kinds right, every rank wrong
    out = capsys.readouterr().out
    assert "(straggler, " in out and "you said ranks = [0]" in out
    assert "the late rank is the one that waits least inside each collective" in out
    assert "the diverged rank is the one whose checksum differs from the rest of its " \
           "replica group" in out
    assert "a healthy run names no rank: ranks = []" in out


def test_the_last_disagreeing_seq_is_not_the_first(capsys):
    got = points(wrong("last_seq"), "hangs")
    assert got < 4.0
    assert "the last seq where the entries disagree; the first one is the fault" in \
        capsys.readouterr().out
    assert points(wrong("last_seq"), "quiet") == 4.0


def test_scanning_the_ranks_before_the_seqs_names_a_later_deviation(capsys):
    assert points(wrong("scan_ranks"), "hangs") < 4.0
    out = capsys.readouterr().out
    assert "that rank's entries differ only at a later seq; walk the seqs in order, " \
           "not the ranks" in out


def test_a_straggler_named_from_the_phase_times_loses_the_quiet_cases(capsys):
    assert points(wrong("phases"), "hangs") == 4.0
    assert points(wrong("phases"), "quiet") < 2.0
    out = capsys.readouterr().out
    assert "that rank looks slowest in phase_times and is late at one collective only" in out
    assert "you said kind = 'straggler', but nothing is wrong in this run" in out


def test_the_flight_recorder_alone_fails_the_quiet_cases_and_detail(capsys):
    fr_only = wrong("fr_only")
    assert points(fr_only, "quiet") == pytest.approx(4 / 3, abs=0.01)  # the healthy two
    assert points(fr_only, "hangs") == pytest.approx(10 / 3, abs=0.01)  # not DETAIL's
    out = capsys.readouterr().out
    assert "you said kind = 'healthy', but the run did not hang, and one rank waits least" \
        in out
    assert "This run left no flight_recorder: DETAIL's messages give each rank's " \
           "fingerprint" in out


def test_an_exception_costs_its_case_with_the_line_and_what_to_do(capsys):
    got = points(wrong("raises"), "hangs")
    assert 0 < got < 4.0
    out = capsys.readouterr().out
    assert "raised KeyError: 'flight_recorder' (every key but world_size may be absent " \
           "from a case: artefacts.get(key))" in out
    assert re.search(r"flight_recorder' \(every key .*\)\n    line \d+, in diagnose", out)


def test_a_loop_ends_at_the_deadline_and_names_its_case():
    t0 = time.monotonic()
    text = fails(dj.grade, wrong("loops"), "quiet", SEEDS[0], timeout=SHORT)
    assert "diagnose did not return" in text and "(on case 1 (straggler, " in text
    assert "Look for a loop whose condition never changes." in text
    assert time.monotonic() - t0 < 30 * SHORT + 60   # the last-resort ceiling, at most


def test_garbage_is_reported_not_crashed_on():
    case = dj.examples()[3]
    share, problems = dj.mark(case, "straggler")
    assert share == 0 and "return a dict with the keys kind, ranks" in problems[0]
    share, problems = dj.mark(case, {"kind": "straggler", "ranks": "4"})
    assert share == dj.WEIGHTS["straggler"]["kind"]
    assert problems == ["ranks is '4'; give a list of ints (global ranks)"]
    with pytest.raises(TypeError, match="pass your function"):
        dj.grade("diagnose", "hangs", 100)


# -- layer 4: nbgrader on assignment 10 ----------------------------------------------------

SUBMISSIONS = {"reference": {}, "untouched": None,
               **{name: {"diagnose": EDITS[name]}
                  for name in ("rank0", "last_seq", "phases", "fr_only", "raises")}}
CELLS = {"test_examples": 2, "test_hangs": 4, "test_quiet": 4}


def _expected():
    """Each submission's points per cell, from the checks above (the unit layer)."""
    out = {}
    for name in SUBMISSIONS:
        fn = ref.diagnose if name == "reference" else wrong(name)
        got = {}
        try:
            dj.check_examples(fn)
            got["test_examples"] = 2.0
        except AssertionError:
            got["test_examples"] = 0.0
        for cell, part, seed in (("test_hangs", "hangs", 4817), ("test_quiet", "quiet", 9203)):
            try:
                got[cell] = dj.grade(fn, part, seed, points=4)
            except AssertionError:
                got[cell] = 0.0
        out[name] = got
    return out


SAYS = {  # submission -> {cell: text its error (0 points) or its printed report holds}
    "untouched": dict.fromkeys(CELLS, "NotImplementedError"),
    "rank0": {"test_quiet": "you said ranks = [0]"},
    "last_seq": {"test_hangs": "the last seq where the entries disagree"},
    "phases": {"test_quiet": "that rank looks slowest in phase_times"},
    "fr_only": {"test_quiet": "you said kind = 'healthy', but the run did not hang"},
    "raises": {"test_hangs": "raised KeyError: 'flight_recorder'"},
}


class TestNbgrader(RoundTrip):
    assignment, submissions, cells = ASSIGNMENT, SUBMISSIONS, CELLS
    stubs, hidden = 6, ('"hangs", seed=4817', '"quiet", seed=9203')
    try_cell, try_fails = "try-diagnose", ()  # it reports, never fails
    # Partial credit: a hidden cell's value is its points (nbgrader reads a number
    # as the score), so the expected scores are the unit layer's, per cell.
    failed = {name: {} for name in SUBMISSIONS}
    totals = {}
    # Three submissions are graded beside the others (autograde's `beside`): no
    # grade here reads a clock or the allocator (tests/test_grades_deterministic.py).
    beside = ("phases", "fr_only", "raises")

    @pytest.fixture(scope="class")
    def expected(self):
        return _expected()

    @pytest.mark.slow
    def test_exported_grades_are_the_expected_totals(self, graded, expected):
        import csv
        rows = {}
        for course in set(graded["courses"].values()):  # the students graded beside too
            with open(course / "grades.csv", newline="") as f:
                rows.update((row["student_id"], row) for row in csv.DictReader(f))
        for name, cells in expected.items():
            assert float(rows[name]["score"]) == pytest.approx(sum(cells.values())), name
            assert float(rows[name]["max_score"]) == sum(CELLS.values())
        assert sum(expected["reference"].values()) == 10 and \
            sum(expected["untouched"].values()) == 0
        wrong_ones = [n for n in ("rank0", "last_seq", "phases", "fr_only", "raises")]
        assert all(sum(expected[n].values()) < 10 for n in wrong_ones), expected

    @pytest.mark.slow
    def test_each_test_cell_scores_as_expected_with_a_helpful_message(self, graded, student,
                                                                      expected):
        got = scores(graded, student, CELLS)
        assert got == pytest.approx(expected[student]), (student, got)
        errs = errors(graded, student)
        printed = _printed(graded, student)
        for cell, text in SAYS.get(student, {}).items():
            cid = cell.replace("_", "-")
            assert text in errs[cid] + printed[cid], (student, cell, errs[cid], printed[cid])
        erred = errs[self.try_cell] != ""
        assert erred == (student in self.try_fails), (self.try_cell, erred)

    @pytest.mark.slow
    def test_the_student_version_has_stubs_and_no_hidden_tests(self, graded):
        release = assert_release_only(graded)
        for text in self.hidden:
            assert text not in release
        assert release.count("raise NotImplementedError()") == self.stubs


def _printed(graded, student):
    from nbgrader_run import autograded
    return {c.id: "".join(o.get("text", "") for o in c.outputs if o.output_type == "stream")
            for c in autograded(graded, student).cells if c.cell_type == "code"}
