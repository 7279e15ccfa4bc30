"""Step time of chapter 4's hand-written tensor parallelism beside DTensor's.

    python -m labsupport.bench tp [--world-sizes 2 4] [--rounds 5] [--steps 10]

One training step (forward, backward, SGD) of the shared ``models.GPT``,
split by ``labsupport.tensor_parallel.gpt.TensorParallelGPT`` (ours) and by
DTensor's ``parallelize_module`` with the same plan, for TP and TP+SP. A
round times ``--steps`` steps of each version in turn (after one warm-up
step), so all versions see the same machine load; a round's step time is the
median over steps of the slowest rank, and the table shows the median over
rounds. The last line is machine-readable: ours / DTensor at the largest
world size, TP and TP+SP.
"""
import argparse
import statistics
import time

VERSIONS = [("ours", False), ("DTensor", False), ("ours", True), ("DTensor", True)]


def _model(name, sp, cfg):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from labsupport import models
    from labsupport.tensor_parallel import gpt as tp_gpt
    from labsupport.tensor_parallel import tensor_parallel
    if name == "ours":
        return tp_gpt.TensorParallelGPT(models.GPT(cfg, seed=0), sequence_parallel=sp)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return tensor_parallel.parallelize_dtensor(models.GPT(cfg, seed=0), mesh, sp)


def _step_times(name, sp, cfg, batch, steps) -> list:
    import torch
    import torch.distributed as dist

    from labsupport import models
    model = _model(name, sp, cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, foreach=False)
    ids, targets = models.toy_tokens(batch, cfg.seq_len, cfg.vocab_size, seed=1)
    times = []
    for _ in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        model(ids, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - t0)
    return times[1:]


def bench_world_size(world_size, args) -> dict:
    from labsupport import models
    from labsupport.launch import session

    cfg = models.GPTConfig(vocab_size=args.vocab, seq_len=args.seq, hidden=args.hidden,
                           heads=args.heads, layers=args.layers)
    times = {v: [] for v in VERSIONS}
    with session.start(world_size=world_size, backend="gloo") as cluster:
        for _ in range(args.rounds):
            for name, sp in VERSIONS:
                by_rank = cluster.run(_step_times, name, sp, cfg, args.batch, args.steps)
                times[name, sp].append(statistics.median(map(max, zip(*by_rank))))
    return {v: statistics.median(ts) for v, ts in times.items()}


def report(rows: dict):
    print(f"{'step time':16}" + "".join(f"{'t=' + str(n):>24}" for n in rows))
    for name, sp in VERSIONS:
        label = f"{name} {'TP+SP' if sp else 'TP'}"
        cells = [f"{t[name, sp] * 1e3:.1f} ms ({t[name, sp] / t['DTensor', sp]:.2f}x)"
                 for t in rows.values()]
        print(f"{label:16}" + "".join(f"{c:>24}" for c in cells))
    last = rows[max(rows)]
    print(f"tp_step_ratio_vs_dtensor={last['ours', False] / last['DTensor', False]:.3f} "
          f"tp_sp_step_ratio_vs_dtensor={last['ours', True] / last['DTensor', True]:.3f}")


def main(argv):
    parser = argparse.ArgumentParser(prog="python -m labsupport.bench tp")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=5, help="rounds per median (default 5)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    if any(n < 2 for n in args.world_sizes):
        parser.error("tensor parallelism needs world sizes of at least 2")
    rows = {n: bench_world_size(n, args) for n in sorted(args.world_sizes)}
    report(rows)
