"""Chapter 0's your-turn checks: a model's states predicted, a SwiGLU block's activations.

    from labsupport.memory import checks
    checks.check_predicted_state_bytes(predicted_state_bytes)
    checks.check_swiglu_block_bytes(swiglu_block_bytes)

Each check runs the reader's function on models built here and compares it
with bytes counted from real tensors, raising an AssertionError that names
the case, the category and both numbers.
"""
import torch

from labsupport import models
from labsupport.memory import tally

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
    return {"params": tally.storage_bytes(params),
            "grads": tally.storage_bytes(p.grad for p in params),
            "optimizer": tally.optimizer_state_bytes(opt)}


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


class SwiGLUBlock(torch.nn.Module):
    """A pre-LayerNorm SwiGLU MLP sub-block, fp32, no biases (Shazeer 2020, GLU
    Variants Improve Transformer, arXiv 2002.05202; Llama's MLP): x + down(silu(gate(y))
    * up(y)), y = LayerNorm(x); gate and up h -> f, down f -> h."""

    def __init__(self, h, f):
        super().__init__()
        self.norm = torch.nn.LayerNorm(h)
        self.gate = torch.nn.Linear(h, f, bias=False)
        self.up = torch.nn.Linear(h, f, bias=False)
        self.down = torch.nn.Linear(f, h, bias=False)

    def forward(self, x):                                       # (b, s, h)
        y = self.norm(x)
        return x + self.down(torch.nn.functional.silu(self.gate(y)) * self.up(y))


def measured_swiglu_bytes(s, b, h, f) -> int:
    """Bytes autograd saves for backward in one ``SwiGLUBlock(h, f)`` on (b, s, h),
    weights excluded (``tally.saved_tensors``, distinct storages)."""
    block = SwiGLUBlock(h, f)
    x = torch.randn(b, s, h, requires_grad=True)                # (b, s, h)
    with tally.saved_tensors(exclude=block.parameters()) as saved:
        block(x)
    return saved.bytes


# f not a multiple of h (Llama's f is about 8h/3, rounded): the f terms stand apart
SWIGLU_SHAPES = [(64, 2, 64, 176), (32, 4, 128, 344), (16, 3, 96, 256)]


def check_swiglu_block_bytes(block_bytes, rtol=0.02):
    """``block_bytes(s, b, h, f)`` within ``rtol`` of what a ``SwiGLUBlock`` saves."""
    for s, b, h, f in SWIGLU_SHAPES:
        measured = measured_swiglu_bytes(s, b, h, f)
        got = block_bytes(s, b, h, f)
        assert abs(got - measured) <= rtol * measured, (
            f"s={s}, b={b}, h={h}, f={f}: your formula gives {got:,.0f} bytes, the "
            f"block saved {measured:,} ({got / measured:.3f} of it). fp32 values are 4 "
            "bytes; ask of each operation what its own backward needs: a Linear its "
            "input, SiLU its input, an elementwise product both factors; a tensor two "
            "operations save is kept once")
