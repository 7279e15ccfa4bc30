"""Every chapter runs under papermill with its small parameters, and matches its stored outputs.

Run: .venv/bin/python -m pytest tests/test_notebooks.py   (add -k 01_ for one chapter)
Each chapter's small parameters are in its notebook metadata (see nbtools.py).
"""
import nbformat
import pytest

from nbtools import (
    chapter_notebooks,
    error_outputs,
    failures_by_file,
    run_nbval,
    run_papermill,
    small_parameters,
)

NOTEBOOKS = chapter_notebooks()
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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_chapter_runs_with_small_parameters(path, tmp_path):
    nb = run_papermill(path, tmp_path, small_parameters(path))
    assert error_outputs(nb) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_chapter_matches_its_stored_outputs(path, tmp_path):
    junit = tmp_path / "nbval.xml"
    code = run_nbval([path], junit)
    assert failures_by_file(junit)[path.name] == [], (
        "outputs differ from the stored ones (see stdout)")
    assert code == 0
