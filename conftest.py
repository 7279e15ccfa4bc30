"""pytest hooks for the whole repository (so they apply to `pytest --nbval notebooks/`).

nbval compares every mime type of every output against the stored notebook,
except those in its skip list (widget views, images). It applies the
sanitizer of tests/nbval_sanitize.cfg to string values only; a figure's
application/vnd.plotly.v1+json value is a dict, compared as-is, so a figure of
measured timings could never match. That key is skipped here, and nothing is
lost: labsupport.plots puts the same figure JSON inside the figure's text/html,
which nbval does compare (and which the sanitizer masks for measured figures
only), and the text/plain summary is compared too.

This file sits at the repository root, not in tests/, because pytest loads a
conftest.py only from the directories of the paths it is given and their
parents: a run on notebooks/ never reads tests/conftest.py. It also sets the
environment of the whole test session (below).
"""
import os

PLOTLY_MIME = "application/vnd.plotly.v1+json"

# The whole suite runs point-to-point by NCCL's rules (labsupport.launch.strict_p2p),
# so that code which would hang on GPUs hangs here; set once, it reaches the
# ranks, the notebooks' kernels, the graders and the benchmarks' own ranks.
# And on gloo even on a GPU node (labsupport.launch.placement); `make
# test-gpu` sets both otherwise. The book (`make book`) sets neither.
os.environ.setdefault("LABSUPPORT_P2P", "strict")
os.environ.setdefault("LABSUPPORT_BACKEND", "gloo")


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        notebook = item.parent
        skip = getattr(notebook, "skip_compare", None)  # only nbval's notebook files
        if skip is not None and PLOTLY_MIME not in skip:
            notebook.skip_compare = (*skip, PLOTLY_MIME)
