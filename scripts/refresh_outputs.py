"""Re-execute notebooks in place, so their stored outputs are those of a real run.

The stored outputs are what nbval compares against and what the fast book
build in the tests renders, so refresh them after changing a chapter and
review the diff. Widget state is saved in the notebook's metadata (the book
needs it to draw widgets without a kernel); per-cell timestamps are not, so
an unchanged chapter gives an unchanged file apart from widget model ids.

Usage: .venv/bin/python scripts/refresh_outputs.py notebooks/00_how_this_book_runs.ipynb
"""
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

CELL_TIMEOUT_S = 600  # the same per-cell limit as the book build (_config.yml)


def refresh(path):
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
        store_widget_state=True, record_timing=False)
    client.execute()
    nbformat.write(nb, path)
    print(f"refreshed {path}")


def main(paths):
    if not paths:
        sys.exit(__doc__)
    for p in paths:
        refresh(Path(p).resolve())


if __name__ == "__main__":
    main(sys.argv[1:])
