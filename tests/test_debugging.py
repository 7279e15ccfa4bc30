# Run: .venv/bin/python -m pytest tests/test_debugging.py -p no:xdist   (~90 s: every fault runs)
"""Chapter 12's tooling: every fault of the zoo named by its tool, nothing left running; the
Flight Recorder normaliser on real dumps; the launcher's report of a hang; straggler
attribution; the your-turn checks (reference passes, stub not written, slips named)."""
import json
import os
from pathlib import Path

import psutil
import pytest

import labsupport as ls
from labsupport.debugging import bench, checks, gather, straggler, zoo
from labsupport.launch import flight
from nbtools import assert_lesson_copy, notebook_definitions

pytestmark = pytest.mark.slow
CHAPTER = Path(__file__).resolve().parents[1] / "notebooks/12_debugging_distributed_runs.ipynb"
TIMEOUT = 4.0   # each fault's deadline; ample: a hang is named at its end


@pytest.fixture(scope="module")
def runs():
    """Every fault, run once: {name: (artefacts, seconds, error, ranks left over)}."""
    out = {}
    for name, fault in zoo.FAULTS.items():
        art, seconds, error = gather.run_fault(fault, timeout=TIMEOUT)
        out[name] = (art, seconds, error, bench.leftover_ranks())
    yield out
    ls.shutdown()


@pytest.mark.parametrize("name", list(zoo.FAULTS))
def test_each_fault_is_named_by_its_tool_and_leaves_nothing_running(runs, name):
    art, seconds, error, left = runs[name]
    fault = zoo.FAULTS[name]
    said = gather.named(fault, art, error)
    assert said["named"], f"{name}: {fault.tool} said {said['said']!r}, expected {fault.expect}"
    assert left == 0, f"{name}: {left} rank processes left behind"
    assert (error is not None) == (fault.hangs or fault.expect["kind"] in ("mismatch", "hang")
                                   or fault.detail)
    json.dumps(art)    # the artefacts survive JSON


def test_a_hang_is_reported_within_twice_its_deadline(runs):
    slow = {n: s for n, (_, s, _, _) in runs.items() if s > 2 * TIMEOUT + 5}
    assert not slow, slow


def test_no_rank_process_outlives_the_groups():
    ls.shutdown()
    from labsupport.launch import forkserver
    server = forkserver.current()
    if server is not None:
        kids = psutil.Process(server.proc.pid).children(recursive=True)
        assert [p for p in kids if p.status() != psutil.STATUS_ZOMBIE] == []


def test_the_normaliser_on_real_dumps(runs):
    art, _, error, _ = runs["slow_path_collective"]
    fr = art["flight_recorder"]
    assert set(fr) == {"0", "1", "2"}
    last = {r: entries[-1] for r, entries in fr.items()}
    assert last["1"]["op"] == "all_gather" and last["1"]["seq"] == 2
    assert last["0"]["op"] == "all_reduce" and last["0"]["seq"] == 2
    e = last["0"]
    assert e["group"] == "default_pg" and e["group_ranks"] == [0, 1, 2]
    assert e["shapes"] == [[4]] and e["dtypes"] == ["Float"] and e["state"] == "scheduled"
    inner = e["frames"][-1]
    assert os.path.basename(inner["file"]) == "zoo.py" and inner["name"] == "slow_path_collective"
    assert not any("torch" + os.sep in f["file"] for f in e["frames"])
    # the raw record carries the group table the dump's pg_config lacks
    raw = error.flight_recorder[0]
    assert raw["groups"]["0"] == [0, 1, 2] and raw["pg_config"].get("0") is None


def test_the_launchers_report_names_op_and_sequence_number_per_rank(runs):
    _, _, error, _ = runs["eval_on_rank_zero"]
    text = str(error)
    assert "group default_pg: the ranks part at sequence number 2" in text
    assert "rank 0: all_reduce shapes=[[1]]" in text and "in evaluate" in text
    assert "rank 1: issued no #2" in text
    assert error.reason == "deadline"


def test_where_they_part_on_made_up_records():
    def e(seq, op, shape=(4,)):
        return dict(seq=seq, op=op, group="g", group_ranks=[0, 1],
                    shapes=[list(shape)], dtypes=["Float"], frames=[])
    same = {0: [e(1, "all_reduce")], 1: [e(1, "all_reduce")]}
    assert flight.where_they_part(same) == []
    shape = {0: [e(1, "all_reduce"), e(2, "all_reduce")], 1: [e(1, "all_reduce"),
                                                           e(2, "all_reduce", (5,))]}
    assert [(p["group"], p["seq"]) for p in flight.where_they_part(shape)] == [("g", 2)]
    missing = {0: [e(1, "all_reduce")], 1: []}
    assert flight.where_they_part(missing)[0]["calls"] == {0: missing[0][0], 1: None}


def test_torchfrtrace_fails_on_gloo_dumps_and_works_once_repaired(runs):
    _, _, error, _ = runs["slow_path_collective"]
    broken = gather.torchfrtrace(error.flight_recorder)
    assert broken.returncode != 0 and "KeyError" in broken.stderr
    fixed = gather.torchfrtrace(error.flight_recorder, repair=True)
    out = fixed.stdout + fixed.stderr
    assert fixed.returncode == 0 and "Culprit rank 1" in out and "sequence number: 2" in out


def test_straggler_attribution_and_phase_times_that_hide_it(runs):
    art = runs["straggler"][0]
    assert straggler.late_rank(art["collective_times"]) == 2
    totals = {r: sum(p.values()) for r, p in art["phase_times"].items()}
    assert max(totals, key=totals.get) != "2"       # the phases point elsewhere
    made_up = {"0": [dict(seq=1, op="all_reduce", group="g", enter=1.0, exit=2.0)],
               "1": [dict(seq=1, op="all_reduce", group="g", enter=1.9, exit=2.0)]}
    assert straggler.late_rank(made_up) == 1
    assert straggler.waits(made_up) == pytest.approx({"0": 1.0, "1": 0.1})


def test_the_lesson_matches_the_notebook():
    assert_lesson_copy(straggler)


def _solution(name):
    namespace = {"os": os, "flight": flight, "ls": ls}
    exec(notebook_definitions(CHAPTER)[name], namespace)
    return namespace[name]


def test_lateness_check(runs, capsys):
    times = runs["straggler"][0]["collective_times"]
    assert checks.check_lateness(_solution("lateness"), times)
    for slip, word in (({r: sum(c["exit"] - c["enter"] for c in cs) for r, cs in times.items()},
                        "exit - enter"),):
        with pytest.raises(AssertionError, match=word):
            checks.check_lateness(lambda t, s=slip: s, times)
    with pytest.raises(AssertionError, match="mean arrival"):
        checks.check_lateness(_mean_based, times)
    with pytest.raises(AssertionError, match="position"):
        checks.check_lateness(_by_position, checks._made_up_times())

    def stub(t):
        raise ls.NotWritten("lateness")
    assert ls.your_turn.check(lambda: checks.check_lateness(stub, times), "lateness") is None
    assert "not written yet" in capsys.readouterr().out


def _mean_based(times):
    return checks._slips(times)["measured from the mean arrival: lateness is counted from the "
                                "first rank to enter the same collective (who waited for "
                                "whom), so no rank is negative"]


def _by_position(times):
    out = {}
    for r, calls in times.items():
        out[r] = sum(c["enter"] - min(o[i]["enter"] for o in times.values() if i < len(o))
                     for i, c in enumerate(calls))
    return out


def test_parting_lines_check(runs, capsys):
    fr = runs["branch_on_local_value"][0]["flight_recorder"]
    assert checks.check_parting_lines(_solution("parting_lines"), fr)

    def outermost(recs):
        parts = flight.where_they_part(recs)
        return {str(r): None if e is None else
                f"{os.path.basename(e['frames'][0]['file'])}:{e['frames'][0]['line']}"
                for r, e in parts[0]["calls"].items()}

    def last_entry(recs):
        return {str(r): f"{os.path.basename(es[-1]['frames'][-1]['file'])}:"
                        f"{es[-1]['frames'][-1]['line']}" for r, es in recs.items()}
    with pytest.raises(AssertionError, match="outermost"):
        checks.check_parting_lines(outermost, checks._made_up_records())
    with pytest.raises(AssertionError, match="last entry"):
        checks.check_parting_lines(last_entry, checks._made_up_records())
    with pytest.raises(AssertionError, match="expected"):
        checks.check_parting_lines(lambda recs: {}, checks._made_up_records())

    def stub(recs):
        raise ls.NotWritten("parting_lines")
    assert ls.your_turn.check(lambda: checks.check_parting_lines(stub, fr),
                              "parting_lines") is None
    assert "not written yet" in capsys.readouterr().out


def test_normalise_keeps_the_default_group_under_detail_and_drops_the_wrappers():
    def entry(pg_id, name, op, seq):
        return dict(
            record_id=seq, pg_id=pg_id, process_group=name, profiling_name=f"gloo:{op}",
            collective_seq_id=seq, p2p_seq_id=0, is_p2p=False, input_sizes=[[4]],
            input_dtypes=["Float"], state="scheduled", frames=[], time_created_ns=seq)
    detail = {"entries": [entry(1, ("", ""), "all_gather", 3),
                          entry(0, ("", ""), "all_reduce", 1)],
              "groups": {"0": [0, 1]}}
    out = flight.normalise(detail)
    assert [(e["group"], e["op"], e["seq"], e["group_ranks"]) for e in out] == \
        [("default_pg", "all_reduce", 1, [0, 1])]
    plain = {"entries": [entry(0, ("0", "default_pg"), "all_reduce", 1),
                         entry(1, ("1", "undefined"), "broadcast", 1)],
             "groups": {"0": [0, 1, 2], "1": [0, 2]}}
    assert [(e["group"], e["group_ranks"]) for e in flight.normalise(plain)] == \
        [("default_pg", [0, 1, 2]), ("1", [0, 2])]
    assert flight.normalise(None) == [] and flight.describe({}) == ""


def test_a_hang_with_the_recorder_off_is_reported_without_its_lines():
    fault = zoo.FAULTS["slow_path_collective"]
    with gather.environment(TORCH_FR_BUFFER_SIZE="0"):
        cluster = ls.start(world_size=fault.world_size)
    art, _, error = gather.run_fault(fault, timeout=TIMEOUT, cluster=cluster)
    assert isinstance(error, ls.RankTimeout) and "Flight Recorder" not in str(error)
    assert all(entries == [] for entries in art["flight_recorder"].values())
    assert "stopped here" in str(error)
    ls.shutdown()


def test_the_first_replica_difference_is_the_earliest_over_every_group():
    # group [1, 3, 5] parts at step 2 though it is listed second; [0, 2, 4] at step 3
    art = {"replica_groups": [[0, 2, 4], [1, 3, 5]],
           "replica_checksums": {"0": [1, 1, 1, 9], "2": [1, 1, 1, 1], "4": [1, 1, 1, 1],
                                 "1": [2, 2, 2, 2], "3": [2, 2, 7, 7], "5": [2, 2, 2, 2]}}
    assert gather.first_replica_difference(art) == (2, [3])
    art["replica_checksums"]["3"] = [2, 2, 2, 2]
    assert gather.first_replica_difference(art) == (3, [0])
    art["replica_checksums"]["0"] = [1, 1, 1, 1]
    assert gather.first_replica_difference(art) == (None, [])
