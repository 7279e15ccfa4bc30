"""FLOPs per token, peaks and MFU for the capstone, stated rather than assumed.

    per_token = flops.per_token(cfg, seq_len)                # 6N + 12·L·h·s
    per_token_causal = flops.per_token(cfg, seq_len, causal=True)
    peak = flops.measured_peak(threads=2)                    # FLOP/s of a matmul here
    flops.mfu(tokens_per_s, per_token, peak)
    flops.rank_flops(cfg, seq_len, layout, pp_rank, cp_rank)   # one rank's share

MFU (model FLOPs utilisation, Chowdhery et al. 2022, PaLM, arXiv 2204.02311,
appendix B) is the model's FLOPs per second over a peak; it says nothing
unless the peak is said. Two are given here, per machine (ranks on one machine
share its cores, so a per-rank peak would count the cores once per rank):

- ``measured_peak``: this machine's float32 matmul throughput, measured at the
  thread count the ranks use together (what the CPU really does on the
  decoder's biggest kind of work);
- ``cpu_theoretical_peak``: cores x clock x FLOPs per cycle, from what
  ``/proc/cpuinfo`` says; the FLOPs per cycle of an x86 core depend on its
  FMA units, which cpuinfo does not say, so the two widths a core with that
  instruction set may have are both given.
"""
import os
import re

import torch

from labsupport import overlap
from labsupport.capstone.model import stage_blocks


def per_token(cfg, seq_len, causal=False) -> float:
    """Training FLOPs (forward + backward) per token of ``models.GPT(cfg)`` on
    sequences of ``seq_len``: ``overlap.decoder_flops``' count, 6N + 12·L·h·s,
    or 6N + 6·L·h·s with ``causal`` (see there for who counts which)."""
    return overlap.decoder_flops(1, seq_len, cfg.layers, cfg.hidden, cfg.vocab_size,
                                 cfg.ffn or None, causal=causal)


def measured_peak(threads=None, n=1024, repeats=5) -> float:
    """FLOP/s of an n x n x n float32 matmul on ``threads`` threads (default:
    every core this process may use), the median of ``repeats``."""
    threads = threads or len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return overlap.matmul_flops(n, n, n, repeats=repeats)
    finally:
        torch.set_num_threads(before)


def cpu_theoretical_peak(cpuinfo="/proc/cpuinfo") -> dict:
    """{'cores', 'ghz', 'isa', 'low', 'high', 'model'}: float32 FLOP/s of this
    machine's cores at the clock cpuinfo reports, for one or two FMA units of
    the widest vector it lists (an FMA is 2 FLOPs per lane: AVX-512 has 16
    float32 lanes, AVX2 8). Which applies is the core's, not cpuinfo's: AMD's
    Zen 4 runs a 512-bit FMA as two 256-bit halves (16 lanes per cycle, like
    two AVX2 units), Intel's Xeon Gold and Platinum have two 512-bit FMA units
    (Intel 64 and IA-32 Architectures Optimization Reference Manual, ch. 2).
    The clock is the one cpuinfo shows, often the base clock in a virtual
    machine; a core that boosts above it can outrun ``low``."""
    text = open(cpuinfo).read()
    flags = set(re.search(r"^flags\s*:(.*)$", text, re.M).group(1).split())
    mhz = float(re.search(r"^cpu MHz\s*:\s*([\d.]+)", text, re.M).group(1))
    model = re.search(r"^model name\s*:\s*(.*)$", text, re.M).group(1).strip()
    cores = len(os.sched_getaffinity(0))
    isa, lanes = ("avx512f", 16) if "avx512f" in flags else (
        ("avx2", 8) if "avx2" in flags else ("sse", 4))
    fma = 2 if "fma" in flags or isa == "avx512f" else 1   # multiply-add: 2 FLOPs
    per_unit = cores * mhz * 1e6 * lanes * fma
    return dict(model=model, cores=cores, ghz=mhz / 1e3, isa=isa,
                low=per_unit, high=2 * per_unit)


def mfu(tokens_per_s, flops_per_token, peak) -> float:
    """Model FLOPs utilisation: the model's FLOP/s over ``peak``."""
    return tokens_per_s * flops_per_token / peak


def rank_flops(cfg, seq_len, layout, pp_rank, cp_rank) -> float:
    """Training FLOPs (forward + backward, 3x the forward, 2 per multiply-add)
    that the rank at pipeline stage ``pp_rank`` and cp rank ``cp_rank`` of
    ``layout`` = (dp, tp, pp, cp) does for one sequence of its replica, as
    ``capstone.model.Stage`` computes it (tests/test_capstone.py counts its
    forward with ``torch.utils.flop_counter``):

    - its blocks (``model.stage_blocks``: contiguous, near-equal runs), each
      6·12·h² per position, on its c = s/cp positions, every matmul split
      over tp (Megatron's column and row halves, the heads);
    - attention over a causal ring: cp rank i visits the key blocks 0..i
      and computes each whole (the diagonal one masked, the later ones
      skipped: chapter 6), 6·2·h·c² per block, the heads split over tp;
    - the LM head on the last stage only, 6·h·V per position, column-parallel
      over tp; the token embedding is a lookup (no FLOPs).
    """
    h, tp = cfg.hidden, layout.tp
    c = seq_len // layout.cp
    blocks = len(stage_blocks(cfg.layers, layout.pp, pp_rank))
    matmuls = blocks * (4 * h * h + 2 * h * cfg.ffn_hidden)
    if pp_rank == layout.pp - 1:
        matmuls += h * cfg.vocab_size
    attention = blocks * 2 * h * c * c * (cp_rank + 1)
    return 6 * (c * matmuls + attention) / tp
