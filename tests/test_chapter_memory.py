# Run: .venv/bin/python -m pytest tests/test_chapter_memory.py
"""Chapter 0's your-turn checks (grading.chapters.memory) pass the reference and fail plausible wrong answers."""
import pytest

from labsupport import memory
from labsupport.grading.chapters import memory as grading_memory
from labsupport.your_turn import NotWritten, check


def right_states(model, optimizer):
    params = list(model.parameters())
    return {"params": memory.storage_bytes(params),
            "grads": memory.storage_bytes(p.grad for p in params),
            "optimizer": memory.optimizer_state_bytes(optimizer)}


def test_state_bytes_check():
    grading_memory.check_state_bytes(right_states)

    def four_bytes_each(model, optimizer):    # forgets bf16 is 2 bytes
        n = sum(p.numel() for p in model.parameters())
        return {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n}

    with pytest.raises(AssertionError, match="bytes, counted"):
        grading_memory.check_state_bytes(four_bytes_each)

    def no_step_counters(model, optimizer):
        out = right_states(model, optimizer)
        out["optimizer"] = sum(v.numel() * v.element_size() for s in optimizer.state.values()
                               for k, v in s.items() if k != "step")
        return out

    with pytest.raises(AssertionError, match="optimizer = "):
        grading_memory.check_state_bytes(no_step_counters)


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
