"""Bus bandwidth of every collective of ``torch.distributed`` over message sizes.

    python -m labsupport.bench collectives [--world-sizes 2 4] [--max-mib 64] [--repeats 5]

Uses ``labsupport.sweep`` (nccl-tests' conventions: algbw = S/t,
busbw = algbw times the collective's factor). The last line is
machine-readable: ``busbw_GBps_<op>_w<N>=<x>`` at the largest size.
"""
import argparse

from labsupport import sweep


def main(argv):
    from labsupport.launch import session

    parser = argparse.ArgumentParser(prog="python -m labsupport.bench collectives")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-mib", type=int, default=64, help="largest message (default 64)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per size (median)")
    parser.add_argument("--ops", nargs="+", default=list(sweep.COLLECTIVES),
                        choices=sweep.COLLECTIVES)
    parser.add_argument("--backend", default="auto", help="auto, gloo or nccl")
    args = parser.parse_args(argv)
    nbytes_list = sweep.sizes(1 << 10, args.max_mib << 20, step=4)
    rows = []
    for world_size in args.world_sizes:
        with session.start(world_size=world_size, backend=args.backend) as cluster:
            for op in args.ops:  # one op at a time: each sweep is a sequence of sizes
                rows += sweep.run(cluster, op, nbytes_list, warmup=2,
                                  repeats=args.repeats, timeout=600)
    print(sweep.table(rows))
    top = nbytes_list[-1]
    print(" ".join(f"busbw_GBps_{r.label}_w{r.world_size}={r.busbw / sweep.GB:.3f}"
                   for r in rows if r.nbytes == top))
