"""Record what each rank does and when, and draw it as a Gantt chart.

    tl = Timeline()                          # on a rank
    with tl.span("compute", "F", mb=0):      # a forward of micro-batch 0
        y = stage(x)
    tl.record("comm", "send", start, end)    # a span timed elsewhere (e.g. async work)
    return tl.events                         # back to the notebook, one list per rank

All ranks of a group run on one machine, and ``time.perf_counter`` reads the
same monotonic clock in every process (CLOCK_MONOTONIC on Linux), so the
events of different ranks share one time axis without any synchronisation.
"""
import contextlib
import time

LANES = ("compute", "comm", "wait")


class Timeline:
    """A rank's list of events: dicts with lane, name, start, end (seconds) and extras."""

    def __init__(self, rank: int | None = None):
        if rank is None:
            import torch.distributed as dist
            rank = dist.get_rank() if dist.is_initialized() else 0
        self.rank = rank
        self.events: list[dict] = []

    def record(self, lane: str, name: str, start: float, end: float, **extra):
        if lane not in LANES:
            raise ValueError(f"unknown lane {lane!r}: use one of {LANES}")
        if end < start:
            raise ValueError(f"event {name!r} ends ({end}) before it starts ({start})")
        self.events.append(dict(rank=self.rank, lane=lane, name=name, start=start, end=end, **extra))

    @contextlib.contextmanager
    def span(self, lane: str, name: str, **extra):
        """Time the block as one event."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(lane, name, start, time.perf_counter(), **extra)


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
    spans = sorted((e["start"], e["end"]) for e in events if e["rank"] == rank and e["lane"] == lane)
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


def gantt(events: list[dict], title: str = "Timeline", color_by: str = "name", label=None):
    """A plotly Gantt chart: one row per rank (and lane), one bar per event.

    ``label(event)`` gives the text on a bar (e.g. the micro-batch number).
    Times are shown in milliseconds. Show with ``ls.plots.show(fig, measured=True)``.
    """
    import plotly.graph_objects as go

    fig, seen = go.Figure(), set()
    for e in events:
        key = e.get(color_by, e["name"])
        row = f"rank {e['rank']}" + (f" {e['lane']}" if e["lane"] != "compute" else "")
        fig.add_trace(go.Bar(
            x=[(e["end"] - e["start"]) * 1e3], base=[e["start"] * 1e3], y=[row], orientation="h",
            name=str(key), legendgroup=str(key), showlegend=key not in seen,
            text=[label(e) if label else ""], textposition="inside", insidetextanchor="middle",
            marker_color=_colour(key), hovertemplate=f"{e['name']}<extra>{row}</extra>"))
        seen.add(key)
    fig.update_layout(title=title, barmode="overlay", xaxis_title="time (ms)",
                      yaxis=dict(autorange="reversed"), bargap=0.25,
                      height=120 + 45 * len({(e["rank"], e["lane"]) for e in events}))
    return fig


_PALETTE = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442"]
_assigned: dict = {}


def _colour(key) -> str:
    """One colour per distinct key, stable within the kernel."""
    return _assigned.setdefault(str(key), _PALETTE[len(_assigned) % len(_PALETTE)])
