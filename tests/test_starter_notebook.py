# Run: .venv/bin/python -m pytest tests/test_starter_notebook.py -v   (about 20 s)
"""The starter notebook runs with small parameters and matches its stored outputs.

Two layers of the notebook tests (see tests/README.md): papermill with a
parameter override, and nbval against the outputs stored in the repository,
timings masked by tests/nbval_sanitize.cfg and nothing else.
"""
import nbformat
import pytest

from nbtools import NOTEBOOK_DIR, error_outputs, failures_by_file, run_nbval, run_papermill

NOTEBOOK = NOTEBOOK_DIR / "00_how_this_book_runs.ipynb"
PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
SMALL = {"N_POINTS": 10}
# The stored output the nbval check is shown to catch when it changes.
TAMPER_CELL_START = "(alpha_a, beta_a)"
TAMPER_FROM, TAMPER_TO = "200 kB", "201 kB"

pytestmark = pytest.mark.slow


def outputs_with(nb, mime):
    return [o for c in nb.cells if c.cell_type == "code"
            for o in c.get("outputs", []) if mime in o.get("data", {})]


def trace_lengths(nb):
    (fig_output,) = outputs_with(nb, PLOTLY_MIME)
    return [len(trace["x"]) for trace in fig_output["data"][PLOTLY_MIME]["data"]]


def test_stored_outputs_use_the_default_parameters():
    """Guards the next test: 10 points must differ from what is stored."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert trace_lengths(nb) == [50, 50]
    assert len(outputs_with(nb, WIDGET_MIME)) == 1
    assert nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]


def test_papermill_runs_with_small_parameters(tmp_path):
    nb = run_papermill(NOTEBOOK, tmp_path, SMALL)
    injected = [c for c in nb.cells
                if "injected-parameters" in c.metadata.get("tags", [])]
    assert len(injected) == 1 and "N_POINTS = 10" in injected[0].source
    assert trace_lengths(nb) == [10, 10], "the override did not reach the figure"
    assert len(outputs_with(nb, WIDGET_MIME)) == 1
    assert error_outputs(nb) == []


def tampered_copy(tmp_path):
    """A copy of the notebook with one stored output changed, and its nbval name."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    index = next(i for i, c in enumerate(code_cells)
                 if c.source.startswith(TAMPER_CELL_START))
    (stream,) = code_cells[index].outputs
    assert TAMPER_FROM in stream.text
    stream.text = stream.text.replace(TAMPER_FROM, TAMPER_TO)
    path = tmp_path / "tampered.ipynb"
    nbformat.write(nb, path)
    return path, f"Cell {index}"


def test_nbval_matches_stored_outputs_and_catches_a_change(tmp_path):
    """One child run: the notebook passes; its tampered copy fails at that cell."""
    tampered, tampered_cell = tampered_copy(tmp_path)
    junit = tmp_path / "nbval.xml"
    code = run_nbval([NOTEBOOK, tampered], junit)
    failed = failures_by_file(junit)
    assert failed[NOTEBOOK.name] == [], "stored outputs differ from a fresh run"
    assert failed[tampered.name] == [tampered_cell], failed
    assert code == 1  # pytest's "some tests failed", from the tampered copy only
