# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest \
#   tests/test_chapter_context_parallel.py
"""labsupport.context_parallel.checks, behind chapter 6's your-turn cells:
the reference solutions pass, plausible wrong answers fail with a message that
names the mistake, and an unwritten stub is reported as not written."""
import sys

import cloudpickle
import pytest
import torch

import labsupport as ls
from labsupport.context_parallel import checks
from labsupport.context_parallel import ring_attention as ra

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def cluster():
    c = ls.start(world_size=2, backend="gloo")
    yield c
    c.shutdown()


def _in_z(out, lse, block_out, block_lse):      # the formula, not in logs: overflows
    z, zb = lse.exp(), block_lse.exp()
    return (z * out + zb * block_out) / (z + zb), torch.log(z + zb)


def _mean(out, lse, block_out, block_lse):
    return (out + block_out) / 2, torch.logaddexp(lse, block_lse)


def _max_lse(out, lse, block_out, block_lse):
    return ra.lse_merge(out, lse, block_out, block_lse)[0], torch.maximum(lse, block_lse)


def _swapped_weights(out, lse, block_out, block_lse):
    new = torch.logaddexp(lse, block_lse)
    return out * (block_lse - new).exp() + block_out * (lse - new).exp(), new


def _stub(*args):
    raise ls.NotWritten("lse_merge")


def test_the_reference_merge_passes(cluster):
    cluster.run(checks.check_merge, ra.lse_merge)


@pytest.mark.parametrize("wrong, message", [
    (_in_z, "float32.*lse holds inf or nan: e\\^lse overflowed.*logaddexp"),
    (_mean, "plain mean of the two parts"),
    (_max_lse, "the larger of the two lse"),
    (_swapped_weights, "merged output is not attention over all keys"),
])
def test_wrong_merges_are_named(cluster, wrong, message):
    with pytest.raises(ls.RankError, match=message):
        cluster.run(checks.check_merge, wrong)


def _heads_reversed(x):
    return ra.seq_to_heads(x.flip(1))


def _no_all_to_all(x):                           # my tokens of my heads, no exchange
    n, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    g = x.shape[1] // n
    return x[:, rank * g:(rank + 1) * g].repeat(1, 1, n, 1)


def test_seq_to_heads_reference_and_wrong_answers(cluster):
    cluster.run(checks.check_seq_to_heads, ra.seq_to_heads)
    with pytest.raises(ls.RankError, match="expected head 2 .* it holds head 1"):
        cluster.run(checks.check_seq_to_heads, _heads_reversed)
    with pytest.raises(ls.RankError, match="at \\(head 0, position 3\\) expected head"):
        cluster.run(checks.check_seq_to_heads, _no_all_to_all)


def test_an_unwritten_stub_is_reported_not_failed(cluster, capsys):
    ls.your_turn.check(lambda: cluster.run(checks.check_merge, _stub), "lse_merge")
    assert "lse_merge is not written yet" in capsys.readouterr().out
