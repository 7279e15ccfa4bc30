# Run: .venv/bin/python -m pytest tests/test_capstone_one_rank.py -p no:xdist
"""The capstone where a dimension has one rank: no collective on a group of one, the
step's breakdown booked to the groups the calls really used, and the timed one-process
baseline (``capstone.baseline``) that every layout's tokens/s is read against.

Sequence parallelism is off at tp = 1, as Megatron-LM turns it off, and the stage
keeps the decoder's own modules there, so a tp = 1 layout makes no call on its tp
group; the parity of every layout with one process is tests/test_capstone.py's.
No speed is asserted: the baseline's tests check what is timed and how, not how fast.
"""
import math
import sys

import cloudpickle
import pytest
import torch

import labsupport as ls
from labsupport import timing
from labsupport.capstone import baseline, breakdown, compare, trainer
from labsupport.tensor_parallel.tensor_parallel import TensorParallelBlock

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _one_rank_calls(layout):
    """(collectives on a group of one, every call, SP on?, TP blocks?) of this rank's
    last step."""
    out = trainer.train(layout, 2, record_timeline=True)
    calls = out["timeline"]["calls"]
    lonely = [c["op"] for c in calls if c["kind"] == "collective" and len(c["ranks"]) == 1]
    stage = trainer.build(layout, trainer.TrainConfig().gpt_config())[0]
    return dict(lonely=lonely, calls=len(calls), sp=stage.sequence_parallel,
                tp_blocks=any(isinstance(b, TensorParallelBlock)
                              for b in stage.blocks.values()))


@pytest.mark.parametrize("layout", [(1, 1, 1, 1), (2, 1, 2, 1), (1, 1, 1, 2), (1, 2, 1, 1)],
                         ids=lambda lay: "x".join(map(str, lay)))
def test_no_collective_runs_on_a_group_of_one_rank(layout):
    outs = ls.run(_one_rank_calls, layout, world_size=math.prod(layout), backend="gloo")
    tp = layout[1]
    for o in outs:
        assert o["lonely"] == [], o                     # before: 57 per step at 1x1x1x1
        assert o["sp"] == (tp > 1) and o["tp_blocks"] == (tp > 1), o
    if math.prod(layout) > 1:
        assert all(o["calls"] > 0 for o in outs)       # the real groups still talk


def test_sequence_parallelism_off_at_tp_1_keeps_parity():
    ref = trainer.reference(3, record_grads=(0,))
    for layout in [(1, 1, 1, 1), (1, 1, 2, 1)]:
        outs = ls.run(trainer.train, layout, 3, record_grads=(0,),
                      world_size=math.prod(layout), backend="gloo")
        p = compare.parity(outs, ref)
        assert p["step0_rel"] <= 1e-6 and p["grad_rel"] <= 1e-5 and p["curve_rel"] <= 1e-4, p


# --- the breakdown, booked to the groups the calls used ------------------------------
def _out(layout, rank, calls, events, start=0.0, end=10.0):
    return dict(layout=layout, rank=rank,
                timeline=dict(calls=calls, events=events, start=start, end=end))


def _collective(ranks, start, end):
    return dict(kind="collective", ranks=ranks, start=start, end=end, peer=None)


def _span(name, lane, start, end):
    return dict(name=name, lane=lane, start=start, end=end)


def test_a_sync_that_reduced_nothing_is_compute_not_dp_x_cp():
    # 1x1x2x1: no dp x cp group; the sync span (1 s) made no call: its work is local
    out = _out((1, 1, 2, 1), 0, [], [_span("F", "compute", 0, 4),
                                     _span("sync", "comm", 5, 6)])
    parts = breakdown.step_parts(out)
    assert parts["dp x cp"] == 0 and parts["compute"] == pytest.approx(5)


def test_the_sync_is_booked_to_the_group_it_reduced_over():
    tp_only = _out((1, 2, 1, 1), 0, [_collective((0, 1), 5.0, 5.5)],
                   [_span("sync", "comm", 5, 7)])
    parts = breakdown.step_parts(tp_only)
    assert parts["tp"] == pytest.approx(2) and parts["dp x cp"] == 0
    both = _out((2, 2, 1, 1), 0, [_collective((0, 1), 5.0, 5.5),
                                  _collective((0, 2), 6.0, 6.2)],
                [_span("sync", "comm", 5, 7)])
    parts = breakdown.step_parts(both)
    assert parts["tp"] == pytest.approx(0.5) and parts["dp x cp"] == pytest.approx(1.5)
    # a broken sync over the dp group alone (compare's variants) is still dp x cp
    dp_alone = _out((2, 1, 1, 2), 0, [_collective((0, 2), 5.0, 5.5)],
                    [_span("sync", "comm", 5, 7)])
    assert breakdown.step_parts(dp_alone)["dp x cp"] == pytest.approx(2)


def test_a_collective_on_a_group_of_one_is_booked_to_no_group():
    out = _out((1, 1, 1, 1), 0, [_collective((0,), 1.0, 2.0)],
               [_span("F", "compute", 0, 4)])
    parts = breakdown.step_parts(out)
    assert parts["tp"] == parts["dp x cp"] == parts["pp wait"] == 0
    assert parts["compute"] == pytest.approx(4)


def test_the_recorded_breakdown_has_no_part_for_a_missing_group():
    for layout, absent, present in [((1, 1, 2, 1), ("dp x cp", "tp"), "pp wait"),
                                    ((2, 1, 1, 1), ("tp", "pp wait"), "dp x cp")]:
        outs = ls.run(trainer.train, layout, 2, record_timeline=True,
                      world_size=math.prod(layout), backend="gloo")
        parts = breakdown.mean_parts(outs)
        assert all(parts[p] == 0 for p in absent), (layout, parts)
        assert parts[present] > 0, (layout, parts)


# --- the timed baseline ---------------------------------------------------------------
def test_alternated_takes_turns_and_returns_medians():
    order = []

    def measure(name, values):
        it = iter(values)
        return lambda: order.append(name) or next(it)

    r = timing.alternated({"a": measure("a", [3, 1, 2]), "b": measure("b", [9, 7, 8])}, 3)
    assert order == ["a", "b"] * 3
    assert (r["a"], r["b"]) == (2, 8) and r["runs"] == {"a": [3, 1, 2], "b": [9, 7, 8]}
    with pytest.raises(ValueError, match="repeats"):
        timing.alternated({"a": lambda: 1}, 0)


def test_the_reference_is_timed_as_train_times_itself_and_untimed_by_default():
    untimed = trainer.reference(2)
    assert untimed["tokens_per_s"] is None
    timed = trainer.reference(3, timed=True)                  # no process group here
    assert timed["tokens_per_s"] > 0 and timed["losses"] == trainer.reference(3)["losses"]
    before = torch.get_num_threads()
    assert baseline.plain_tokens_per_s(2, threads=1, batch=4, seq_len=16) > 0
    assert torch.get_num_threads() == before                  # threads left as found


def test_one_rank_overhead_runs_both_on_one_rank_in_turn():
    r = baseline.one_rank_overhead(steps=2, repeats=2, batch=4, seq_len=16,
                                   micro_batches=1)
    assert len(r["runs"]["trainer"]) == len(r["runs"]["plain"]) == 2
    assert r["ratio"] == pytest.approx(r["plain_tokens_per_s"] / r["trainer_tokens_per_s"])
    assert r["threads"] >= 1


# --- cores, not logical CPUs ------------------------------------------------------------
def test_physical_cores_are_counted_apart_from_logical_cpus(tmp_path, monkeypatch):
    from labsupport.capstone import flops
    # 4 logical CPUs, two hardware threads on each of 2 cores; this process may use 3
    entries = [f"processor\t: {i}\nmodel name\t: Some CPU\ncpu MHz\t\t: 2000.000\n"
               f"physical id\t: 0\ncore id\t\t: {i // 2}\n"
               "flags\t\t: fpu avx2 fma hypervisor\n" for i in range(4)]
    f = tmp_path / "cpuinfo"
    f.write_text("\n".join(entries))
    monkeypatch.setattr(flops.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    counts = flops.cpu_counts(str(f))
    assert (counts["affinity"], counts["cores"], counts["virtual"]) == (3, 2, True)
    peak = flops.cpu_theoretical_peak(str(f))
    assert peak["cores"] == 2 and peak["low"] == pytest.approx(2 * 2e9 * 8 * 2)
