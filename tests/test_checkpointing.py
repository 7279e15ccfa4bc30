# Run: .venv/bin/python -m pytest tests/test_checkpointing.py
"""labsupport.memory.checkpointing: the memory chapter's checkpointed forward, and its
notebook copy."""

import pytest
import torch

from labsupport import models
from labsupport.memory import checkpointing, tally
from nbtools import assert_lesson_copy


@pytest.fixture(scope="module")
def setup():
    cfg = models.GPTConfig(vocab_size=32, seq_len=16, hidden=32, heads=4, layers=2)
    return models.GPT(cfg), models.toy_tokens(2, 16, 32)


@pytest.mark.parametrize("policy,layer,core", [("none", 2, 2), ("selective", 2, 4),
                                               ("full", 4, 4)])
def test_every_policy_gives_the_models_gradients_bitwise(setup, policy, layer, core):
    model, (ids, targets) = setup
    model.zero_grad(set_to_none=True)
    model(ids, targets).backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    checkpointing.CALLS.clear()
    checkpointing.forward(model, ids, targets, policy).backward()
    torch.testing.assert_close([p.grad for p in model.parameters()], reference,
                               rtol=0, atol=0)
    assert checkpointing.CALLS == {"layer": layer, "attention core": core}


def test_checkpointing_holds_fewer_bytes(setup):
    model, (ids, targets) = setup
    held = {}
    for policy in ("none", "selective", "full"):
        with tally.peak_tally() as counter:
            loss = checkpointing.forward(model, ids, targets, policy)
            held[policy] = counter.live
        del loss
    assert held["full"] < held["selective"] < held["none"]


def test_the_notebook_copy_is_the_package_code():
    assert_lesson_copy(checkpointing)
