"""Time beside bytes, every chapter: measured crossing over the formula's, and overlap.

    python -m labsupport.bench overlap [--default-sizes] [--chapters 4 6]

Runs each chapter's sweep, ``labsupport/<topic>/crossing.py`` (small sizes unless
``--default-sizes``; every chapter unless ``--chapters``) and prints, per
chapter, the size where the measured compute and communication times cross
beside the formula's crossing for this machine's measured FLOP/s and link,
and for chapter 6 the ring's overlap speed-up at each block length beside
the most overlap could give there. The last line is machine-readable:
``crossing_measured_over_formula_max`` is the worst ratio over chapters,
max(r, 1/r) (goal: within 2x), and ``ring_attn_overlap_speedup_large_block``
the overlapped ring attention's speed-up at the first block past its
crossing (goal > 1.1), from chapter 6's sweep. A value that a sweep could
not give (no crossing in it, no block past it) is printed as ``none``, and
the script then exits with status 1, saying which.
"""
import argparse
import sys

import labsupport.context_parallel.crossing
import labsupport.data_parallel.crossing
import labsupport.device_mesh.crossing
import labsupport.expert_parallel.crossing
import labsupport.pipeline.crossing
import labsupport.tensor_parallel.crossing
import labsupport.zero.crossing

# chapter -> its time-beside-bytes sweep (its topic's crossing.py), in the book's order
SWEEPS = {3: labsupport.data_parallel.crossing, 4: labsupport.tensor_parallel.crossing,
          5: labsupport.pipeline.crossing, 6: labsupport.context_parallel.crossing,
          7: labsupport.zero.crossing, 8: labsupport.device_mesh.crossing,
          9: labsupport.expert_parallel.crossing}


def technique(chapter):
    """The sweep's topic folder: ``labsupport.zero.crossing`` -> ``zero``."""
    return SWEEPS[chapter].__name__.split(".")[1]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m labsupport.bench overlap")
    parser.add_argument("--default-sizes", action="store_true",
                        help="the chapters' own sizes instead of the small ones")
    parser.add_argument("--chapters", type=int, nargs="+", metavar="N",
                        default=sorted(SWEEPS),
                        help="chapters to run (default: every one with a sweep)")
    args = parser.parse_args(argv)
    unknown = set(args.chapters) - set(SWEEPS)
    if unknown:
        parser.error(f"no sweep for chapter(s) {sorted(unknown)}: "
                     f"choose among {sorted(SWEEPS)}")
    ratios, missing, speedup = [], [], None
    for chapter in args.chapters:
        name = technique(chapter)
        c = SWEEPS[chapter].sweep(small=not args.default_sizes)
        print(f"chapter {chapter} {name}: {c.size_label} measured "
              f"{_fmt(c.measured)}, formula {_fmt(c.formula)}, ratio {_fmt(c.ratio)}",
              flush=True)
        ratios.append(c.ratio and max(c.ratio, 1 / c.ratio))
        if c.ratio is None:
            missing.append(f"chapter {chapter} {name}: the sweep did not bracket "
                           "its crossing (widen its sizes)")
        if name == "context_parallel":
            speedup = _ring_overlap(c)
            if speedup is None:
                missing.append("chapter 6: no block past the crossing, so no "
                               "ring_attn_overlap_speedup_large_block")
    worst = None if None in ratios else max(ratios)   # the worst is unknown if one is
    line = f"crossing_measured_over_formula_max={_fmt(worst, 3)}"
    if 6 in args.chapters:
        line += f" ring_attn_overlap_speedup_large_block={_fmt(speedup, 3)}"
    print(line, flush=True)
    if missing:
        sys.exit("not measured: " + "; ".join(missing))


def _ring_overlap(c):
    """Print each block's speed-up beside its bound; the large block's speed-up."""
    x = c.extra
    for size, up, most in zip(c.sizes, x["speedup"], x["bound"]):
        print(f"  c={size:>5}: overlap speed-up x{up:.2f} (bound x{most:.2f})")
    large = x["large_block"]
    if large is None:
        return None
    most = x["bound"][c.sizes.index(large)]
    print(f"  large block (first past the crossing): c={large}, "
          f"x{x['overlap_speedup_large_block']:.2f}, bound x{most:.2f}")
    return x["overlap_speedup_large_block"]


def _fmt(x, digits=None):
    if x is None:
        return "none"
    return f"{x:.{digits}f}" if digits else f"{x:.4g}"


if __name__ == "__main__":
    main()
