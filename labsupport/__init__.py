"""labsupport: plumbing for the distributed-training course.

    import labsupport as ls
    cluster = ls.start(world_size=4)      # 4 ranks, process group initialised
    cluster.run(fn)                       # fn() on every rank -> [result_rank0, ...]

Imported in a Jupyter kernel, it also registers the ``%%ranks`` cell magic and
the book's offline plotly renderer.
"""
import sys

from labsupport import _aliases
from labsupport.launch.cluster import Cluster
from labsupport.launch.errors import RankError, RankTimeout
from labsupport.launch.identity import backend_of, device
from labsupport.launch.session import current, run, shutdown, start
from labsupport.launch.torchrun import main
from labsupport.your_turn import NotWritten

__all__ = ["Cluster", "NotWritten", "RankError", "RankTimeout", "backend_of", "current",
           "device", "main", "run", "shutdown", "start"]

# Submodules a chapter reaches as ``ls.<name>``, imported on first use so that
# ``import labsupport`` stays light (it does not import torch by itself).
_SUBMODULES = {
    # one folder per chapter topic (lesson, probe, crossing, checks, bench)
    "memory", "collectives", "ring", "data_parallel", "tensor_parallel", "pipeline",
    "context_parallel", "zero", "device_mesh", "expert_parallel", "checkpoints",
    "debugging",
    # instruments used by many chapters, and the rest
    "bench", "calls", "crossings", "diagrams", "doctor", "grading", "models", "overlap",
    "p2p_log", "plots", "sweep", "timeline", "timing", "traffic", "your_turn"}


def __getattr__(name):
    import importlib
    if name in _SUBMODULES:
        return importlib.import_module(f"labsupport.{name}")
    if f"labsupport.{name}" in _aliases.OLD_PATHS:          # an old path, for one term
        return _aliases.resolve(f"labsupport.{name}")
    raise AttributeError(f"module 'labsupport' has no attribute {name!r}")


def load_ipython_extension(ip):
    """``%load_ext labsupport``: the %%ranks magic and the rest of labsupport.launch.ipython."""
    from labsupport.launch import ipython
    ipython.setup(ip)


def _setup_kernel():
    if "IPython" not in sys.modules:
        return
    from IPython import get_ipython
    ip = get_ipython()
    if ip is not None:
        load_ipython_extension(ip)


_aliases.install()
_setup_kernel()
