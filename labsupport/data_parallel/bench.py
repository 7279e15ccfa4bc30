"""Step time of chapter 3's data-parallel versions beside PyTorch's DDP.

    python -m labsupport.bench ddp [--world-sizes 2 4] [--rounds 5] [--steps 20]

Naive (one blocking all-reduce per tensor after backward), overlapped (one
asynchronous all-reduce per tensor, started by a gradient hook), bucketed
(one per bucket of ``--bucket-size`` bytes) and DistributedDataParallel, on
the same DeepMLP and data. A round times ``--steps`` steps of each version
in turn (after warm-up), so all versions see the same machine load; the
step time of a round is the median over steps of the slowest rank, and the
table shows the median over rounds and the ratio to DDP. The last line is
machine-readable.
"""
import argparse
import functools
import statistics

VERSIONS = ("naive", "overlapped", "bucketed", "DDP")


def _torch_ddp(module):
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(module)


def _wrap(name, bucket_size):
    from labsupport.data_parallel import ddp
    return {"naive": ddp.DataParallelNaive, "overlapped": ddp.DataParallelOverlap,
            "bucketed": functools.partial(ddp.DataParallelBucket, bucket_size=bucket_size),
            "DDP": _torch_ddp}[name]


def _profile(wrap, sizes, batch, steps):
    import torch.distributed as dist

    from labsupport import models
    from labsupport.data_parallel import probe as ddp_probe

    make = functools.partial(models.DeepMLP, *sizes, seed=0)
    x, y = models.toy_regression(batch, sizes[0], sizes[3], seed=1)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return ddp_probe.profile_steps(make, wrap, models.shard(x, rank, world_size),
                                   models.shard(y, rank, world_size), steps=steps)


def bench_world_size(world_size, args) -> dict:
    from labsupport.data_parallel import probe as ddp_probe
    from labsupport.launch import session

    sizes = (args.d_in, args.width, args.depth, args.d_out)
    times = {name: [] for name in VERSIONS}
    with session.start(world_size=world_size, backend="gloo") as cluster:
        for _ in range(args.rounds):
            for name in VERSIONS:
                results = cluster.run(_profile, _wrap(name, args.bucket_size), sizes,
                                      args.batch, args.steps)
                times[name].append(ddp_probe.step_time(results))
    return {name: statistics.median(ts) for name, ts in times.items()}


def report(rows: dict):
    print(f"{'step time':12}" + "".join(f"{'world_size=' + str(n):>26}" for n in rows))
    for name in VERSIONS:
        cells = [f"{t[name] * 1e3:.1f} ms ({t[name] / t['DDP']:.2f}x DDP)" for t in rows.values()]
        print(f"{name:12}" + "".join(f"{c:>26}" for c in cells))
    print(" ".join(f"{name}_w{n}={t[name] / t['DDP']:.3f}"
                   for n, t in rows.items() for name in VERSIONS if name != "DDP"))


def main(argv):
    parser = argparse.ArgumentParser(prog="python -m labsupport.bench ddp")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=5, help="rounds per median (default 5)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--batch", type=int, default=64, help="global batch (default 64)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--d-in", type=int, default=32)
    parser.add_argument("--d-out", type=int, default=8)
    parser.add_argument("--bucket-size", type=int, default=2**20, help="bytes (default 1 MiB)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    report({n: bench_world_size(n, args) for n in args.world_sizes})
