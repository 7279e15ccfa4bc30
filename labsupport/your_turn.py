"""The reader's turn: exercise stubs, and the check that runs them on the ranks.

A chapter's ``your-turn`` cell holds a function whose body is
``raise ls.NotWritten("name")``; the reader replaces it. The check cell after
it calls :func:`check`, which runs a checking function (usually through
``ls.run``) and

* says the function is not written yet, without failing the notebook, while
  the stub is untouched (on any rank or in the kernel);
* prints one line saying what was checked when every assertion holds;
* otherwise lets the check's own error through: an AssertionError that says
  precisely what is wrong, or the launcher's RankError/RankTimeout naming the
  ranks (a deadlock ends within the check's deadline).

The reference solution follows in a collapsed cell tagged ``solution``, and a
second call of the same check runs it, so the built book shows it passing.
"""
from labsupport.launch.errors import RankError


class NotWritten(NotImplementedError):
    """Raised by an exercise stub the reader has not filled in yet."""

    def __init__(self, name: str = "this function"):
        super().__init__(f"{name} is not written yet: replace the `raise ls.NotWritten(...)` "
                         "line with your code, then run the check cell again")
        self.name = name


def check(run_check, name: str, what: str = "") -> object:
    """Run ``run_check()`` and report on the reader's function ``name``.

    Returns what ``run_check`` returned, or None if the function is not written yet.
    """
    try:
        result = run_check()
    except NotWritten:
        return _not_yet(name)
    except RankError as err:
        raised = [err.exception(rank) for rank in err.ranks]
        if raised and all(isinstance(e, NotWritten) for e in raised):
            return _not_yet(name)
        raise
    print(f"✓ {name}: {what or 'every check passed'}")
    return result


def _not_yet(name: str) -> None:
    print(f"… {name} is not written yet: fill in the cell above (delete the "
          f"`raise ls.NotWritten` line) and run this check again.")
    return None
