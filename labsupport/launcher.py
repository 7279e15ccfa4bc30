"""Start this kernel's group of ranks and run functions on it.

    cluster = ls.start(world_size=4)          # ranks ready, process group initialised
    results = cluster.run(fn, x, y=2)         # fn(x, y=2) on every rank; a list by rank
    ls.run(fn, world_size=4)                  # the same, starting or reusing a group

One group runs per kernel: starting a new one stops the previous one, so
re-running a setup cell never leaves ranks behind.
"""
from labsupport import _rank
from labsupport import backend as _backend
from labsupport.backend import check_timeout
from labsupport.cluster import DEFAULT_TIMEOUT, Cluster

_current: Cluster | None = None
_notices_shown: set = set()


def start(world_size: int = 2, backend: str = "auto", *, timeout: float = DEFAULT_TIMEOUT,
          threads: int | None = None) -> Cluster:
    """Start ``world_size`` ranks with an initialised process group and return them.

    Starting stops this kernel's previous group. Usable as a context manager
    (``with ls.start(4) as cluster: ...``), which shuts the group down at the end.
    """
    global _current
    if _rank.STATE:
        raise RuntimeError("ls.start() was called on a rank; start groups from the notebook")
    placement = _backend.place(world_size, backend, threads)
    check_timeout(timeout)
    if _current is not None:
        _current.shutdown()
    if placement.notice and placement.notice not in _notices_shown:
        print(placement.notice)  # once per kernel: a chapter may switch sizes often
        _notices_shown.add(placement.notice)
    _current = Cluster(placement, timeout)
    return _current


def current() -> Cluster | None:
    """The running group of this kernel, or None."""
    return _current if _current is not None and not _current._closed else None


def run(fn, *args, world_size: int | None = None, backend: str = "auto",
        timeout: float | None = None, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on every rank of a matching group, starting one if needed."""
    cluster = current()
    matches = cluster is not None and world_size in (None, cluster.world_size) \
        and backend in ("auto", cluster.backend)
    if not matches:
        if world_size is None:
            raise ValueError("no group is running: say how many ranks, ls.run(fn, world_size=4)")
        cluster = start(world_size, backend)
    return cluster.run(fn, *args, timeout=timeout, **kwargs)


def shutdown():
    """Stop this kernel's group of ranks (the process server stays warm)."""
    global _current
    if _current is not None:
        _current.shutdown()
        _current = None
