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
