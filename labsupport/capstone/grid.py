"""The picture of a layout's grid: every rank, coloured by its group, one panel per kind.

    fig = grid_figure(Layout(dp=2, tp=2, pp=2, cp=2))   # 5 panels: dp, pp, cp, tp, dp_cp
    plots.show(fig)

Each panel draws all the ranks once, at the same place in every panel, so the
eye can follow one rank across the kinds: its column is its (cp, tp)
coordinates, tp varying fastest, its row its (dp, pp) coordinates, pp
varying fastest; that is the mesh (dp, pp, cp, tp) read row-major, so the
ranks run left to right, then top to bottom. In a panel, the ranks of one
group share a colour and a line joins them: a tp group is a short run along a
row (consecutive ranks), a dp group a long jump down the columns. The groups
are ``layout.layout_groups``' (the course's one definition of them).
"""
from plotly.subplots import make_subplots

from labsupport import plots
from labsupport.capstone.layout import AXES, Layout, layout_groups

KINDS = (*AXES, "dp_cp")        # one panel each, in the mesh's order
# past the palette's 8 colours, the next 8 groups take the next marker shape
SYMBOLS = ("circle", "square", "diamond", "triangle-up", "x", "star")


def position(layout: Layout, rank) -> tuple:
    """(column, row) of ``rank`` in the picture: (cp, tp) across, (dp, pp) down."""
    c = layout.coords(rank)
    return c.cp * layout.tp + c.tp, c.dp * layout.pp + c.pp


def _ticks(outer, inner) -> list:
    """The labels "outer,inner" of a picture axis, inner varying fastest."""
    return [f"{o},{i}" for o in range(outer) for i in range(inner)]


def grid_figure(layout, kinds=KINDS, height=None):
    """One panel per group kind of ``layout``: every rank, a colour per group
    (``height``: pixels; by default room for the picture's dp·pp rows)."""
    layout = Layout(*layout)
    height = height or 200 + 45 * layout.dp * layout.pp
    groups = layout_groups(layout)
    fig = make_subplots(rows=1, cols=len(kinds), horizontal_spacing=0.03,
                        subplot_titles=[f"{k} ({len(groups[k])} × {len(groups[k][0])})"
                                        for k in kinds])
    for col, kind in enumerate(kinds, start=1):
        for j, ranks in enumerate(groups[kind]):
            xy = [position(layout, r) for r in ranks]
            # no line: a group's ranks need not be neighbours in the picture
            colour, shape = divmod(j, len(plots.PALETTE))[::-1]
            fig.add_scatter(
                x=[p[0] for p in xy], y=[p[1] for p in xy], mode="markers+text",
                text=[str(r) for r in ranks], textposition="top center",
                hovertext=[_hover(layout, r, kind, ranks) for r in ranks],
                hoverinfo="text", showlegend=False, name=f"{kind} group {ranks}",
                marker=dict(size=16, color=plots.PALETTE[colour],
                            symbol=SYMBOLS[shape % len(SYMBOLS)]),
                row=1, col=col)
        fig.update_xaxes(tickvals=list(range(layout.cp * layout.tp)),
                         ticktext=_ticks(layout.cp, layout.tp), showgrid=False,
                         title_text="cp,tp" if col == 1 else None, row=1, col=col,
                         range=[-0.6, layout.cp * layout.tp - 0.4])
        fig.update_yaxes(tickvals=list(range(layout.dp * layout.pp)),
                         ticktext=_ticks(layout.dp, layout.pp), showgrid=False,
                         range=[layout.dp * layout.pp - 0.5, -0.9],  # down; room for text
                         showticklabels=col == 1,
                         title_text="dp,pp" if col == 1 else None, row=1, col=col)
    fig.update_layout(title=f"{layout.world_size} ranks, dp={layout.dp} tp={layout.tp} "
                            f"pp={layout.pp} cp={layout.cp}: a colour per group",
                      height=height)
    return fig


def _hover(layout, rank, kind, ranks) -> str:
    c = layout.coords(rank)
    return (f"rank {rank}: dp={c.dp}, tp={c.tp}, pp={c.pp}, cp={c.cp}<br>"
            f"its {kind} group: {ranks}")
