"""Record what each rank does and when, and draw it as a Gantt chart (the book's only one).

    tl = Timeline(device=x.device)           # on a rank
    with tl.span("compute", "F", mb=0):      # a forward of micro-batch 0
        y = stage(x)
    tl.record("comm", "send", start, tl.now())  # a span timed elsewhere (e.g. async work)
    return tl.events                         # back to the notebook, one list per rank

All ranks of a group run on one machine, and ``time.perf_counter`` reads the
same monotonic clock in every process (CLOCK_MONOTONIC on Linux), so the
events of different ranks share one time axis without any synchronisation.
With a GPU ``device``, a span ends when the GPU has done its work, not when
the host has queued it (``labsupport.timing``).
"""
import contextlib

from labsupport import timing

LANES = ("compute", "comm", "wait")


class Timeline:
    """A rank's list of events: dicts with lane, name, start, end (seconds) and extras."""

    def __init__(self, rank: int | None = None, device=None):
        if rank is None:
            import torch.distributed as dist
            rank = dist.get_rank() if dist.is_initialized() else 0
        self.rank, self.device = rank, device  # device: whose work the spans time
        self.events: list[dict] = []

    def now(self) -> float:
        """The clock of the spans: perf_counter, once the device's work is done."""
        return timing.now(self.device)

    def record(self, lane: str, name: str, start: float, end: float, **extra):
        if lane not in LANES:
            raise ValueError(f"unknown lane {lane!r}: use one of {LANES}")
        if end < start:
            raise ValueError(f"event {name!r} ends ({end}) before it starts ({start})")
        self.events.append(dict(rank=self.rank, lane=lane, name=name, start=start, end=end,
                                **extra))

    @contextlib.contextmanager
    def span(self, lane: str, name: str, **extra):
        """Time the block as one event."""
        start = self.now()
        try:
            yield
        finally:
            self.record(lane, name, start, self.now(), **extra)


def merge(events_by_rank: list[list[dict]]) -> list[dict]:
    """All ranks' events on one axis starting at 0 (the earliest start), sorted."""
    events = [e for events in events_by_rank for e in events]
    if not events:
        return []
    t0 = min(e["start"] for e in events)
    return sorted((dict(e, start=e["start"] - t0, end=e["end"] - t0) for e in events),
                  key=lambda e: (e["rank"], e["start"]))


def busy_time(events: list[dict], rank: int, lane: str = "compute") -> float:
    """Total time a rank spent in a lane, overlapping spans counted once."""
    spans = sorted((e["start"], e["end"]) for e in events
                   if e["rank"] == rank and e["lane"] == lane)
    total, cursor = 0.0, float("-inf")
    for start, end in spans:
        if end > cursor:
            total += end - max(start, cursor)
            cursor = end
    return total


def bubble(events: list[dict], lane: str = "compute") -> dict:
    """Idle time measured from a timeline, in both conventions of the pipeline chapter.

    The window is the whole run (first start to last end over all ranks).
    ``fraction`` = mean over ranks of idle / window, the fraction of wall time
    lost, which a GPipe schedule makes (p-1)/(m+p-1); ``ratio`` = mean idle /
    mean busy, the overhead over ideal compute, (p-1)/m for GPipe.
    """
    ranks = sorted({e["rank"] for e in events})
    if not ranks:
        raise ValueError("no events: record some spans before computing a bubble")
    window = max(e["end"] for e in events) - min(e["start"] for e in events)
    busy = [busy_time(events, r, lane) for r in ranks]
    idle = [window - b for b in busy]
    mean_idle, mean_busy = sum(idle) / len(ranks), sum(busy) / len(ranks)
    return dict(window=window, busy=busy, idle=idle, fraction=mean_idle / window,
                ratio=mean_idle / mean_busy if mean_busy else float("inf"))


def gantt(events: list[dict], title: str = "Timeline", color_by: str = "name", label=None, *,
          legend: dict | None = None, scale: float = 1e3, unit: str = "time (ms)"):
    """The book's Gantt chart (plotly): a row per rank and lane, a bar per event.

    ``color_by``: the event key whose value picks a bar's colour and legend
    entry (one trace per value); ``label(event)``: the text on a bar (e.g.
    the micro-batch); ``legend``: {value: (legend name, index into
    plots.PALETTE)} for values with a fixed look, in legend order (the others
    take the next colour). Times are multiplied by ``scale`` (seconds to ms by
    default), on an axis titled ``unit``; ``rank`` may be any label (e.g. "0
    ideal"). Show timings with ``ls.plots.show(fig, measured=True)``.
    """
    import plotly.graph_objects as go

    rows = [_row(rank, lane) for rank in dict.fromkeys(e["rank"] for e in events)
            for lane in LANES if any(e["rank"] == rank and e["lane"] == lane for e in events)]
    fig = go.Figure(bars(events, lambda e: _row(e["rank"], e["lane"]), color_by, label, legend,
                         scale))
    fig.update_layout(title=title, barmode="overlay", height=140 + 32 * len(rows),
                      uniformtext=dict(minsize=9, mode="hide"), xaxis_title=unit,
                      yaxis=dict(categoryorder="array", categoryarray=rows,
                                 autorange="reversed"))
    return fig


def _row(rank, lane) -> str:
    return f"rank {rank}" + ("" if lane == "compute" else f" {lane}")


def bars(events, row, color_by="name", label=None, legend=None, scale=1.0) -> list:
    """The bars of a Gantt chart: one horizontal bar trace per value of ``color_by``.

    ``row(event)`` places a bar (a label, or an int for a numeric axis); the
    other arguments are ``gantt``'s. Values in ``legend`` come first, in its order.
    """
    import numpy as np
    import plotly.graph_objects as go

    from labsupport.plots import PALETTE

    legend = legend or {}
    keys = dict.fromkeys([*legend, *(e.get(color_by, e["name"]) for e in events)])
    traces = []
    for key in keys:
        evs = [e for e in events if e.get(color_by, e["name"]) == key]
        if not evs:
            continue
        name, colour = legend.get(key, (str(key), None))
        colour = _colour(key) if colour is None else PALETTE[colour]
        traces.append(go.Bar(  # numpy arrays: stored compactly (base64)
            y=_compact([row(e) for e in evs]), base=[round(e["start"] * scale, 6) for e in evs],
            x=np.array([(e["end"] - e["start"]) * scale for e in evs], dtype="f4"),
            orientation="h", width=0.8, text=[str(label(e)) if label else "" for e in evs],
            textangle=0, textposition="inside", insidetextanchor="middle", name=name,
            marker_color=colour, hovertemplate=f"{key} %{{text}}<extra>%{{y}}</extra>"))
    return traces


def _compact(values):
    """Integer rows as a small numpy array (stored as base64), labels as they are."""
    import numpy as np

    return np.array(values, dtype="i1") if all(type(v) is int for v in values) else values


_assigned: dict = {}


def _colour(key) -> str:
    """One colour of the book's palette per distinct key, the same in every chart of the kernel."""
    from labsupport.plots import PALETTE

    return _assigned.setdefault(str(key), PALETTE[len(_assigned) % len(PALETTE)])
