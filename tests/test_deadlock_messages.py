# Run: .venv/bin/python -m pytest tests/test_deadlock_messages.py   (~1 s)
"""labsupport.checking.deadlock's sentences, from made-up logs (no ranks started):
the tensor a stuck send held is named as p2p_log describes it, in grammatical
English ("its chunk 1", "a 1536-element tensor", never "its a ...")."""
from labsupport.checking import deadlock


def _sending(what, peer, t=100.0):
    """The log of a rank that started a dist.isend of ``what`` to ``peer`` and
    waited for it since ``t``."""
    return [dict(ev="begin", strict=False, t=t),
            dict(ev="start", id=1, op="isend", peer=peer, what=what, ranks=None, t=t),
            dict(ev="wait", id=1, t=t)]


def _explained(what):
    logs = {0: _sending(what, 1), 1: _sending("chunk 0", 0)}
    return deadlock.explain(logs, [0, 1], now=103.0)


def test_a_whole_tensor_sent_is_named_with_its_article():
    text = _explained("a 1536-element tensor")
    assert ("rank 0 waited 3 s in dist.isend of a 1536-element tensor to rank 1, which "
            "had not posted the matching receive; rank 1 was itself blocked in "
            "dist.isend to rank 0.") in text
    assert "its a " not in text


def test_a_chunk_sent_is_the_rank_s_own():
    assert "in dist.isend of its chunk 2 to rank 1," in _explained("chunk 2")
    assert "in dist.isend of its chunk 0 to rank 0," in _explained("chunk 2")


def test_a_separate_tensor_and_a_range_read_as_english():
    assert "dist.isend of a separate 4-element tensor to rank 1," in _explained(
        "a separate 4-element tensor")
    assert "dist.isend of elements 0:3 of its tensor to rank 1," in _explained(
        "elements 0:3 of the tensor")
