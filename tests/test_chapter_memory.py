# Run: .venv/bin/python -m pytest tests/test_chapter_memory.py
"""Chapter 0's your-turn checks (memory.checks) pass the reference and fail plausible wrong
answers."""
import pytest
import torch

from labsupport.memory import checks
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
    checks.check_predicted_state_bytes(predicted)

    def four_bytes_each(model, optimizer):    # forgets bf16 is 2 bytes
        out = predicted(model, optimizer)
        params = list(model.parameters())
        if params[0].dtype == torch.bfloat16:
            out = predicted(model.float(), optimizer)
            model.bfloat16()
        return out

    with pytest.raises(AssertionError, match="bf16 GPT.*bytes predicted"):
        checks.check_predicted_state_bytes(four_bytes_each)

    def no_step_counters(model, optimizer):
        out = predicted(model, optimizer)
        if isinstance(optimizer, torch.optim.Adam):
            out["optimizer"] -= 4 * len(list(model.parameters()))
        return out

    with pytest.raises(AssertionError, match="optimizer = .*fp32 `step`"):
        checks.check_predicted_state_bytes(no_step_counters)

    def momentum_always(model, optimizer):
        out = predicted(model, optimizer)
        if not isinstance(optimizer, torch.optim.Adam):
            out["optimizer"] = out["params"]
        return out

    with pytest.raises(AssertionError, match="plain SGD: optimizer"):
        checks.check_predicted_state_bytes(momentum_always)

    def state_counted_now(model, optimizer):   # counts tensors that do not exist yet
        return {"params": 0, "grads": 0, "optimizer": 0}

    with pytest.raises(AssertionError, match="params = 0 bytes predicted"):
        checks.check_predicted_state_bytes(state_counted_now)


def right_swiglu(s, b, h, f):
    # LayerNorm's input, gate's and up's shared input; silu's input, the product's
    # two factors, down's input
    return 8 * s * b * h + 16 * s * b * f


def test_swiglu_block_bytes_check():
    checks.check_swiglu_block_bytes(right_swiglu)
    exact = lambda s, b, h, f: right_swiglu(s, b, h, f) + 2 * 4 * s * b  # noqa: E731
    checks.check_swiglu_block_bytes(exact, rtol=0)    # + LayerNorm's statistics
    gelu_copied = lambda s, b, h, f: 8 * s * b * h + 8 * s * b * f       # noqa: E731
    with pytest.raises(AssertionError, match="your formula gives"):
        checks.check_swiglu_block_bytes(gelu_copied)  # the GELU MLP's terms
    one_factor = lambda s, b, h, f: 8 * s * b * h + 12 * s * b * f       # noqa: E731
    with pytest.raises(AssertionError, match="both factors"):
        checks.check_swiglu_block_bytes(one_factor)   # the product's u only
    input_twice = lambda s, b, h, f: 12 * s * b * h + 16 * s * b * f     # noqa: E731
    with pytest.raises(AssertionError, match="kept once"):
        checks.check_swiglu_block_bytes(input_twice)  # y counted for gate and up


def test_untouched_stub_reads_not_written(capsys):
    def stub(*args):
        raise NotWritten("swiglu_block_bytes")
    assert check(lambda: checks.check_swiglu_block_bytes(stub),
                 "swiglu_block_bytes") is None
    assert "not written yet" in capsys.readouterr().out


def test_the_recomputation_times_are_masked_for_nbval_and_the_flops_are_not():
    # chapter 0 prints what each checkpointing policy added over none: a difference of
    # two medians, negative on a noisy run; the FLOPs are exact and stay compared
    import re
    from pathlib import Path

    from nbval.plugin import get_sanitize_patterns

    cfg = (Path(__file__).resolve().parent / "nbval_sanitize.cfg").read_text()

    def sanitize(text):
        for regex, replace in get_sanitize_patterns(cfg):
            text = re.sub(regex, replace, text)
        return text

    line = "selective  recomputed 8.39 MFLOP, which took {} ms more than none"
    assert sanitize(line.format("0.9")) == sanitize(line.format("-0.2"))
    assert "8.39 MFLOP" in sanitize(line.format("0.9"))
