# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_sweep.py
"""The bandwidth sweep of collectives (labsupport.sweep) and
the plot helpers of chapters 1-2 (labsupport.diagrams).

No speed is asserted (machines are noisy): the tests check the conventions,
the fit, the bookkeeping, that measured fields are the only thing nbval's
sanitizer masks, and the errors for bad input.
"""
import configparser
import math
import re
from pathlib import Path

import pytest
import torch

import labsupport as ls
from labsupport import diagrams, sweep
from labsupport.ring import ring

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("kind, n, factor", [
    ("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5), ("all_gather", 4, 0.75),
    ("reduce_scatter", 2, 0.5), ("all_to_all", 4, 0.75), ("broadcast", 4, 1.0),
    ("reduce", 8, 1.0), ("scatter", 4, 0.75), ("gather", 2, 0.5), ("sendrecv", 4, 1.0)])
def test_busbw_factors_are_nccl_tests(kind, n, factor):
    assert sweep.busbw_factor(kind, n) == factor


def test_an_unknown_collective_names_the_known_ones():
    with pytest.raises(ValueError, match="all_reduce, all_gather"):
        sweep.busbw_factor("allreduce", 2)


def test_sizes():
    assert sweep.sizes(1024, 8192) == [1024, 2048, 4096, 8192]
    assert sweep.sizes(1 << 10, 64 << 20, step=4)[-1] == 64 << 20
    assert sweep.sizes(1000, 1000) == [1000]
    for bad in [dict(smallest=0), dict(largest=2.5), dict(step=1), dict(smallest=10, largest=5)]:
        with pytest.raises(ValueError):
            sweep.sizes(**bad)


def test_the_fit_recovers_alpha_and_beta():
    alpha, beta = 50e-6, 2e9
    sizes = sweep.sizes(1 << 10, 64 << 20)
    fitted = sweep.fit_alpha_beta(sizes, [alpha + s / beta for s in sizes])
    assert fitted == pytest.approx((alpha, beta), rel=1e-9)


def test_the_fit_keeps_alpha_non_negative():
    sizes = sweep.sizes(1 << 10, 64 << 20)
    times = [s / 1e9 for s in sizes]
    times[0] /= 2  # a lucky fast call at the smallest size
    alpha, beta = sweep.fit_alpha_beta(sizes, times)
    assert alpha == 0 and beta == pytest.approx(1e9, rel=0.2)


@pytest.mark.parametrize("sizes, times, match", [
    ([1024], [1e-3], "at least 2"), ([1, 2, 3], [1, 2], "equally long"),
    ([1024, 0], [1e-3, 1e-3], "positive"), ([1024, 2048], [2e-3, 1e-3], "do not grow")])
def test_the_fit_refuses_bad_data(sizes, times, match):
    with pytest.raises(ValueError, match=match):
        sweep.fit_alpha_beta(sizes, times)


def _sanitize(text):
    config = configparser.ConfigParser()
    config.read(ROOT / "tests" / "nbval_sanitize.cfg")
    for section in config.sections():
        text = re.sub(config[section]["regex"], config[section]["replace"], text)
    return text


def test_the_table_masks_timings_and_nothing_else():
    fast = [sweep.Row("ring", 2, 1 << 10, 1.2e-4, 8.5e6, 8.5e6)]
    slow = [sweep.Row("ring", 2, 1 << 10, 12.345, 83.0, 83.0)]
    assert _sanitize(sweep.table(fast)) == _sanitize(sweep.table(slow))
    other = [sweep.Row("ring", 4, 1 << 10, 1.2e-4, 8.5e6, 8.5e6)]
    assert _sanitize(sweep.table(fast)) != _sanitize(sweep.table(other))
    assert "1 KiB" in _sanitize(sweep.table(fast))


def test_format_size_and_ratio():
    assert [sweep.format_size(s) for s in (1024, 3 << 20, 1 << 30, 1000)] == \
        ["1 KiB", "3 MiB", "1 GiB", "1000 B"]
    rows = [sweep.Row("a", 2, 64, 1.0, 2.0, 2.0), sweep.Row("b", 2, 64, 1.0, 4.0, 4.0)]
    assert sweep.ratio(rows, "a", "b", 64) == 0.5
    with pytest.raises(ValueError, match="no row"):
        sweep.ratio(rows, "a", "c", 64)


@pytest.fixture(scope="module")
def cluster():
    c = ls.start(world_size=2, backend="gloo")
    yield c
    c.shutdown()


def test_run_times_every_collective_and_a_hand_written_one(cluster, capfd):
    ops = {name: name for name in sweep.COLLECTIVES} | {"ring": ring.ring_allreduce}
    rows = sweep.run(cluster, ops, [4096, 65536], warmup=1, repeats=2)
    assert [(r.label, r.nbytes) for r in rows] == \
        [(label, s) for s in (4096, 65536) for label in ops]
    for r in rows:
        kind = "all_reduce" if r.label == "ring" else r.label
        assert r.seconds > 0 and r.world_size == 2
        assert r.algbw == pytest.approx(r.nbytes / r.seconds)
        assert r.busbw == pytest.approx(r.algbw * sweep.busbw_factor(kind, 2))
    assert "Warning" not in capfd.readouterr().err  # no deprecated API on the ranks


def _counted_op(tensor):
    """An op that counts its calls on the rank; its 2nd call (the first timed one) is slow."""
    import sys
    import time
    sys._sweep_calls = getattr(sys, "_sweep_calls", 0) + 1
    if sys._sweep_calls == 2:
        time.sleep(0.5)


def _calls_on_ranks(cluster, reset=False):
    return cluster.run(lambda: __import__("sys").__dict__.pop("_sweep_calls", 0) if reset
                       else __import__("sys")._sweep_calls)


def test_run_warms_up_then_keeps_the_median_of_the_repeats(cluster):
    _calls_on_ranks(cluster, reset=True)
    big = sweep.BATCH_BYTES  # one call per timed batch
    rows = sweep.run(cluster, {"op": _counted_op}, [big], warmup=1, repeats=3)
    assert _calls_on_ranks(cluster, reset=True) == [1 + 3] * 2
    assert rows[0].seconds < 0.1  # the median of (0.5 s, ~0, ~0), not their mean
    assert rows[0].fastest <= rows[0].seconds < 0.5 <= rows[0].slowest  # the spread
    small = 4096  # small sizes are timed in batches of calls in a row
    sweep.run(cluster, {"op": _counted_op}, [small], warmup=2, repeats=2)
    batch = min(sweep.MAX_BATCH, sweep.BATCH_BYTES // small)
    assert _calls_on_ranks(cluster, reset=True) == [2 + 2 * batch] * 2


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(ops=42), TypeError, "collective's name, a fn"),
    (dict(ops="allreduce"), ValueError, "unknown collective"),
    (dict(ops="all_reduce", kind="sum"), ValueError, "unknown collective"),
    (dict(nbytes_list=[]), ValueError, "no message sizes"),
    (dict(nbytes_list=[2]), ValueError, "at least one element"),
    (dict(repeats=0), ValueError, "repeats"),
    (dict(warmup=-1), ValueError, "warmup")])
def test_run_refuses_bad_input_before_starting_anything(kwargs, error, match):
    args = dict(ops="all_reduce", nbytes_list=[4096]) | kwargs
    with pytest.raises(error, match=match):
        sweep.run(None, args.pop("ops"), args.pop("nbytes_list"), **args)


# -- plot helpers -------------------------------------------------------------------

def test_origin_decodes_the_block_convention():
    assert diagrams.origin(23, world_size=4, blocks=4) == (1, 3)
    assert diagrams.origin(100, world_size=4, blocks=4) is None  # a sum
    assert diagrams.origin(25.0, world_size=4, blocks=4) is None  # an average
    assert diagrams.origin(10.5, world_size=4, blocks=4) is None


def test_holdings_draws_one_cell_per_element_and_rank():
    before = [torch.tensor([10, 11]), torch.tensor([20, 21])]
    after = [torch.tensor([30, 32]), None]
    fig = diagrams.holdings(before, after, "all_reduce")
    left, right = fig.data
    assert [list(row) for row in left.text] == [["10", "11"], ["20", "21"]]
    assert [list(row) for row in right.text] == [["30", "32"], ["", ""]]  # rank 1: none
    assert left.z[1][0] == 1 and right.z[0][0] == 2  # rank 1's colour; combined
    with pytest.raises(ValueError, match="one tensor .* per rank"):
        diagrams.holdings(before, after[:1], "bad")


def test_ring_slider_has_one_step_per_snapshot():
    snaps = [("start", [[1, 1], [2, 2]]), ("step 1", [[1, 3], [3, 2]])]
    fig = diagrams.ring_slider(snaps, "ring")
    assert len(fig.layout.sliders[0].steps) == 2
    assert [list(row) for row in fig.data[0].text] == [["r0", "r0"], ["r1", "r1"]]
    assert diagrams.contributors(11) == "r0+r1+r3"
    with pytest.raises(ValueError, match="no snapshots"):
        diagrams.ring_slider([], "ring")


def test_bandwidth_and_alpha_beta_draw_one_curve_per_op_and_size():
    rows = [sweep.Row(label, n, s, 1e-3 + s / 1e9, s / (1e-3 + s / 1e9), 0.0)
            for label in ("a", "b") for n in (2, 4) for s in (1024, 4096)]
    assert len(diagrams.bandwidth(rows).data) == 4
    fits = {(label, n): (1e-3, 1e9) for label in ("a", "b") for n in (2, 4)}
    fig = diagrams.alpha_beta(rows, fits)
    assert len(fig.data) == 8 and math.isclose(fig.data[1].y[0], 1e-3 * 1e3 + 1024 / 1e6)


def test_alpha_beta_marks_each_sizes_fastest_repeat_the_time_chapter_2_fits():
    rows = [sweep.Row("a", 2, s, 5e-3, s / 5e-3, 0.0, fastest=1e-3, slowest=9e-3)
            for s in (1024, 4096)]
    fig = diagrams.alpha_beta(rows, {("a", 2): (1e-3, 1e9)})
    assert list(fig.data[0].y) == [1.0, 1.0]  # ms: the fastest, not the median
