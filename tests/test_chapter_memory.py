# Run: .venv/bin/python -m pytest tests/test_chapter_memory.py
"""Chapter 0's your-turn checks (grading.chapters.memory) pass the reference and fail plausible wrong answers."""
import pytest
import torch

from labsupport.memory import checks as grading_memory
from labsupport.your_turn import NotWritten, check


def predicted(model, optimizer):
    params = list(model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    if isinstance(optimizer, torch.optim.Adam):                 # AdamW too
        kept = 2 * nbytes + 4 * len(params)                     # m, v; fp32 step
    else:
        kept = nbytes if optimizer.defaults["momentum"] else 0
    return {"params": nbytes, "grads": nbytes, "optimizer": kept}


def test_predicted_state_bytes_check():
    grading_memory.check_predicted_state_bytes(predicted)

    def four_bytes_each(model, optimizer):    # forgets bf16 is 2 bytes
        out = predicted(model, optimizer)
        params = list(model.parameters())
        if params[0].dtype == torch.bfloat16:
            out = predicted(model.float(), optimizer)
            model.bfloat16()
        return out

    with pytest.raises(AssertionError, match="bf16 GPT.*bytes predicted"):
        grading_memory.check_predicted_state_bytes(four_bytes_each)

    def no_step_counters(model, optimizer):
        out = predicted(model, optimizer)
        if isinstance(optimizer, torch.optim.Adam):
            out["optimizer"] -= 4 * len(list(model.parameters()))
        return out

    with pytest.raises(AssertionError, match="optimizer = .*fp32 `step`"):
        grading_memory.check_predicted_state_bytes(no_step_counters)

    def momentum_always(model, optimizer):
        out = predicted(model, optimizer)
        if not isinstance(optimizer, torch.optim.Adam):
            out["optimizer"] = out["params"]
        return out

    with pytest.raises(AssertionError, match="plain SGD: optimizer"):
        grading_memory.check_predicted_state_bytes(momentum_always)

    def state_counted_now(model, optimizer):   # counts tensors that do not exist yet
        return {"params": 0, "grads": 0, "optimizer": 0}

    with pytest.raises(AssertionError, match="params = 0 bytes predicted"):
        grading_memory.check_predicted_state_bytes(state_counted_now)


def right_layer(s, b, h, a):
    return s * b * h * (64 + 4 * a * s / h)


def test_layer_activation_bytes_check():
    grading_memory.check_layer_activation_bytes(right_layer)
    exact = lambda s, b, h, a: right_layer(s, b, h, a) + 16 * s * b + s * s  # noqa: E731
    grading_memory.check_layer_activation_bytes(exact, rtol=0)
    paper = lambda s, b, h, a: s * b * h * (34 + 5 * a * s / h)               # noqa: E731
    with pytest.raises(AssertionError, match="your formula gives"):
        grading_memory.check_layer_activation_bytes(paper)
    no_scores = lambda s, b, h, a: 64 * s * b * h                            # noqa: E731
    with pytest.raises(AssertionError, match="scores term"):
        grading_memory.check_layer_activation_bytes(no_scores)


def test_untouched_stub_reads_not_written(capsys):
    def stub(*args):
        raise NotWritten("layer_activation_bytes")
    assert check(lambda: grading_memory.check_layer_activation_bytes(stub),
                 "layer_activation_bytes") is None
    assert "not written yet" in capsys.readouterr().out
