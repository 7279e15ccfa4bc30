"""Chapter 11: the composed trainer's parity, speed beside PyTorch's composition, MFU, resume.

    python -m labsupport.bench capstone [--steps 4] [--speed-layout 2 2 2 1]
                                        [--speed-steps 6] [--repeats 3] [--no-16]
                                        [--layouts 2,1,1,1 ...] [--hidden 64 ...]
                                        [--clip-layouts 3,1,1,1 ...]
                                        [--memory-layouts 2,2,2,2 ...]

On the capstone's decoder and the Bible's bytes (``labsupport.capstone``):

- parity: every layout of the chapter, (1,1,1,1) ... (2,2,2,1) and the 4-D
  (2,2,2,2) on 16 ranks, against one process (``compare.parity_table``):
  the step-0 loss's relative difference and the curve's over ``--steps``;
- speed: the hand-composed trainer with ZeRO-2 over dp x cp (``trainer.train(...,
  zero=2)``, the lessons' code) and PyTorch's composition (``native.train``:
  FSDP2 without resharding after forward, the same algorithm, DTensor TP + SP,
  ``Schedule1F1B``) on the same layout, sizes and global batch, run
  alternately, tokens/s over the steps after warm-up (medians); their step
  ratio (hand / PyTorch: below 1, the hand-composed step is faster);
- MFU of the hand-composed run against this machine's measured float32
  matmul peak on all its cores (``capstone.flops``: 6N + 12·L·h·s FLOPs
  per token; per machine, since the ranks share its cores);
- resume: a run checkpointed at (2,2,2,1) half-way and resumed at (4,1,2,1)
  against the uninterrupted run, every loss within ``compare.LOSS_RTOL``;
- clipping: the trainer's ``clip_norm`` (``capstone.clip``) in float64 at
  layouts with a degree 3, against one process's ``clip_grad_norm_``: the
  largest relative difference of the pre-clip norms, the clipped gradients of
  every step and the loss curve;
- memory: on every rank of ``MEMORY_LAYOUTS`` (plain and ZeRO-2), the bytes of
  parameters, gradients, optimizer state and peak saved activations counted
  after one step (``capstone.footprint``) over chapter 0's formulas: the
  rank's total over the formula's, the worst (farthest from 1) of all ranks.
- one rank: the 1 x 1 x 1 x 1 trainer's step over the one-process
  ``models.GPT`` step (``baseline.one_rank_overhead``: one rank, the same
  threads, taking turns, medians), with one micro-batch, as the one-process
  step takes the batch whole (at pp = 1, m > 1 is gradient accumulation,
  whose smaller matmuls are the same cost in any trainer).

The last line is machine-readable: ``capstone_step0_rel_diff=<max over
layouts> capstone_curve_rel_diff=<max over layouts and steps>
capstone_step_ratio_vs_native=<x> capstone_mfu_measured_peak=<y>
capstone_resume_equal=<0|1> capstone_clip_rel_diff=<max>
capstone_memory_vs_formula=<worst ratio>
capstone_one_rank_overhead=<x>``. Goals: step 0 <= 1e-6, curve <=
1e-4, step ratio <= 1.0, resume 1, clip <= 1e-6, memory 0.95 to 1.05, one rank <=
1.10. Timings are this machine's, under its load.
"""
import argparse
import math
import os

LAYOUTS = [(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2),
           (2, 2, 2, 1)]
FOUR_D = (2, 2, 2, 2)
SAVED_AT, RESUMED_AT = (2, 2, 2, 1), (4, 1, 2, 1)
CLIP_LAYOUTS = [(3, 1, 1, 1), (1, 3, 1, 1), (1, 1, 3, 1), (1, 1, 1, 3), (2, 2, 2, 1)]
# a decoder that every degree 3 divides; the norms of its first steps are 0.98 to 1.2
CLIP_RUN = dict(batch=12, seq_len=36, clip_norm=0.5,
                model=dict(vocab_size=258, hidden=48, heads=6, layers=3))


def parity(args) -> list:
    from labsupport.capstone import compare
    layouts = [tuple(x) for x in args.layouts] if args.layouts else (
        LAYOUTS + ([] if args.no_16 else [FOUR_D]))
    rows = compare.parity_table(layouts, steps=args.steps)
    for r in rows:
        print(f"parity {r['layout']:>24}: step 0 {r['step0_rel']:.1e}  "
              f"grads {r['grad_rel']:.1e}  curve {r['curve_rel']:.1e}")
    return rows


def speed(args) -> dict:
    """tokens/s of the hand-composed and the PyTorch-composed trainer on one
    layout, run alternately (``native.step_time_ratio``: medians of repeats)."""
    from labsupport.capstone import native
    layout, n = tuple(args.speed_layout), math.prod(args.speed_layout)
    r = native.step_time_ratio(layout, steps=args.speed_steps, repeats=args.repeats,
                               batch=args.batch, seq_len=args.seq_len,
                               micro_batches=args.micro_batches, warmup=2,
                               model=dict(hidden=args.hidden, heads=args.heads,
                                          layers=args.layers, seq_len=args.seq_len))
    for name in ("hand", "native"):
        tps = r[f"{name}_tokens_per_s"]
        print(f"speed {name:>6} {layout}: {tps:,.0f} tokens/s ({tps / n:,.0f} per rank), "
              f"median of {args.repeats}")
    return r


def mfu(tokens_per_s, args) -> float:
    from labsupport.capstone import flops, model
    cfg = model.config(hidden=args.hidden, heads=args.heads, layers=args.layers,
                       seq_len=args.seq_len)
    per_token = flops.per_token(cfg, args.seq_len)
    peak = flops.measured_peak()
    value = flops.mfu(tokens_per_s, per_token, peak)
    print(f"mfu: {tokens_per_s:,.0f} tokens/s x {per_token:,.0f} FLOPs/token over "
          f"{peak / 1e9:.1f} GFLOP/s measured (float32 matmul, "
          f"{len(os.sched_getaffinity(0))} threads) = {value:.2%}")
    return value


def resume(args) -> bool:
    """Saved at SAVED_AT half-way, resumed at RESUMED_AT (``compare.resume_parity``):
    the losses of the uninterrupted run?"""
    from labsupport.capstone import compare
    steps, half = args.steps * 2, args.steps
    r = compare.resume_parity(SAVED_AT, RESUMED_AT, steps=steps, save_at=half)
    print(f"resume: saved at {SAVED_AT} after {half} steps, resumed at {RESUMED_AT}: "
          f"steps {half}..{steps - 1} within {r['max_rel']:.1e} of the uninterrupted "
          f"run ({'equal' if r['equal'] else 'NOT equal'} at {compare.LOSS_RTOL:g})")
    return r["equal"]


def clip(args) -> float:
    """Clipped training at ``CLIP_LAYOUTS`` (float64) against one process clipping
    with ``torch.nn.utils.clip_grad_norm_``: the largest relative difference."""
    import torch

    from labsupport.capstone import compare, trainer
    from labsupport.launch import session
    layouts = [tuple(x) for x in args.clip_layouts] if args.clip_layouts else CLIP_LAYOUTS
    steps = tuple(range(args.steps))
    ref = trainer.reference(args.steps, record_grads=steps, dtype=torch.float64, **CLIP_RUN)
    if min(ref["grad_norms"]) <= CLIP_RUN["clip_norm"]:
        raise SystemExit(f"clip: the norms {ref['grad_norms']} do not pass "
                         f"{CLIP_RUN['clip_norm']}: nothing would be clipped")
    worst = 0.0
    for layout in layouts:
        outs = session.run(trainer.train, layout, args.steps, record_grads=steps,
                           dtype=torch.float64, backend="gloo",
                           world_size=math.prod(layout), **CLIP_RUN)
        norm = max(abs(a - b) / b for o in outs
                   for a, b in zip(o["grad_norms"], ref["grad_norms"]))
        p = compare.parity(outs, ref)
        print(f"clip {layout}: norms {norm:.1e}  clipped grads {p['grad_rel']:.1e}  "
              f"curve {p['curve_rel']:.1e} (float64, max_norm {CLIP_RUN['clip_norm']}, "
              f"one-process norms {min(ref['grad_norms']):.2f} to "
              f"{max(ref['grad_norms']):.2f})")
        worst = max(worst, norm, *p.values())
    return worst


MEMORY_LAYOUTS = [(2, 2, 2, 2), (3, 1, 2, 1), (1, 3, 3, 1)]
MEMORY_RUN = {k: v for k, v in CLIP_RUN.items() if k != "clip_norm"}


def memory(args) -> float:
    """Bytes per rank measured over the formulas (``footprint.table``), plain and
    with ZeRO-2 where dp·cp > 1: the rank total's ratio farthest from 1."""
    from labsupport.capstone import footprint
    from labsupport.launch import session
    layouts = [tuple(x) for x in args.memory_layouts] if args.memory_layouts else \
        MEMORY_LAYOUTS
    worst = 1.0
    for layout in layouts:
        for zero in (0, 2) if layout[0] * layout[3] > 1 else (0,):
            rows = session.run(footprint.measure, layout, zero=zero, backend="gloo",
                               world_size=math.prod(layout), **MEMORY_RUN)
            table = footprint.table(rows, layout, zero=zero, **MEMORY_RUN)
            totals = [sum(r[k] for k in footprint.KEYS) / sum(r["formula"].values())
                      for r in table]
            states = [r["ratio"][k] for r in table for k in footprint.STATES]
            acts = [r["ratio"]["activations"] for r in table]
            worst = max([worst] + totals, key=lambda x: abs(x - 1))
            print(f"memory {layout} zero={zero}: measured / formula per rank: total "
                  f"{min(totals):.3f} to {max(totals):.3f}, states {min(states):.3f} to "
                  f"{max(states):.3f}, peak activations {min(acts):.3f} to {max(acts):.3f}")
    return worst


def one_rank(args) -> float:
    """The 1 x 1 x 1 x 1 trainer's step over the one-process ``models.GPT`` step
    (``baseline.one_rank_overhead``), the speed run's sizes, one micro-batch."""
    from labsupport.capstone import baseline
    r = baseline.one_rank_overhead(steps=args.speed_steps, repeats=args.repeats,
                                   batch=args.batch, seq_len=args.seq_len, micro_batches=1,
                                   model=dict(hidden=args.hidden, heads=args.heads,
                                              layers=args.layers, seq_len=args.seq_len))
    print(f"one rank: trainer.train (1,1,1,1) {r['trainer_tokens_per_s']:,.0f} tokens/s, "
          f"models.GPT in one process {r['plain_tokens_per_s']:,.0f}, {r['threads']} "
          f"threads each, medians of {args.repeats}: step ratio {r['ratio']:.3f}")
    return r["ratio"]


def _layout(text):
    parts = tuple(int(x) for x in text.split(","))
    if len(parts) != 4 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"a layout is dp,tp,pp,cp (4 positive "
                                         f"integers), got {text!r}")
    return parts


def main(argv):
    parser = argparse.ArgumentParser(prog="python -m labsupport.bench capstone")
    parser.add_argument("--steps", type=int, default=4, help="parity steps (default 4)")
    parser.add_argument("--no-16", action="store_true", help="skip the 16-rank layout")
    parser.add_argument("--layouts", type=_layout, nargs="+", metavar="DP,TP,PP,CP",
                        help="parity on these layouts only (default: the chapter's)")
    parser.add_argument("--clip-layouts", type=_layout, nargs="+", metavar="DP,TP,PP,CP",
                        help="clipping parity on these layouts (default: CLIP_LAYOUTS)")
    parser.add_argument("--memory-layouts", type=_layout, nargs="+", metavar="DP,TP,PP,CP",
                        help="memory per rank on these layouts (default: MEMORY_LAYOUTS)")
    parser.add_argument("--speed-layout", type=int, nargs=4, default=[2, 2, 2, 1],
                        metavar=("DP", "TP", "PP", "CP"))
    parser.add_argument("--speed-steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="speed runs of each")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    rows = parity(args)
    tps = speed(args)
    value = mfu(tps["hand_tokens_per_s"], args)
    equal = resume(args)
    clip_rel = clip(args)
    mem = memory(args)
    overhead = one_rank(args)
    print(f"capstone_step0_rel_diff={max(r['step0_rel'] for r in rows):.3e} "
          f"capstone_curve_rel_diff={max(r['curve_rel'] for r in rows):.3e} "
          f"capstone_step_ratio_vs_native={tps['ratio']:.3f} "
          f"capstone_mfu_measured_peak={value:.4f} "
          f"capstone_resume_equal={int(equal)} "
          f"capstone_clip_rel_diff={clip_rel:.3e} "
          f"capstone_memory_vs_formula={mem:.4f} "
          f"capstone_one_rank_overhead={overhead:.3f}")
