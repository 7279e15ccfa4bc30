"""Chapter 0's your-turn checks: a model's states counted, one layer's activations.

    from labsupport.grading.chapters import memory as checks
    checks.check_state_bytes(state_bytes)
    checks.check_layer_activation_bytes(layer_activation_bytes)

Each check runs the reader's function on models built here and compares it
with bytes counted from real tensors, raising an AssertionError that names
the case, the category and both numbers.
"""
import torch

from labsupport import memory, models

_SMALL = dict(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2)


def _stepped(tie_weights, dtype, optimizer):
    """A small GPT in ``dtype`` after one step of ``optimizer`` (its gradients kept)."""
    model = models.GPT(models.GPTConfig(**_SMALL, tie_weights=tie_weights)).to(dtype)
    opt = optimizer(model.parameters())
    ids, targets = models.toy_tokens(2, _SMALL["seq_len"], _SMALL["vocab_size"])
    model(ids, targets).backward()
    opt.step()
    return model, opt


def check_state_bytes(state_bytes):
    """``state_bytes(model, optimizer)`` -> {"params", "grads", "optimizer"}: bytes counted."""
    cases = {
        "fp32 GPT, tied head, AdamW": (True, torch.float32, torch.optim.AdamW),
        "bf16 GPT, untied head, AdamW": (False, torch.bfloat16, torch.optim.AdamW),
        "fp32 GPT, SGD with momentum": (True, torch.float32,
                                        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    }
    for case, args in cases.items():
        model, opt = _stepped(*args)
        params = list(model.parameters())
        want = {"params": memory.storage_bytes(params),
                "grads": memory.storage_bytes(p.grad for p in params),
                "optimizer": memory.optimizer_state_bytes(opt)}
        got = state_bytes(model, opt)
        for key, expected in want.items():
            assert key in got, f"{case}: the result has no {key!r} entry ({sorted(got)})"
            assert got[key] == expected, (
                f"{case}: {key} = {got[key]:,} bytes, counted {expected:,}. Count each "
                "tensor's numel() * element_size() (bf16 is 2 bytes), every tensor the "
                "optimizer keeps (AdamW: step, exp_avg, exp_avg_sq; SGD: momentum_buffer)")


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
