"""How `make test` splits the suite between two workers (pytest-xdist).

A unit of work runs whole on one worker: a test file, because its tests share
module- and class-scoped fixtures (a round trip's autograde, a started group)
that would otherwise be built once per worker; or one chapter's execution in
test_notebooks.py, since each is independent. Units that take a minute or
more go first, so that neither worker is left alone with one at the end.

The units are xdist's scopes (`--dist loadscope`, with the scheduler below);
xdist's own `loadgroup` marks do not reach pytest 9's node ids (xdist 3.8 sets
`item._nodeid`, which pytest 9 no longer reads). Without xdist
(`pytest tests/test_x.py`) only the order of files changes, never the order
inside a file.
"""
import pytest

NOTEBOOKS = "test_notebooks.py"


def unit(nodeid: str) -> str:
    """The unit of work of a test: its file, or itself for a test of test_notebooks.py
    that takes one chapter (its executions, and two checks of its file that take no time)."""
    path, _, name = nodeid.partition("::")
    if path.endswith("/" + NOTEBOOKS) and "[" in name:
        return nodeid
    return path


def _rank(item) -> int:
    """0: a chapter's execution; 1: a file with a round trip or other slow tests; 2: the rest."""
    if unit(item.nodeid) == item.nodeid:
        return 0
    if item.get_closest_marker("slow"):
        return 1
    return 2


def pytest_collection_modifyitems(session, config, items):
    rank = {}
    for item in items:
        rank[unit(item.nodeid)] = min(rank.get(unit(item.nodeid), 2), _rank(item))
    items.sort(key=lambda item: rank[unit(item.nodeid)])  # stable: a file keeps its order


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's: no error under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None  # xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return unit(nodeid)

    return ByUnit(config, log)
