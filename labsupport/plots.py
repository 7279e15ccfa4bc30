"""Plotly figures that render in JupyterLab, in the offline book, and under nbval.

`use_book_renderer()` makes every figure shown in a kernel carry three outputs:

- ``application/vnd.plotly.v1+json``: the figure itself, drawn natively by
  JupyterLab (the jupyterlab-plotly extension ships in the plotly wheel);
- ``text/html``: a ``<div>`` and a ``Plotly.newPlot`` call, *without* plotly.js,
  which the book serves once from assets/vendor/ (no 5 MB inline per page);
- ``text/plain``: a one-line summary, ``Figure: <title> (2 traces)``.

Stored outputs must be byte-reproducible for nbval, so the div id is derived
from the figure's JSON (plus a per-kernel counter, since one figure may be
shown twice) instead of plotly's random UUID. A figure whose data are timings
is shown with ``show(fig, measured=True)``: its HTML sits between markers that
tests/nbval_sanitize.cfg masks, while its text/plain summary is still compared.
"""
import hashlib
import itertools
import json

import plotly.io as pio
from plotly.io._base_renderers import MimetypeRenderer

PLOTLY_MIME = "application/vnd.plotly.v1+json"
RENDERER = "course"
TEMPLATE = "course"
# The sanitizer in tests/nbval_sanitize.cfg matches these two lines exactly.
MEASURED_BEGIN = "<!-- labsupport:measured -->"
MEASURED_END = "<!-- /labsupport:measured -->"
# Okabe & Ito's palette (2008): its colours stay distinct under the common
# colour-vision deficiencies.
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#D55E00",
           "#CC79A7", "#56B4E9", "#F0E442", "#000000"]
DEFAULT_HEIGHT = 420  # px, when the figure sets no layout.height
MODEBAR_PX = 40  # room above a title for the mode bar (2 + 27 px high) and its gap
TITLE_PX, SUBTITLE_PX, ROW_PX = 30, 24, 40  # a title's line, a subtitle's, a row of subplot titles
CONFIG = {"displaylogo": False, "responsive": True}

_counter = itertools.count(1)  # figures shown in this kernel so far


def course_template():
    """One look for every figure of the book: white, light grid, big text."""
    axis = dict(showgrid=True, gridcolor="#e6e6e6", zeroline=False,
                linecolor="#444444", ticks="outside", automargin=True)
    layout = dict(
        colorway=PALETTE,
        font=dict(family="system-ui, -apple-system, Segoe UI, sans-serif",
                  size=14, color="#222222"),
        paper_bgcolor="white", plot_bgcolor="white",
        xaxis=axis, yaxis=axis,
        # Title pinned to the top and legend to the bottom of the figure (not
        # of the plot area): a legend beside the plot would take a third of a
        # book page's width, and one above it covers the title once it wraps
        # to a second row; at the bottom, plotly shrinks the plot to fit it.
        # The title starts below the mode bar (the toolbar plotly shows at the
        # top right on hover, 2 + 27 px high); figure_bundle makes room for it
        # above the plot (top_margin), automargin for what is left over.
        margin=dict(l=60, r=20, t=60, b=40),
        title=dict(yref="container", y=1, yanchor="top", pad=dict(t=MODEBAR_PX, l=8),
                   automargin=True),
        legend=dict(orientation="h", x=0, xanchor="left", yref="container", y=0.01,
                    yanchor="bottom"),
        hoverlabel=dict(namelength=-1),
    )
    return dict(layout=layout)


def figure_json(fig_dict):
    """The figure as JSON text, the same bytes on every run."""
    return pio.to_json(fig_dict, validate=False, engine="json")


def div_id(fig_json):
    """A stable id: content hash plus the kernel's running figure count."""
    digest = hashlib.sha256(fig_json.encode()).hexdigest()[:12]
    return f"fig-{digest}-{next(_counter)}"


def summary(fig_dict):
    """The text/plain line, e.g. ``Figure: alpha-beta model (2 traces)``."""
    title = fig_dict.get("layout", {}).get("title", {})
    text = title.get("text") if isinstance(title, dict) else title
    n = len(fig_dict.get("data", []))
    return f"Figure: {text or 'untitled'} ({n} trace{'s' if n != 1 else ''})"


def figure_html(fig_json, fig_id, height):
    """A div and the Plotly.newPlot call; plotly.js itself is the page's."""
    # No escaping needed: plotly's to_json writes <, > and / inside strings
    # as \u escapes, so no title can close the <script> element early.
    return (
        f'<div id="{fig_id}" class="plotly-graph-div" '
        f'style="height:{height}px; width:100%;"></div>\n'
        f'<script type="text/javascript">\n'
        f'Plotly.newPlot("{fig_id}", {fig_json});\n</script>')


def top_margin(layout):
    """Pixels above the plot area of a titled figure: mode bar, title, subtitle,
    then the row of subplot titles or menus placed just above the plot area.

    The title's automargin does not see the subtitle, subplot titles or menus,
    and in plotly.js 4.1 it leaves some one-line titles (a scatter's) touching
    the plot area: the room is made here instead.
    """
    title = layout.get("title") or {}
    title = title if isinstance(title, dict) else {"text": title}
    if not title.get("text"):
        return None
    above = [*layout.get("annotations", ()), *layout.get("updatemenus", ())]
    row_above = any(a.get("yref", "paper") == "paper" and a.get("y", 0) >= 1 for a in above)
    subtitle = bool((title.get("subtitle") or {}).get("text"))
    return MODEBAR_PX + TITLE_PX + SUBTITLE_PX * subtitle + ROW_PX * row_above


def figure_bundle(fig_dict, measured=False):
    """The mime bundle of one figure (see the module docstring)."""
    fig_dict = dict(fig_dict, config=CONFIG)
    room = top_margin(fig_dict.get("layout", {}))
    if room:
        layout = fig_dict["layout"] = dict(fig_dict["layout"])
        margin = layout["margin"] = dict(layout.get("margin", {}))
        margin["t"] = max(margin.get("t", 0), room)
    text = figure_json(fig_dict)
    height = fig_dict.get("layout", {}).get("height") or DEFAULT_HEIGHT
    html = figure_html(text, div_id(text), height)
    if measured:
        html = f"{MEASURED_BEGIN}\n{html}\n{MEASURED_END}"
    return {PLOTLY_MIME: json.loads(text), "text/html": html,
            "text/plain": summary(fig_dict)}


class BookRenderer(MimetypeRenderer):
    """plotly renderer producing `figure_bundle` for `fig.show()` and `fig`."""

    def to_mimebundle(self, fig_dict):
        return figure_bundle(fig_dict)


def use_book_renderer():
    """Make the course renderer and template plotly's defaults (idempotent)."""
    pio.templates[TEMPLATE] = course_template()
    pio.templates.default = TEMPLATE
    if RENDERER not in pio.renderers:
        pio.renderers[RENDERER] = BookRenderer()
    pio.renderers.default = RENDERER


def show(fig, measured=False):
    """Display fig; measured=True when its data are timings of this run."""
    from IPython.display import display

    fig_dict = fig.to_dict() if hasattr(fig, "to_dict") else dict(fig)
    display(figure_bundle(fig_dict, measured=measured), raw=True)
