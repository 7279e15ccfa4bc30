"""Pipeline bubbles measured from recorded timelines, beside the formulas.

    row = measure(cluster, train_step_afab, m=8)      # runs it, keeps the record
    row["measured"], row["formula"], row["replay"]    # bubble fractions of the wall time
    show(table([row, ...]))                           # a table of measurements

Three numbers per configuration: the formula (p-1)/(v·m+p-1), equal stages
and free messages; the *replay*, this run's own forward and backward
durations played in the schedule's order with free messages (so measured -
replay is what messages and waiting for the CPU cost, replay - formula what
unequal or noisy compute costs); and the *measured* bubble, idle over wall
time on the recorded timeline. ``cpu_share`` is the CPU time the ranks got
while computing: below 100% when ranks outnumber the cores.
"""
import statistics

from labsupport import models, timeline
from labsupport.pipeline import pipeline
from labsupport.pipeline import sim as pipeline_sim

SCHEDULE_NAMES = {"train_step_naive": "naive", "train_step_afab": "afab",
                  "train_step_1f1b": "1f1b", "train_step_interleaved": "interleaved"}


def measure(cluster, schedule, m, v=1, model_kw=None, rows=32, runs=3, step=None):
    """Run ``schedule`` ``runs`` times (two steps each, the second recorded); keep the
    least disturbed run, the one with the shortest wall time, and compare it.

    ``rows`` samples per micro-batch, so every m does the same work per
    micro-batch. ``step`` is the function run on the ranks (default
    ``pipeline.run_step``; the notebook passes its own copy).
    """
    if runs < 1 or rows < 1:
        raise ValueError(f"need runs >= 1 and rows >= 1, got runs={runs}, rows={rows}")
    cluster.run(keep_freed_memory)
    kw = {**dict(d_in=32, width=128, depth=9, d_out=8, seed=0), **(model_kw or {})}
    x, y = models.toy_regression(rows * m, kw["d_in"], kw["d_out"], seed=1)
    best = None
    for _ in range(runs):
        out = cluster.run(step or pipeline.run_step, schedule, x, y, m, v, kw, repeats=2)
        events = timeline.merge([o["events"] for o in out])
        window = timeline.bubble(events)["window"]
        if best is None or window < best[0]:
            best = (window, events, [o["peak"] for o in out], [o["cpu"] for o in out])
    return _row(schedule, cluster.world_size, m, v, *best[1:])


def keep_freed_memory():
    """On a rank: let glibc keep freed memory for reuse instead of returning it to the OS.

    Otherwise every step's activations are fresh pages, and the first
    forwards of a step pay page faults that have nothing to do with the
    schedule. (PyTorch's CUDA allocator caches freed blocks the same way.)
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)  # never give the heap back below 1 GiB
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)  # big tensors from the heap too


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


def _row(schedule, p, m, v, events, peaks, cpu):
    durations = {(e["name"], e["stage"], e["mb"]): e["end"] - e["start"]
                 for e in events if e["lane"] == "compute"}
    replay = pipeline_sim.ideal_events(schedule, p, m, v, durations=durations)
    measured = timeline.bubble(events)
    formula = pipeline_sim.bubble_formula(p, m, v)
    name = SCHEDULE_NAMES.get(schedule.__name__, schedule.__name__)
    return dict(schedule=name, p=p, m=m, v=v, fn=schedule, events=events, peaks=peaks,
                formula=formula["fraction"], formula_ratio=formula["ratio"],
                replay=timeline.bubble(replay)["fraction"], measured=measured["fraction"],
                measured_ratio=measured["ratio"], t_f=_mean(events, "F"), t_b=_mean(events, "B"),
                cpu_share=sum(cpu) / sum(measured["busy"]))


def _mean(events, name):
    return statistics.mean(e["end"] - e["start"] for e in events if e["name"] == name)


def within(row, tolerance=0.10) -> bool:
    """Whether the measured bubble is within ``tolerance`` (relative) of the formula."""
    return abs(row["measured"] - row["formula"]) <= tolerance * row["formula"]


def table(rows, title="Bubble: fraction of the wall time", tolerance=0.10):
    """A plotly table of measured rows (show with ``ls.plots.show(fig, measured=True)``).

    The bubble twice: as a fraction of the wall time (formula (p-1)/(vm+p-1),
    replay, measured) and as idle time over ideal compute (formula (p-1)/(vm),
    measured)."""
    import plotly.graph_objects as go

    header = ["schedule", "p", "m", "v", "fraction: formula", "replay", "measured",
              "measured / formula", f"within {tolerance:.0%}", "idle/compute: formula",
              "measured", "CPU share"]
    cells = [[r["schedule"] for r in rows], [r["p"] for r in rows], [r["m"] for r in rows],
             [r["v"] for r in rows], [f"{r['formula']:.3f}" for r in rows],
             [f"{r['replay']:.3f}" for r in rows], [f"{r['measured']:.3f}" for r in rows],
             [f"{r['measured'] / r['formula']:.2f}" for r in rows],
             ["yes" if within(r, tolerance) else "no" for r in rows],
             [f"{r['formula_ratio']:.3f}" for r in rows],
             [f"{r['measured_ratio']:.3f}" for r in rows],
             [f"{min(r['cpu_share'], 1):.0%}" for r in rows]]
    fig = go.Figure(go.Table(header=dict(values=header), cells=dict(values=cells)))
    fig.update_layout(title=title, height=120 + 28 * len(rows), margin=dict(t=60, b=10))
    return fig


def versus_m(rows, title="Bubble vs number of micro-batches m"):
    """Measured bubble (markers) and formula (lines) against m, one colour per schedule."""
    import plotly.graph_objects as go

    from labsupport.plots import PALETTE

    fig = go.Figure()
    groups = sorted({(r["schedule"], r["p"], r["v"]) for r in rows}, key=str)
    for k, (name, p, v) in enumerate(groups):
        mine = sorted((r for r in rows if (r["schedule"], r["p"], r["v"]) == (name, p, v)),
                      key=lambda r: r["m"])
        label = f"{name} p={p}" + (f" v={v}" if v > 1 else "")
        colour = PALETTE[k % len(PALETTE)]
        fig.add_scatter(x=[r["m"] for r in mine], y=[r["formula"] for r in mine], name=label
                        + " formula", mode="lines", line=dict(color=colour, dash="dot"))
        fig.add_scatter(x=[r["m"] for r in mine], y=[r["measured"] for r in mine],
                        name=label + " measured", mode="markers", marker=dict(color=colour,
                                                                             size=10))
    fig.update_layout(title=title, xaxis=dict(title="m", type="log", dtick=0.30103),
                      yaxis=dict(title="bubble (fraction of wall time)", rangemode="tozero"))
    return fig


def gantt_pair(row, label=None):
    """The recorded timeline of ``row`` above its ideal (equal stages, the run's mean
    forward and backward times, free messages), on one time axis in ms."""
    p, m, v = row["p"], row["m"], row["v"]
    ideal = pipeline_sim.ideal_events(row["fn"], p, m, v, t_f=row["t_f"] * v, t_b=row["t_b"] * v)
    ideal = [dict(e, rank=f"{e['rank']} ideal") for e in ideal]
    title = label or f"{row['schedule']}, p={p}, m={m}" + (f", v={v}" if v > 1 else "")
    return timeline.gantt(row["events"] + ideal, title=f"{title}: recorded, then ideal",
                          label=pipeline_sim.micro_batch, legend=pipeline_sim.KINDS)
