"""Every chapter matches its stored outputs and has a parameters cell and small ones.

Run: .venv/bin/python -m pytest tests/test_notebooks.py   (add -k 01_ for one chapter)
Each chapter's small parameters are in its notebook metadata (see nbtools.py).

Each chapter is executed once here, by nbval at its default parameters, which fails on
any error output outside a cell tagged ``raises-exception``: the one assertion the
papermill run with small parameters made (``error_outputs(nb) == []``), on the same
cells. That run is gone; what it ran at other values is run elsewhere:
- the starter (00_how_this_book_runs) runs under papermill with N_POINTS = 10 and nbval
  in tests/test_starter_notebook.py, with more assertions than here; it is not run
  again here;
- the small sweeps that CROSSING_SMALL / SMALL_SWEEP select are the same
  ``crossings.run(topic, small=True)`` calls tests/test_crossing_*.py run;
- the other small values are subsets of the defaults (world sizes, sweep sizes, micro-
  batch counts) or smaller models, steps and repeats of the same cells, whose lessons
  tests/test_chapter_*.py and the lesson modules' tests check at several sizes.
"""
import nbformat
import pytest
from nbtools import chapter_notebooks, failures_by_file, run_nbval, small_parameters

NOTEBOOKS = chapter_notebooks()
STARTER = "00_how_this_book_runs"  # nbval'd by tests/test_starter_notebook.py
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_chapter_has_a_parameters_cell_and_small_parameters(path):
    nb = nbformat.read(path, as_version=4)
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, "one cell tagged `parameters` (papermill)"
    small = small_parameters(path)
    assert small, "metadata.labsupport.small_parameters: the knobs that make the test run fast"
    for name in small:
        assert f"{name} =" in tagged[0].source, f"{name} is not set in the parameters cell"


@pytest.mark.parametrize("path", NOTEBOOKS,
                         ids=[p.stem for p in NOTEBOOKS])
def test_solution_cells_are_collapsed_in_the_book_and_in_jupyterlab(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if "solution" not in cell.metadata.get("tags", []):
            continue
        assert "hide-input" in cell.metadata.tags, f"cell {i}: tagged solution, not hide-input"
        assert cell.metadata.get("jupyter", {}).get("source_hidden") is True, (
            f"cell {i}: tagged solution but open in JupyterLab; set its "
            "metadata.jupyter.source_hidden to true")


COMPARED = [p for p in NOTEBOOKS if p.stem != STARTER]


def test_the_starter_is_compared_by_its_own_test():
    assert STARTER in [p.stem for p in NOTEBOOKS]
    from test_starter_notebook import NOTEBOOK
    assert NOTEBOOK.stem == STARTER


@pytest.mark.parametrize("path", COMPARED, ids=[p.stem for p in COMPARED])
def test_chapter_matches_its_stored_outputs(path, tmp_path):
    junit = tmp_path / "nbval.xml"
    code = run_nbval([path], junit)
    assert failures_by_file(junit)[path.name] == [], "outputs differ from the stored ones (see stdout)"
    assert code == 0
