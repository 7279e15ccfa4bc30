# Run: .venv/bin/python -m pytest tests/test_chapter_expert_parallel.py   (~2 s)
"""labsupport.expert_parallel.checks, behind chapter 9's your-turn cells:
the chapter's solutions pass (labsupport.expert_parallel.moe's expert_major_order; the notebook's
route_balanced and update_bias, read from its solution cell), plausible wrong
answers fail with a message that names the mistake, an unwritten stub is reported
as not written."""
from pathlib import Path

import nbformat
import pytest
import torch

import labsupport as ls
from labsupport.expert_parallel import checks, moe

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "09_expert_parallel.ipynb"


# -- expert_major_order ---------------------------------------------------------------

def _inverse(received):                    # where each rank-major row goes
    return torch.argsort(moe.expert_major_order(received))


def _rank_major(received):                 # no reorder at all
    return torch.arange(int(received.sum()))


def _blocks(received):
    """{(source, expert): its rows' rank-major indices}."""
    index, at = {}, 0
    for i, row in enumerate(received.tolist()):
        for e, count in enumerate(row):
            index[i, e] = list(range(at, at + count))
            at += count
    return index


def _sources_reversed(received):           # experts in order, sources last to first
    n, per = received.shape
    index = _blocks(received)
    return torch.tensor([r for e in range(per) for i in reversed(range(n))
                         for r in index[i, e]], dtype=torch.long)


def _float(received):
    return moe.expert_major_order(received).float()


def _rows_reversed_within(received):       # each block's rows backwards
    n, per = received.shape
    index = _blocks(received)
    return torch.tensor([r for e in range(per) for i in range(n)
                         for r in index[i, e][::-1]], dtype=torch.long)


def test_the_chapters_expert_major_order_passes():
    checks.check_expert_major_order(moe.expert_major_order)


def test_the_reference_loop_gives_the_chapters_example():
    want = [0, 1, 6, 2, 3, 4, 5, 7]
    assert checks.expert_major_reference([[2, 1], [0, 3], [1, 1]]) == want


@pytest.mark.parametrize("wrong, message", [
    (_inverse, "You returned the inverse"),
    (_rank_major, r"expected r0e0 r0e0 r2e0"),
    (_sources_reversed, "not source by source"),
    (_float, "indices of dtype torch.float32"),
    (_rows_reversed_within, "within one \\(source, expert\\) block keep the rows"),
])
def test_expert_major_order_check_names_the_mistake(wrong, message):
    with pytest.raises(AssertionError, match=message):
        checks.check_expert_major_order(wrong)


def test_an_unwritten_expert_major_order_is_reported_not_failed(capsys):
    def stub(received):
        raise ls.NotWritten("expert_major_order")
    assert ls.your_turn.check(lambda: checks.check_expert_major_order(stub),
                              "expert_major_order") is None
    assert "expert_major_order is not written yet" in capsys.readouterr().out


# -- route_balanced, update_bias ------------------------------------------------

def _solution():
    """The chapter's route_balanced and update_bias, from its solution cell."""
    cells = nbformat.read(NOTEBOOK, as_version=4).cells
    source = next(c.source for c in cells if "solution" in c.metadata.get("tags", [])
                  and "def route_balanced" in c.source)
    scope = {"torch": torch}
    exec(source, scope)
    return scope["route_balanced"], scope["update_bias"]


def test_the_chapters_balanced_routing_passes():
    checks.check_balanced_routing(*_solution())


def _bias_ignored(logits, top_k, bias):
    return moe.route(logits, top_k)


def _bias_in_gates(logits, top_k, bias):
    probs = logits.softmax(-1)
    scores = probs + bias
    gates, experts = scores.topk(top_k, dim=-1)
    if top_k > 1:
        gates = gates / gates.sum(-1, keepdim=True)
    return probs, experts, gates


def _renormalised_k1(logits, top_k, bias):
    probs, experts, gates = _solution()[0](logits, top_k, bias)
    return probs, experts, gates / gates.sum(-1, keepdim=True)


def _detached(logits, top_k, bias):
    probs, experts, gates = _solution()[0](logits, top_k, bias)
    return probs, experts, gates.detach()


@pytest.mark.parametrize("wrong, message", [
    (_bias_ignored, "You chose by the probabilities alone"),
    (_bias_in_gates, "the gates include the bias"),
    (_renormalised_k1, "every gate is 1"),
    (_detached, "the gates carry no gradient"),
])
def test_route_balanced_check_names_the_mistake(wrong, message):
    with pytest.raises(AssertionError, match=message):
        checks.check_balanced_routing(wrong, _solution()[1])


def _reversed_sign(bias, load, speed):
    load = load.to(bias.dtype)
    return bias + speed * torch.sign(load - load.mean())


def _proportional(bias, load, speed):
    load = load.to(bias.dtype)
    return bias + speed * (load.mean() - load) / load.mean()


def _to_zero_at_the_mean(bias, load, speed):        # moves the balanced ones too
    load = load.to(bias.dtype)
    return bias + speed * torch.where(load > load.mean(), -1.0, 1.0)


@pytest.mark.parametrize("wrong, message", [
    (_reversed_sign, "the sign is reversed"),
    (_proportional, "moves each bias by the fixed speed"),
    (_to_zero_at_the_mean, "not at all at the mean"),
])
def test_update_bias_check_names_the_mistake(wrong, message):
    with pytest.raises(AssertionError, match=message):
        checks.check_balanced_routing(_solution()[0], wrong)


def test_unwritten_balanced_routing_is_reported_not_failed(capsys):
    def stub(*args):
        raise ls.NotWritten("route_balanced")
    assert ls.your_turn.check(lambda: checks.check_balanced_routing(stub, stub),
                              "route_balanced") is None
    assert "route_balanced is not written yet" in capsys.readouterr().out
