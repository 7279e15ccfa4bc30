# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_chapter_expert_parallel.py
"""labsupport.expert_parallel.checks, behind chapter 9's your-turn cells:
the chapter's solutions (labsupport.expert_parallel.moe's copies) pass, plausible wrong answers fail
with a message that names the mistake, an unwritten stub is reported as not written."""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import labsupport as ls
from labsupport.expert_parallel import moe
from labsupport.expert_parallel import checks

cloudpickle.register_pickle_by_value(sys.modules[__name__])


# -- combine: in the kernel -----------------------------------------------------------

def _ungated(rows, token_index, gates, num_tokens):
    return rows.new_zeros(num_tokens, rows.shape[-1]).index_add(0, token_index, rows)


def _detached(rows, token_index, gates, num_tokens):
    return moe.combine(rows, token_index, gates, num_tokens).detach()


def _per_row(rows, token_index, gates, num_tokens):      # forgets the tokens
    return rows * gates.unsqueeze(-1)


def _first_row_only(rows, token_index, gates, num_tokens):   # overwrites, not adds
    y = rows.new_zeros(num_tokens, rows.shape[-1])
    return y.index_copy(0, token_index, rows * gates.unsqueeze(-1))


def test_the_chapters_combine_passes():
    checks.check_combine(moe.combine)


@pytest.mark.parametrize("wrong, message", [
    (_ungated, "without their gates"),
    (_detached, "must stay differentiable"),
    (_per_row, r"a tensor of shape \(6, 3\): one row per token, \(5, 3\)"),
    (_first_row_only, r"token 0: .* sum over rows \[1, 4\]"),
])
def test_combine_check_names_the_mistake(wrong, message):
    with pytest.raises(AssertionError, match=message):
        checks.check_combine(wrong)


def test_an_unwritten_combine_is_reported_not_failed(capsys):
    def stub(*args):
        raise ls.NotWritten("combine")
    assert ls.your_turn.check(lambda: checks.check_combine(stub), "combine") is None
    assert "combine is not written yet" in capsys.readouterr().out


# -- exchange_counts: on 2 ranks ------------------------------------------------------

def _swapped(counts, group=None):
    splits_in, splits_out, received = moe.exchange_counts(counts, group)
    return splits_out, splits_in, received


def _tensors(counts, group=None):
    splits_in, splits_out, received = moe.exchange_counts(counts, group)
    return torch.tensor(splits_in), torch.tensor(splits_out), received


def _flat(counts, group=None):
    splits_in, splits_out, received = moe.exchange_counts(counts, group)
    return splits_in, splits_out, received.flatten()


def _no_exchange(counts, group=None):         # what it sends, not what it receives
    n = dist.get_world_size(group)
    mine = counts.view(n, -1).sum(dim=1).tolist()
    return mine, mine, counts.view(n, -1)


@pytest.fixture(scope="module")
def cluster():
    c = ls.start(world_size=2, backend="gloo")
    yield c
    c.shutdown()


def test_the_chapters_exchange_counts_passes(cluster):
    cluster.run(checks.check_exchange, moe.exchange_counts)


@pytest.mark.parametrize("wrong, message", [
    (_swapped, "you gave the rows it receives"),
    (_tensors, r"as Python lists \(\.tolist\(\)\)"),
    (_flat, r"received is a tensor of shape \(8,\), expected \(N, E/N\) = \(2, 4\)"),
    (_no_exchange, "output_split_sizes .* entry i = rows rank i sends"),
])
def test_exchange_check_names_the_mistake(cluster, wrong, message):
    with pytest.raises(ls.RankError, match=message):
        cluster.run(checks.check_exchange, wrong)
