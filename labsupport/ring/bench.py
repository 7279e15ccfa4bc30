"""The hand-written ring all-reduce beside ``dist.all_reduce``, busbw by message size.

    python -m labsupport.bench ring [--world-sizes 2 4] [--max-mib 64] [--repeats 9]

Chapter 2's ``labsupport.ring.ring.ring_allreduce`` and the library's all-reduce
take turns at every size on the same ranks (``labsupport.sweep``:
warm-up, median of repeats, nccl-tests' busbw). The last line is
machine-readable: ``ring_busbw_ratio_64MiB=<x> ring_busbw_ratio_64MiB_w4=<y>``,
the ring's busbw over the library's at the largest size on 2 ranks and, when
4 is among the world sizes, on 4 (the aim is >= 1.0 at both: overlapping
the send with the reduction is what can beat gloo's own ring).
"""
import argparse

from labsupport import sweep

HAND, LIBRARY = "ring_allreduce", "dist.all_reduce"


def compare(rows, world_size, nbytes_list):
    """Lines of 'size, busbw of each, ratio' for one group size."""
    lines = [f"N={world_size}  {'size':>8}  {HAND + ' busbw':>22}  "
             f"{LIBRARY + ' busbw':>22}  ratio"]
    mine = [r for r in rows if r.world_size == world_size]
    for nbytes in nbytes_list:
        busbw = {r.label: r.busbw for r in mine if r.nbytes == nbytes}
        lines.append(f"     {sweep.format_size(nbytes):>8}  {busbw[HAND] / sweep.GB:>17.3g} GB/s"
                     f"  {busbw[LIBRARY] / sweep.GB:>17.3g} GB/s"
                     f"  {sweep.ratio(mine, HAND, LIBRARY, nbytes):.2f}")
    return lines


def main(argv):
    from labsupport.launch import session
    from labsupport.ring.ring import ring_allreduce

    parser = argparse.ArgumentParser(prog="python -m labsupport.bench ring")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-mib", type=int, default=64, help="largest message (default 64)")
    parser.add_argument("--repeats", type=int, default=9, help="timed calls per size (median)")
    parser.add_argument("--backend", default="auto", help="auto, gloo or nccl")
    args = parser.parse_args(argv)
    if 2 not in args.world_sizes:
        parser.error("the ratio is defined on 2 ranks: include 2 in --world-sizes")
    nbytes_list = sweep.sizes(1 << 10, args.max_mib << 20, step=4)
    rows = []
    for world_size in args.world_sizes:
        with session.start(world_size=world_size, backend=args.backend) as cluster:
            rows += sweep.run(cluster, {HAND: ring_allreduce, LIBRARY: "all_reduce"},
                              nbytes_list, warmup=2, repeats=args.repeats, timeout=600)
    print(sweep.table(rows))
    for world_size in args.world_sizes:
        print("\n".join(compare(rows, world_size, nbytes_list)))
    top = nbytes_list[-1]
    print(" ".join(_ratio_field(rows, n, top) for n in (2, 4) if n in args.world_sizes))


def _ratio_field(rows, world_size, top):
    """``ring_busbw_ratio_64MiB=x`` on 2 ranks, ``..._w4=x`` on 4."""
    mine = [r for r in rows if r.world_size == world_size]
    suffix = "" if world_size == 2 else f"_w{world_size}"
    return (f"ring_busbw_ratio_{top >> 20}MiB{suffix}="
            f"{sweep.ratio(mine, HAND, LIBRARY, top):.3f}")
