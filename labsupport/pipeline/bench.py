"""Chapter 5: pipeline bubbles measured from recorded timelines, beside the formulas.

    python -m labsupport.bench pipeline [--world-sizes 2 4] [--width 1024] [--rows 128]
                                        [--ms 2 4 8] [--runs 3] [--tolerance 0.1]

For each schedule (naive, GPipe, 1F1B, interleaved 1F1B with v=2), world
size and number of micro-batches m, it prints the bubble as a fraction of
the wall time: the formula (p-1)/(v·m+p-1), the replay (the run's own
compute durations with free messages) and the measured one, their ratio
(m/f), whether it is within the tolerance, the bubble as idle time over
ideal compute (formula (p-1)/(v·m) / measured), and the CPU share the ranks
got. Each
configuration is run ``--runs`` times; the least disturbed run is kept.
Ranks get one thread each: with more ranks than cores they share the cores,
and the measurement says so (CPU share < 100%).
"""
import argparse
import time

from labsupport.launch import session
from labsupport.pipeline import bubbles, pipeline


def plan(p, ms):
    yield pipeline.train_step_naive, 1, 1
    for m in ms:
        yield pipeline.train_step_afab, m, 1
        yield pipeline.train_step_1f1b, m, 1
        if m % p == 0:
            yield pipeline.train_step_interleaved, m, 2


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m labsupport.bench pipeline",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--width", type=int, default=1024, help="hidden size h")
    parser.add_argument("--rows", type=int, default=128, help="samples per micro-batch")
    parser.add_argument("--ms", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tolerance", type=float, default=0.10)
    args = parser.parse_args(argv)
    kw = dict(d_in=32, width=args.width, depth=9, d_out=8, seed=0)
    print(f"{'schedule':>12} {'p':>2} {'m':>2} {'v':>2} {'formula':>8} {'replay':>8} "
          f"{'measured':>8} {'m/f':>6} {'within':>7} {'idle/compute':>13} {'CPU':>5}")
    start, matched, total = time.perf_counter(), 0, 0
    for p in args.world_sizes:
        cluster = session.start(world_size=p, threads=1)
        for schedule, m, v in plan(p, args.ms):
            r = bubbles.measure(cluster, schedule, m, v, kw, rows=args.rows, runs=args.runs)
            ok = bubbles.within(r, args.tolerance)
            matched, total = matched + ok, total + 1
            print(f"{r['schedule']:>12} {p:2d} {m:2d} {v:2d} {r['formula']:8.3f} "
                  f"{r['replay']:8.3f} {r['measured']:8.3f} {r['measured'] / r['formula']:6.2f} "
                  f"{'yes' if ok else 'no':>7} "
                  f"{r['formula_ratio']:6.3f}/{r['measured_ratio']:.3f} "
                  f"{min(r['cpu_share'], 1):5.0%}", flush=True)
    session.shutdown()
    print(f"{matched} of {total} configurations within {args.tolerance:.0%} of the formula; "
          f"took {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
