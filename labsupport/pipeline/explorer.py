"""Chapter 5's schedule explorer: every (schedule, p, v, m) of a small grid, drawn in advance.

    from labsupport.pipeline import explorer
    explorer.explorer({"1F1B": (train_step_1f1b, 1)})   # a menu and slider over p and m

Each view is an ideal schedule of ``labsupport.pipeline.sim`` (fixed costs,
free messages), so the figure works in the static book with no kernel.
"""
from labsupport.pipeline.sim import KINDS, bubble_formula, ideal_events, micro_batch, orders
from labsupport.timeline import bars


def explorer(schedules: dict, ps=(2, 4, 8), ms=(1, 2, 4, 8, 16), start=(0, 0),
             max_bars=128, measured=()):
    """A plotly figure: a menu picks schedule and p, a slider picks m; bubbles in the title.

    ``schedules`` maps a label to ``(schedule function, v)``. Every view is
    computed here, so the figure works in the static book with no kernel:
    the menu swaps in a slider listing that group's m values. ``start`` is
    the (group, m) index shown first; views of more than ``max_bars`` bars
    (2·p·v·m) are left out to keep the page light. ``measured``: rows of
    ``bubbles.measure``; a view of a configuration that was run shows the
    measured bubble beside the formula's.
    """
    import plotly.graph_objects as go

    runs = {(r["fn"], r["p"], r["m"], r["v"]): r for r in measured}
    fig, groups = go.Figure(), []
    for label, (fn, v) in schedules.items():
        for p in ps:
            views = [_add_view(fig, fn, p, m, v, label, runs.get((fn, p, m, v))) for m in ms
                     if 2 * p * v * m <= max_bars and _valid(fn, p, m, v)]
            if views:
                groups.append((f"{label}, p={p}", p, views))
    if not groups:
        raise ValueError(f"no valid view for these schedules, ps={ps} and ms={ms}: "
                         "interleaved schedules need m divisible by p")
    n, (g, k) = len(fig.data), start
    sliders = [_slider(views) for _, _, views in groups]
    buttons = [dict(label=name, method="update",
                    args=[{"visible": _visible(views[0][0], n)},
                          {"sliders": [slider], **_title(views[0][1]), **_y_axis(p)}])
               for (name, p, views), slider in zip(groups, sliders)]
    shown, (title, subtitle), _ = groups[g][2][k]
    for i, trace in enumerate(fig.data):
        trace.visible = i in shown
    fig.update_layout(  # plots.top_margin makes room for the title and the menu
        title=dict(text=title, subtitle_text=subtitle, x=0, xanchor="left"), barmode="overlay",
        height=500, sliders=[dict(sliders[g], active=k)],
        uniformtext=dict(minsize=9, mode="hide"),
        updatemenus=[dict(buttons=buttons, active=g, x=1, xanchor="right", y=1.02,
                          yanchor="bottom", direction="down")],
        xaxis_title="time (units of one whole-model forward)", **_y_axis(groups[g][1]))
    return fig


def _valid(fn, p, m, v):
    try:
        orders(fn, p, m, v)
        return True
    except ValueError:  # e.g. interleaved needs p | m, naive needs m = 1
        return False


def _add_view(fig, fn, p, m, v, label, run=None):
    """Two bar traces (forwards, backwards) of one ideal schedule:
    (their indices, (title, subtitle), m).

    ``run``: the measured row of this configuration, if it was run."""
    events = ideal_events(fn, p, m, v, t_f=1.0 / p, t_b=2.0 / p)
    first = len(fig.data)
    fig.add_traces(bars(events, row=lambda e: e["rank"], label=micro_batch, legend=KINDS))
    f = bubble_formula(p, m, v)
    subtitle = f"bubble: {f['fraction']:.0%} of the wall time, {f['ratio']:.0%} of the compute"
    if run is not None:
        subtitle += (f"; measured in this run: {run['measured']:.0%} and "
                     f"{run['measured_ratio']:.0%}")
    return list(range(first, len(fig.data))), (f"{label}, p={p}, m={m}", subtitle), m


def _visible(indices, n):
    return [i in indices for i in range(n)]


def _title(title):
    """Layout updates that show a view's (title, subtitle)."""
    return {"title.text": title[0], "title.subtitle.text": title[1]}


def _slider(views):
    """Steps that switch between one group's views, touching only that group's traces."""
    mine = [i for idx, _, _ in views for i in idx]
    steps = [dict(label=str(m), method="update",
                  args=[{"visible": [i in idx for i in mine]}, _title(title), mine])
             for idx, title, m in views]
    return dict(active=0, steps=steps, currentvalue=dict(prefix="m = "), pad=dict(t=50))


def _y_axis(p):
    return {"yaxis.range": [p - 0.5, -0.5], "yaxis.tickvals": list(range(p)),
            "yaxis.ticktext": [f"rank {r}" for r in range(p)], "yaxis.title": "rank"}
