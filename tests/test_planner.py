# Run: .venv/bin/python -m pytest tests/test_planner.py
"""labsupport.planner: the layouts, memory from chapter 0's calculator, traffic, placement."""
import pytest

from labsupport import memory_calc, planner

M = memory_calc.PRESETS["7B"]
KW = dict(seq=4096, global_batch=512, devices=64, device_bytes=80e9, gpus_per_node=8,
          intra_bw=450e9, inter_bw=50e9)


def test_layouts_multiply_to_the_device_count():
    rows = planner.layouts(8)
    assert all(dp * tp * pp * cp == 8 for dp, tp, pp, cp in rows)
    assert len(rows) == len(set(rows)) == 20   # 8 = 2^3 into 4 ordered factors: C(6, 3)


def test_memory_is_the_calculators_for_a_single_dimension():
    want = memory_calc.training_memory(M, 4096, 1, "mixed", "selective", n=8,
                                       parallelism="tp+sp")
    got = planner.device_memory(M, 4096, 1, tp=8, pp=1, cp=1, precision="mixed",
                                checkpointing="selective")
    assert got == pytest.approx(want)
    dp_only = planner.device_memory(M, 4096, 1, 1, 1, 1, "mixed", "none")
    assert dp_only == pytest.approx(memory_calc.training_memory(M, 4096, 1, "mixed", "none"))


def test_traffic_zero_on_size_one_dimensions_and_the_dp_all_reduce():
    sent = planner.traffic(M, 4096, 512, 1, (64, 1, 1, 1), "mixed")
    assert sent["tp"] == sent["pp"] == sent["cp"] == 0
    assert sent["dp"] == pytest.approx(2 * 63 / 64 * 2 * M.psi)


def test_tensor_parallelism_across_nodes_is_flagged_and_everything_fits():
    rows = planner.plan(M, **KW)
    assert rows and all(r["memory"]["total"] <= KW["device_bytes"] for r in rows)
    assert {r["tp_across_nodes"] for r in rows} == {True, False}
    assert all(r["tp_across_nodes"] == (r["layout"][1] > 8) for r in rows)
    assert [r["comm_s"] for r in rows] == sorted(r["comm_s"] for r in rows)


def test_nothing_fits_in_a_tiny_device_and_bad_input_is_refused():
    assert planner.plan(M, **(KW | dict(device_bytes=1e6))) == []
    with pytest.raises(ValueError, match="must be >= 1"):
        planner.plan(M, **(KW | dict(devices=0)))


def test_seconds_are_each_axis_bytes_over_its_links_bandwidth():
    row = next(r for r in planner.plan(M, **KW) if r["layout"] == (8, 8, 1, 1))
    assert row["seconds"]["tp"] == pytest.approx(row["traffic"]["tp"] / KW["intra_bw"])
    assert row["seconds"]["dp"] == pytest.approx(row["traffic"]["dp"] / KW["inter_bw"])
    assert row["comm_s"] == pytest.approx(sum(row["seconds"].values()))
