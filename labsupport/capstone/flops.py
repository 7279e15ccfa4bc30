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
- ``cpu_theoretical_peak``: physical cores x clock x FLOPs per cycle, from
  what ``/proc/cpuinfo`` says; the FLOPs per cycle of an x86 core depend on
  its FMA units, which cpuinfo does not say, so one and two units are both
  given.

Cores, not logical CPUs: ``os.cpu_count()`` and ``os.sched_getaffinity`` count
logical CPUs, and two hardware threads of one core (SMT) share its FMA units.
``cpu_counts`` gives the three numbers side by side; in a virtual machine the
cores are the ones the hypervisor presents, and how they map to the host's
the guest cannot see.
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


def cpu_counts(cpuinfo="/proc/cpuinfo") -> dict:
    """{'cpu_count', 'affinity', 'cores', 'virtual'}: ``os.cpu_count()`` (logical
    CPUs of the machine), ``len(os.sched_getaffinity(0))`` (the logical CPUs this
    process may run on), the physical cores those sit on (distinct ``physical
    id`` and ``core id`` pairs of cpuinfo; the logical count where cpuinfo has
    no such fields), and whether cpuinfo's flags say a hypervisor runs it."""
    text = open(cpuinfo).read()
    mine, cores = os.sched_getaffinity(0), set()
    for entry in text.strip().split("\n\n"):
        fields = dict(re.findall(r"^([^\t:]+?)\s*:\s*(.*)$", entry, re.M))
        if "processor" in fields and int(fields["processor"]) in mine \
                and "core id" in fields:
            cores.add((fields.get("physical id"), fields["core id"]))
    flags = re.search(r"^flags\s*:(.*)$", text, re.M)
    return dict(cpu_count=os.cpu_count(), affinity=len(mine),
                cores=len(cores) or len(mine),
                virtual=bool(flags) and "hypervisor" in flags.group(1).split())


def cpu_theoretical_peak(cpuinfo="/proc/cpuinfo") -> dict:
    """{'cores', 'ghz', 'isa', 'low', 'high', 'model'}: float32 FLOP/s of the
    physical cores this process may use (``cpu_counts``) at the clock cpuinfo
    reports, for one or two FMA units of the widest vector it lists (an FMA is
    2 FLOPs per lane: AVX-512 has 16 float32 lanes, AVX2 8). Which applies is
    the core's, not cpuinfo's: even one product line mixes both (Intel's
    specification pages list "# of AVX-512 FMA Units": 2 on the Xeon Gold
    6130, 1 on the Gold 5120, https://ark.intel.com/products/series/125191;
    tabulated from those pages in github.com/jeffhammond/vpu-count). The
    clock is the one cpuinfo shows, often the base clock in a virtual
    machine; a core that boosts above it can outrun ``low``."""
    text = open(cpuinfo).read()
    flags = set(re.search(r"^flags\s*:(.*)$", text, re.M).group(1).split())
    mhz = float(re.search(r"^cpu MHz\s*:\s*([\d.]+)", text, re.M).group(1))
    model = re.search(r"^model name\s*:\s*(.*)$", text, re.M).group(1).strip()
    cores = cpu_counts(cpuinfo)["cores"]
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
