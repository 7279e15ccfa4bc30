# Run: .venv/bin/python -m pytest tests/test_nbtools.py   (~1 s)
"""The one check that a notebook's copy of a lesson is the package's (nbtools), on a
package module and a notebook made up here: it passes a faithful copy and names each
difference."""
import types

import nbformat
import pytest

from nbtools import assert_lesson_copy, lesson_differences

MODULE = '''"""A module with a lesson."""
HELPER = 1


# --- lesson: notebooks/99_made_up.ipynb (the notebook's copy must match) ---
def double(x):
    """Twice x."""
    return 2 * x


class Box:
    size = 3
# --- end of lesson ---
'''


def made_up(tmp_path, cells, module=MODULE):
    (tmp_path / "notebooks").mkdir(exist_ok=True)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbformat.write(nb, tmp_path / "notebooks" / "99_made_up.ipynb")
    (tmp_path / "made_up.py").write_text(module)
    return types.SimpleNamespace(__file__=str(tmp_path / "made_up.py"), __name__="made_up")


DOUBLE = 'def double(x):\n    """Twice x."""\n    return 2 * x'
BOX = "class Box:\n    size = 3"


def test_a_faithful_copy_passes_whatever_else_the_cells_hold(tmp_path):
    stub = 'def double(x):\n    raise NotImplementedError'   # a your-turn, then its solution
    module = made_up(tmp_path, ["import torch\nprint(1)", stub, "%%ranks\nx = 1",
                                f"# Kept equal\n{DOUBLE}\n\ndouble(2)", BOX])
    assert lesson_differences(module, root=tmp_path) == []


def test_each_difference_is_named(tmp_path):
    module = made_up(tmp_path, [DOUBLE.replace("2 * x", "x + x")])
    assert lesson_differences(module, root=tmp_path) == [
        f"double differs between notebooks/99_made_up.ipynb and {module.__file__}",
        "notebooks/99_made_up.ipynb does not define Box"]
    with pytest.raises(AssertionError, match="names notebooks/99_made_up.ipynb, which does not"):
        assert_lesson_copy(module)  # the repository has no such notebook


def test_a_lesson_block_holds_definitions_only(tmp_path):
    module = made_up(tmp_path, [DOUBLE, BOX],
                     MODULE.replace("class Box:", "print(0)\n\n\nclass Box:"))
    with pytest.raises(AssertionError, match="not Expr"):
        lesson_differences(module, root=tmp_path)
