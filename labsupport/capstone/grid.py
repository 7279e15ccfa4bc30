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


def position(layout: Layout, rank) -> tuple:
    """(column, row) of ``rank`` in the picture: (cp, tp) across, (dp, pp) down."""
    c = layout.coords(rank)
    return c.cp * layout.tp + c.tp, c.dp * layout.pp + c.pp


def _ticks(outer, inner) -> list:
    """The labels "outer,inner" of a picture axis, inner varying fastest."""
    return [f"{o},{i}" for o in range(outer) for i in range(inner)]


def grid_figure(layout, kinds=KINDS, height=360):
    """One panel per group kind of ``layout``: every rank, a colour per group."""
    layout = Layout(*layout)
    groups = layout_groups(layout)
    fig = make_subplots(rows=1, cols=len(kinds), horizontal_spacing=0.03,
                        subplot_titles=[f"{k}: {len(groups[k])} groups of "
                                        f"{len(groups[k][0])}" for k in kinds])
    for col, kind in enumerate(kinds, start=1):
        for j, ranks in enumerate(groups[kind]):
            xy = [position(layout, r) for r in ranks]
            colour = plots.PALETTE[j % len(plots.PALETTE)]
            fig.add_scatter(
                x=[p[0] for p in xy], y=[p[1] for p in xy], mode="lines+markers+text",
                text=[str(r) for r in ranks], textposition="top center",
                hovertext=[_hover(layout, r, kind, ranks) for r in ranks],
                hoverinfo="text", marker=dict(size=14, color=colour),
                line=dict(color=colour, width=3), showlegend=False,
                name=f"{kind} group {ranks}", row=1, col=col)
        fig.update_xaxes(tickvals=list(range(layout.cp * layout.tp)),
                         ticktext=_ticks(layout.cp, layout.tp), showgrid=False,
                         title_text="cp,tp" if col == 1 else None, row=1, col=col,
                         range=[-0.6, layout.cp * layout.tp - 0.4])
        fig.update_yaxes(tickvals=list(range(layout.dp * layout.pp)),
                         ticktext=_ticks(layout.dp, layout.pp), showgrid=False,
                         autorange="reversed", showticklabels=col == 1,
                         title_text="dp,pp" if col == 1 else None, row=1, col=col)
    fig.update_layout(title=f"The {layout.world_size} ranks of Layout(dp={layout.dp}, "
                            f"tp={layout.tp}, pp={layout.pp}, cp={layout.cp}), "
                            "coloured by group", height=height)
    return fig


def _hover(layout, rank, kind, ranks) -> str:
    c = layout.coords(rank)
    return (f"rank {rank}: dp={c.dp}, tp={c.tp}, pp={c.pp}, cp={c.cp}<br>"
            f"its {kind} group: {ranks}")
