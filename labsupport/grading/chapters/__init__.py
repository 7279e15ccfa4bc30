"""The checks behind every chapter's ``your-turn`` cells, one module per chapter topic.

    from labsupport.grading.chapters import zero as checks
    checks.check_fsdp2_rows(fsdp2_rows)        # in chapter 7's check cell

Each module holds the checks of one chapter's exercises and says precisely
what is wrong with an answer (results, bytes, a deadlock explained), built
on the graders' core (``grading.checks``, ``grading.diagnosis``,
``labsupport.calls``). Until the reader has written the function, a check
says so without failing (``your_turn.NotWritten``). The graded assignments'
checks live beside this package, one module per assignment folder.
"""
import importlib
import pkgutil


def __getattr__(name):
    """``ls.grading.chapters.<topic>``, imported on first use."""
    if name in {m.name for m in pkgutil.iter_modules(__path__)}:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
