"""One home for the graders' tests' ``fails``: a check that must refuse, and what it said.

    text = fails(gz.check_memory, cls)      # the AssertionError's message
    assert "Each bucket's full buffer must go" in text
"""
import pytest


def fails(check, *args, **kwargs) -> str:
    """Call ``check(*args, **kwargs)``; it must raise AssertionError: its text."""
    with pytest.raises(AssertionError) as info:
        check(*args, **kwargs)
    return str(info.value)


def stopped_as_a_stall(text: str, elapsed: float, deadline: float) -> bool:
    """A graded deadlock was stopped by the stall detector (every rank waiting,
    using no CPU, for ``deadline`` s: ``launch.progress``), not by the CPU budget
    nor the last-resort ceiling, and the grader returned before that ceiling.

    The wall time is bounded by the ceiling only: how long the ranks computed
    before they deadlocked is the machine's load, which a test must not judge;
    that the run ended *because* it stalled is what says the deadline fired on
    the deadlock itself."""
    from labsupport.launch.limits import GRADING_CEILING_FACTOR
    assert "every rank still running waited, using no CPU time" in text, text
    assert elapsed < GRADING_CEILING_FACTOR * deadline, (elapsed, text)
    return True
