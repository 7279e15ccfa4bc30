# Run: .venv/bin/python -m pytest tests/test_memory_calc.py
"""labsupport.memory.calc: the calculator's formulas, against the papers and real tensors."""
import pytest
import torch

from labsupport import models
from labsupport.memory import calc as memory_calc
from labsupport.memory import tally


def test_gpt_params_counts_the_shared_decoder():
    for tie in (True, False):
        cfg = models.GPTConfig(vocab_size=50, seq_len=12, hidden=16, heads=2, layers=3,
                               tie_weights=tie)
        psi = sum(p.numel() for p in models.GPT(cfg).parameters())
        assert memory_calc.gpt_params(3, 16, 50, 12, tie_weights=tie) == psi
    gpt2 = memory_calc.PRESETS["GPT-2 124M"]
    assert memory_calc.gpt_params(12, 768, 50257, 1024) == gpt2.psi   # GPT-2's 124M


def test_korthikanti_table_2_is_the_e2_m1_case():
    s, b, h, a = 2048, 1, 12288, 96
    table_2 = {(1, False): s * b * h * (34 + 5 * a * s / h),          # GPT-3 175B's layer
               (8, False): s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8)),
               (8, True): s * b * h / 8 * (34 + 5 * a * s / h)}
    for (t, sp), paper in table_2.items():
        ours = memory_calc.activation_bytes_per_layer(s, b, h, a, t=t, sp=sp)
        assert ours == pytest.approx(paper)
    sel = memory_calc.activation_bytes_per_layer(s, b, h, a, recompute="selective", t=8, sp=True)
    assert sel == pytest.approx(34 * s * b * h / 8)           # Table 2, selective
    assert memory_calc.activation_bytes_per_layer(s, b, h, a, recompute="full") == 2 * s * b * h


def test_flash_keeps_the_log_sum_exp_instead_of_the_scores():
    s, b, h, a = 2048, 1, 12288, 96
    flash = memory_calc.activation_bytes_per_layer(s, b, h, a, flash=True)
    assert flash == s * b * h * 34 + 4 * a * s * b
    tp = memory_calc.activation_bytes_per_layer(s, b, h, a, t=8, flash=True)
    assert tp == s * b * h * (10 + 24 / 8) + 4 * a * s * b / 8
    # torch's SDPA on CPU (the flash kernel) saves its output and that fp32 row statistic
    b, a, s, d = 2, 4, 16, 8
    q, k, v = (torch.randn(b, a, s, d, requires_grad=True) for _ in range(3))
    with tally.saved_tensors(exclude=[q, k, v]) as saved:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert saved.bytes == 4 * b * a * s * d + 4 * a * s * b


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_one_layer_fp32_matches_what_autograd_saves(dropout):
    s, b, h, a = 16, 3, 32, 4
    cfg = models.GPTConfig(seq_len=s, hidden=h, heads=a, dropout=dropout)
    block = models.GPT(cfg).blocks[0]
    x = torch.randn(b, s, h, requires_grad=True)
    with tally.saved_tensors(exclude=block.parameters()) as saved:
        block(x)
    # CPU dropout keeps its fp32 multiplier: m = e = 4 bytes per element.
    formula = memory_calc.activation_bytes_per_layer(s, b, h, a, e=4, dropout=dropout > 0, m=4)
    extras = 2 * 2 * 4 * s * b + s * s   # LayerNorm mean/rstd, the causal mask
    assert saved.bytes == formula + extras


def test_training_memory_reproduces_the_lectures_numbers():
    seven_b = memory_calc.PRESETS["7B"]
    states = memory_calc.training_memory(seven_b, 1, 1)
    assert states["params"] + states["grads"] + states["optimizer"] == 112e9
    assert memory_calc.max_params(80e9) == 5e9
    gpt3 = memory_calc.training_memory(memory_calc.PRESETS["GPT-3 175B"], 2048, 1)
    assert gpt3["total"] - gpt3["activations"] == 2.8e12      # 16 B x 175B
    z3 = memory_calc.training_memory(seven_b, 1, 1, n=64, parallelism="zero3")
    assert z3["params"] + z3["grads"] + z3["optimizer"] == 112e9 / 64


def test_training_memory_parallelisms_cut_the_right_terms():
    m = memory_calc.PRESETS["7B"]
    dp = memory_calc.training_memory(m, 4096, 1, n=8, parallelism="dp")
    for name, cut in [("zero1", {"optimizer"}), ("zero2", {"optimizer", "grads"}),
                      ("tp+sp", {"params", "grads", "optimizer", "activations"}),
                      ("pp", {"params", "grads", "optimizer"}), ("cp", {"activations"})]:
        got = memory_calc.training_memory(m, 4096, 1, n=8, parallelism=name)
        assert {k for k in cut} == {k for k in dp if k != "total" and got[k] < dp[k]}, name
    full = memory_calc.training_memory(m, 4096, 1, checkpointing="full")
    assert full["activations"] == 32 * 2 * 4096 * 4096


def test_bad_arguments_say_what_to_use():
    m = memory_calc.PRESETS["7B"]
    with pytest.raises(ValueError, match="use one of"):
        memory_calc.training_memory(m, 1, 1, parallelism="fsdp")
    with pytest.raises(ValueError, match="use one of"):
        memory_calc.activation_bytes_per_layer(1, 1, 8, 2, recompute="some")
    with pytest.raises(ValueError, match="divide"):
        memory_calc.activation_bytes_per_layer(1, 1, 8, 2, t=3)
    with pytest.raises(ValueError, match=">= 1"):
        memory_calc.training_memory(m, 1, 1, n=0)
