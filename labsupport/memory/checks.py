"""Chapter 0's your-turn checks: a model's states predicted, one layer's activations.

    from labsupport.memory import checks
    checks.check_predicted_state_bytes(predicted_state_bytes)
    checks.check_layer_activation_bytes(layer_activation_bytes)

Each check runs the reader's function on models built here and compares it
with bytes counted from real tensors, raising an AssertionError that names
the case, the category and both numbers.
"""
import torch

from labsupport import models
from labsupport.memory import tally as memory

_SMALL = dict(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2)


def _fresh(tie_weights, dtype, optimizer):
    """A small GPT in ``dtype`` and its ``optimizer``, before any step."""
    model = models.GPT(models.GPTConfig(**_SMALL, tie_weights=tie_weights)).to(dtype)
    return model, optimizer(model.parameters())


def _step(model, opt):
    ids, targets = models.toy_tokens(2, _SMALL["seq_len"], _SMALL["vocab_size"])
    model(ids, targets).backward()
    opt.step()


def _counted(model, opt) -> dict:
    params = list(model.parameters())
    return {"params": memory.storage_bytes(params),
            "grads": memory.storage_bytes(p.grad for p in params),
            "optimizer": memory.optimizer_state_bytes(opt)}


_CASES = {
    "fp32 GPT, tied head, AdamW": (True, torch.float32, torch.optim.AdamW),
    "bf16 GPT, untied head, AdamW": (False, torch.bfloat16, torch.optim.AdamW),
    "fp32 GPT, SGD with momentum": (True, torch.float32,
                                    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    "fp32 GPT, plain SGD": (True, torch.float32, lambda p: torch.optim.SGD(p, lr=0.1)),
}


def check_predicted_state_bytes(predict):
    """``predict(model, optimizer)`` before the first step -> {"params", "grads",
    "optimizer"}: the bytes that step leaves, counted from its tensors afterwards."""
    for case, args in _CASES.items():
        model, opt = _fresh(*args)
        got = predict(model, opt)
        assert isinstance(got, dict), f"{case}: expected a dict, got {got!r}"
        _step(model, opt)
        for key, expected in _counted(model, opt).items():
            assert key in got, f"{case}: the result has no {key!r} entry ({sorted(got)})"
            assert got[key] == expected, (
                f"{case}: {key} = {got[key]:,} bytes predicted, the step made "
                f"{expected:,}. " + _HINTS[key])


_HINTS = {
    "params": "Each parameter once (a tied head is one tensor), numel() * element_size() "
              "(bf16 is 2 bytes).",
    "grads": "After backward each parameter has a gradient of its own shape and dtype.",
    "optimizer": "AdamW keeps exp_avg and exp_avg_sq in the parameter's dtype and a "
                 "4-byte fp32 `step` per parameter tensor; SGD keeps one momentum_buffer "
                 "per parameter only when momentum is not 0 (optimizer.defaults says)."}


def measured_layer_bytes(s, b, h, a) -> int:
    """Bytes autograd saves for backward in one fp32 DecoderBlock (no dropout), weights excluded."""
    block = models.DecoderBlock(models.GPTConfig(seq_len=s, hidden=h, heads=a))
    x = torch.randn(b, s, h, requires_grad=True)                # (b, s, h)
    with memory.saved_tensors(exclude=block.parameters()) as saved:
        block(x)
    return saved.bytes


def check_layer_activation_bytes(layer_bytes, rtol=0.02):
    """``layer_bytes(s, b, h, a)`` within ``rtol`` of the bytes one fp32 layer saves."""
    for s, b, h, a in [(64, 2, 64, 4), (32, 4, 128, 8), (128, 2, 64, 2)]:
        measured = measured_layer_bytes(s, b, h, a)
        got = layer_bytes(s, b, h, a)
        assert abs(got - measured) <= rtol * measured, (
            f"s={s}, b={b}, h={h}, a={a}: your formula gives {got:,.0f} bytes, the layer "
            f"saved {measured:,} ({got / measured:.3f} of it). fp32 values are 4 bytes; "
            "the scores term grows as a*s*s*b, the rest as s*b*h")
