# Run: .venv/bin/python -m pytest tests/test_plots.py -v   (a few seconds, no kernel)
"""labsupport.plots gives figures reproducible outputs that nbval can compare."""
import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import plotly.graph_objects as go
import plotly.io as pio
from nbval.plugin import get_sanitize_patterns
from plotly.subplots import make_subplots

from labsupport import plots

ROOT = Path(__file__).resolve().parent.parent
SANITIZE = ROOT / "tests" / "nbval_sanitize.cfg"


def sanitize(text):
    """What nbval does to a string output before comparing it."""
    for regex, replace in get_sanitize_patterns(SANITIZE.read_text()):
        text = re.sub(regex, replace, text)
    return text


def timing_figure(seconds):
    return go.Figure(go.Bar(x=["all_reduce"], y=[seconds]),
                     layout=dict(title="measured here"))


def test_bundle_has_json_html_without_plotlyjs_and_summary():
    bundle = plots.figure_bundle(timing_figure(1.0).to_dict())
    assert set(bundle) == {plots.PLOTLY_MIME, "text/html", "text/plain"}
    assert bundle["text/plain"] == "Figure: measured here (1 trace)"
    html = bundle["text/html"]
    assert "Plotly.newPlot(" in html and "<script src" not in html
    assert len(html) < 20_000  # plotly.js (MBs) is the page's, not the figure's


def test_div_id_is_content_hash_plus_counter():
    fig = timing_figure(1.0).to_dict()
    first, second = (plots.figure_bundle(fig)["text/html"] for _ in range(2))
    ids = [re.search(r'id="(fig-[0-9a-f]{12})-(\d+)"', h).groups() for h in (first, second)]
    assert ids[0][0] == ids[1][0] and int(ids[1][1]) == int(ids[0][1]) + 1
    other = plots.figure_bundle(timing_figure(2.0).to_dict())["text/html"]
    assert ids[0][0] not in other


def test_sanitizer_masks_measured_figures_only():
    a, b = (timing_figure(s).to_dict() for s in (1.0, 2.0))
    measured = [plots.figure_bundle(f, measured=True) for f in (a, b)]
    assert sanitize(measured[0]["text/html"]) == sanitize(measured[1]["text/html"])
    assert measured[0]["text/plain"] == measured[1]["text/plain"]
    plain = [plots.figure_bundle(f)["text/html"] for f in (a, b)]
    assert sanitize(plain[0]) != sanitize(plain[1])


def test_sanitizer_masks_durations_and_keeps_the_rest():
    assert sanitize("1,000 sizes: took 4.6 ms") == sanitize("1,000 sizes: took 12 ms")
    assert sanitize("took 3 \u00b5s") == "took <DURATION>"
    assert sanitize("10 sizes: took 4 ms") != sanitize("20 sizes: took 4 ms")
    assert sanitize("m=8, measured in this run: 34% and 51%") == \
        sanitize("m=8, measured in this run: 29% and 40%")
    assert sanitize("bubble: 27% of the wall time") == "bubble: 27% of the wall time"


def test_use_book_renderer_is_idempotent_and_default():
    plots.use_book_renderer()
    plots.use_book_renderer()
    assert pio.renderers.default == plots.RENDERER
    assert pio.templates.default == plots.TEMPLATE
    bundle = timing_figure(1.0)._repr_mimebundle_()
    assert bundle["text/plain"].startswith("Figure: ")
    colorway = bundle[plots.PLOTLY_MIME]["layout"]["template"]["layout"]["colorway"]
    assert colorway == plots.PALETTE


def test_root_conftest_skips_plotly_json_in_nbval():
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    notebook = SimpleNamespace(skip_compare=("metadata",))
    items = [SimpleNamespace(parent=notebook), SimpleNamespace(parent=notebook),
             SimpleNamespace(parent=SimpleNamespace())]  # a non-nbval item
    conftest.pytest_collection_modifyitems(None, None, items)
    assert notebook.skip_compare == ("metadata", plots.PLOTLY_MIME)


def test_title_starts_below_the_mode_bar_and_pushes_the_margin():
    title = plots.course_template()["layout"]["title"]
    assert title["pad"]["t"] == plots.MODEBAR_PX and title["automargin"]
    assert (title["yref"], title["y"], title["yanchor"]) == ("container", 1, "top")


def test_room_is_made_for_a_subtitle_and_a_row_of_subplot_titles():
    def top(fig):
        layout = plots.figure_bundle(fig.to_dict())[plots.PLOTLY_MIME]["layout"]
        return layout.get("margin", {}).get("t")

    assert top(timing_figure(1.0)) == plots.MODEBAR_PX + plots.TITLE_PX
    assert top(go.Figure(go.Bar(x=[1], y=[1]))) is None  # no title: the template's margin
    with_sub = go.Figure(layout=dict(title=dict(text="t", subtitle_text="s")))
    assert top(with_sub) == plots.MODEBAR_PX + plots.TITLE_PX + plots.SUBTITLE_PX
    grid = make_subplots(rows=1, cols=2, subplot_titles=("before", "after"))
    grid.update_layout(title="t", margin=dict(t=10))
    assert top(grid) == plots.MODEBAR_PX + plots.TITLE_PX + plots.ROW_PX
    grid.update_layout(margin=dict(t=500))
    assert top(grid) == 500  # a figure's own larger margin is kept
