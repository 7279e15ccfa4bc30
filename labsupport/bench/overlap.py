"""Time beside bytes, every chapter: measured crossing over the formula's, and overlap.

    python -m labsupport.bench overlap [--default-sizes]

Runs each technique's sweep of ``labsupport.crossings`` (small sizes unless
``--default-sizes``) and prints, per chapter, the size where the measured
compute and communication times cross beside the formula's crossing for
this machine's measured FLOP/s and link. The last line is machine-readable:
``crossing_measured_over_formula_max`` is the worst ratio over chapters,
max(r, 1/r) (goal: within 2x), and ``ring_attn_overlap_speedup_large_block``
the overlapped ring attention's speed-up at a block past its crossing
(goal > 1.1), from chapter 6's sweep.
"""
import argparse

from labsupport import crossings


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m labsupport.bench overlap")
    parser.add_argument("--default-sizes", action="store_true",
                        help="the chapters' own sizes instead of the small ones")
    args = parser.parse_args(argv)
    if not crossings.TECHNIQUES:
        raise SystemExit("no technique has a sweep yet (labsupport.crossings.TECHNIQUES)")
    worst, speedup = 1.0, None
    for chapter, technique in crossings.TECHNIQUES.items():
        c = crossings.run(technique, small=not args.default_sizes)
        ratio = c.ratio
        shown = f"{ratio:.2f}" if ratio else "n/a (no crossing in the sweep)"
        print(f"chapter {chapter} {technique}: {c.size_label} measured "
              f"{_fmt(c.measured)}, formula {_fmt(c.formula)}, ratio {shown}")
        if ratio is None:
            raise SystemExit(f"{technique}: the sweep did not bracket its crossing: widen it")
        worst = max(worst, ratio, 1 / ratio)
        speedup = c.extra.get("overlap_speedup_large_block", speedup)
    line = f"crossing_measured_over_formula_max={worst:.3f}"
    if speedup is not None:
        line += f" ring_attn_overlap_speedup_large_block={speedup:.3f}"
    print(line)


def _fmt(x):
    return "none" if x is None else f"{x:.4g}"


if __name__ == "__main__":
    main()
