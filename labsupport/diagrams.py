"""Pictures of collectives, drawn from the tensors of a real run.

    diagrams.holdings(before, after, "all_gather")    # who holds what, per rank
    diagrams.ring_slider(snapshots, "ring all-reduce")  # one slider step per ring step
    diagrams.bandwidth(rows)                           # busbw against message size
    diagrams.alpha_beta(rows, fits)                    # times and the fitted α-β lines
    diagrams.barrier_timeline(arrive, leave)           # who waited how long

Chapter 1's tensors follow one convention so a value says where it came
from: block b of rank r holds ``10·(r+1) + b``. ``holdings`` colours such a
value by its rank and anything else (a sum, an average) as "combined".
Chapter 2's ring tensors hold ``2**r`` on rank r, so a sum's bits name the
ranks it contains. Figures of timings must be shown with
``ls.plots.show(fig, measured=True)``; the others are deterministic.
"""
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labsupport.plots import PALETTE

COMBINED = "#bbbbbb"  # a value made of several ranks' data
EMPTY = "#ffffff"     # no tensor on this rank (e.g. gather's non-roots)


def origin(value, world_size, blocks):
    """The (rank, block) a value ``10·(r+1) + b`` came from, or None."""
    if value is None or value != int(value):
        return None
    rank, block = divmod(int(value), 10)
    rank -= 1
    return (rank, block) if 0 <= rank < world_size and block < blocks else None


def _grid(tensors, world_size, blocks, width):
    """Rows by rank of (colour index, text, hover) for a heatmap ``width`` wide."""
    z, text, hover = [], [], []
    for rank, t in enumerate(tensors):
        values = _values(t) + [None] * (width - len(_values(t)))
        z.append([_colour_index(v, world_size, blocks) for v in values])
        text.append(["" if v is None else _fmt(v) for v in values])
        hover.append([_hover(rank, j, v, world_size, blocks) for j, v in enumerate(values)])
    return z, text, hover


def _values(t):
    if t is None:
        return []
    return [float(v) for v in (t.flatten().tolist() if hasattr(t, "flatten") else t)]


def _fmt(v):
    return str(int(v)) if v == int(v) else f"{v:.4g}"


def _colour_index(v, world_size, blocks):
    if v is None:
        return world_size + 1
    o = origin(v, world_size, blocks)
    return o[0] if o else world_size


def _hover(rank, j, v, world_size, blocks):
    if v is None:
        return f"rank {rank}, element {j}: nothing"
    o = origin(v, world_size, blocks)
    what = f"block {o[1]} of rank {o[0]}" if o else "combined from several ranks"
    return f"rank {rank}, element {j}: {_fmt(v)} ({what})"


def _colourscale(world_size):
    """Discrete colours: one per rank, then 'combined', then 'empty'."""
    colours = [PALETTE[r % len(PALETTE)] for r in range(world_size)] + [COMBINED, EMPTY]
    n = len(colours)
    scale = []
    for i, c in enumerate(colours):
        scale += [[i / n, c], [(i + 1) / n, c]]
    return scale, n - 1


def holdings(before, after, title, world_size=None):
    """Two grids, before and after: rows are ranks, cells are tensor elements."""
    world_size = world_size or len(before)
    if len(before) != world_size or len(after) != world_size:
        raise ValueError(f"need one tensor (or None) per rank in before and after, got "
                         f"{len(before)} and {len(after)} for world_size={world_size}")
    blocks = max([len(_values(t)) for t in before] + [1])
    width = max([len(_values(t)) for t in (*before, *after)] + [1])
    scale, top = _colourscale(world_size)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("before", "after"),
                        horizontal_spacing=0.08, shared_yaxes=True)  # one set of rank labels
    for col, tensors in ((1, before), (2, after)):
        z, text, hover = _grid(tensors, world_size, blocks, width)
        fig.add_heatmap(z=z, text=text, texttemplate="%{text}", hovertext=hover,
                        hoverinfo="text", colorscale=scale, zmin=0, zmax=top,
                        showscale=False, xgap=2, ygap=2, row=1, col=col,
                        y=[f"rank {r}" for r in range(world_size)])
    fig.update_yaxes(autorange="reversed", showgrid=False)
    fig.update_xaxes(title_text="element", showgrid=False, dtick=1)
    key = "colour: the rank a block came from; grey: combined from several ranks"
    fig.update_layout(title=dict(text=title, subtitle_text=key), height=160 + 45 * world_size)
    return fig


def contributors(value):
    """The ranks summed into a ring value (rank r contributes 2**r): 'r0+r2'."""
    v, bits = int(value), []
    for r in range(v.bit_length()):
        if v >> r & 1:
            bits.append(f"r{r}")
    return "+".join(bits) or "0"


def ring_slider(snapshots, title):
    """A heatmap of chunk per rank with one slider step per ring step.

    ``snapshots`` is a list of (label, rows) where rows[rank][chunk] is that
    chunk's value on that rank after the step (values are sums of 2**r).
    """
    if not snapshots:
        raise ValueError("no snapshots: pass [(label, rows by rank), ...]")
    world_size = len(snapshots[0][1])
    frames = [([[bin(int(v)).count("1") for v in row] for row in rows],
               [[contributors(v) for v in row] for row in rows]) for _, rows in snapshots]
    z0, text0 = frames[0]
    fig = go.Figure(go.Heatmap(
        z=z0, text=text0, texttemplate="%{text}", zmin=1, zmax=world_size, xgap=3, ygap=3,
        colorscale="Blues", colorbar=dict(title="ranks summed"),
        y=[f"rank {r}" for r in range(world_size)], x=[f"chunk {c}" for c in range(len(z0[0]))]))
    steps = [dict(method="update", label=str(i), args=[
        {"z": [z], "text": [text]}, {"title.text": f"{title}: {label}"}])
        for i, ((label, _), (z, text)) in enumerate(zip(snapshots, frames))]
    fig.update_layout(title=f"{title}: {snapshots[0][0]}", height=220 + 50 * world_size,
                      sliders=[dict(steps=steps, active=0, pad=dict(t=40),
                                    currentvalue=dict(prefix="step "))])
    fig.update_yaxes(autorange="reversed", showgrid=False)
    fig.update_xaxes(showgrid=False)
    return fig


def bandwidth(rows, title="bus bandwidth against message size"):
    """busbw (GB/s) against S: a colour per op, a dash per N (sweep.Row objects);
    error bars from the fastest to the slowest repeat."""
    fig = go.Figure(layout=dict(
        title=title, xaxis=dict(title="message size S (bytes)", type="log", dtick=1),
        yaxis=dict(title="busbw (GB/s)")))
    for (label, n), group in _by_curve(rows).items():
        fig.add_scatter(x=[r.nbytes for r in group], y=[r.busbw / 1e9 for r in group],
                        name=f"{label}, N={n}", mode="lines+markers", error_y=_spread(group),
                        **_style(rows, label, n))
    return fig


def _spread(group):
    """Error bars from the fastest to the slowest repeat (rows that carry them)."""
    if not all(r.fastest and r.slowest for r in group):
        return None
    up = [(r.busbw * r.seconds / r.fastest - r.busbw) / 1e9 for r in group]
    down = [(r.busbw - r.busbw * r.seconds / r.slowest) / 1e9 for r in group]
    return dict(type="data", symmetric=False, array=up, arrayminus=down)


def alpha_beta(rows, fits, title="time per call and the α-β fit"):
    """Measured times (markers) and α + S/β (dotted); fits[(label, N)] = (α, β).
    A row's fastest repeat where it has one: the time least disturbed by other
    work, which is what chapter 2 fits."""
    fig = go.Figure(layout=dict(
        title=dict(text=title, subtitle_text="markers: fastest of the repeats; dotted: the fit"),
        xaxis=dict(title="message size S (bytes)", type="log", dtick=1),
        yaxis=dict(title="time (ms)", type="log"), height=480))
    for (label, n), group in _by_curve(rows).items():
        style = _style(rows, label, n)
        colour, sizes = style["line"]["color"], [r.nbytes for r in group]
        fig.add_scatter(x=sizes, y=[(r.fastest or r.seconds) * 1e3 for r in group],
                        mode="markers",
                        name=f"{label}, N={n}", marker=style["marker"],
                        legendgroup=f"{label}{n}")
        if (label, n) not in fits:
            raise ValueError(f"no fit for {label!r} at N={n}: fits[(label, N)] = (α, β)")
        alpha, beta = fits[(label, n)]
        fig.add_scatter(x=sizes, y=[(alpha + s / beta) * 1e3 for s in sizes], mode="lines",
                        name=f"fit, {label}, N={n}", line=dict(color=colour, dash="dot"),
                        legendgroup=f"{label}{n}", showlegend=False)
    return fig


def _style(rows, label, n):
    """One colour per op label, one dash per group size."""
    labels = list(dict.fromkeys(r.label for r in rows))
    sizes = sorted({r.world_size for r in rows})
    colour = PALETTE[labels.index(label) % len(PALETTE)]
    i = sizes.index(n) % 4
    return dict(line=dict(color=colour, dash=("solid", "dash", "dot", "dashdot")[i]),
                marker=dict(color=colour, symbol=("circle", "square", "diamond", "cross")[i]))


def _by_curve(rows):
    curves = {}
    for r in rows:
        curves.setdefault((r.label, r.world_size), []).append(r)
    return curves


def barrier_timeline(arrive, leave, title="dist.barrier(): arrive, wait, leave"):
    """Per rank: working until it arrives, then waiting until it leaves (seconds)."""
    ranks = [f"rank {r}" for r in range(len(arrive))]
    fig = go.Figure(layout=dict(title=title, barmode="stack", legend_traceorder="normal",
                                xaxis=dict(title="time since the start (s)"),
                                yaxis=dict(autorange="reversed")))
    fig.add_bar(y=ranks, x=list(arrive), orientation="h", name="sleeping (work)")
    fig.add_bar(y=ranks, x=[b - a for a, b in zip(arrive, leave)], orientation="h",
                name="waiting in barrier()")
    return fig
