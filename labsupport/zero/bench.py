"""Chapter 7's ZeRO stages: memory per rank against the formula, and ZeRO-3's step against FSDP2.

    python -m labsupport.bench zero [--world-sizes 2 4] [--rounds 3] [--steps 5]

On the shared GPT decoder in fp32 with AdamW, for data parallelism and ZeRO
stages 1-3 (labsupport.zero.zero): the bytes each rank holds after a step
(parameters, gradients, optimizer state; storages tallied by
labsupport.memory.tally) over the ZeRO paper's formula (tally.model_state_bytes).
Then the median step time (slowest rank, median over ``--steps`` steps and
over ``--rounds`` rounds) of the hand-written ZeRO-3 and of FSDP2's
``fully_shard``, alternating in each round. The last line is machine-readable:
``zero_mem_measured_over_formula_max=<x> zero3_step_ratio_vs_fsdp2=<y>``.
"""
import argparse
import statistics
import time

ADAMW = dict(lr=1e-3, weight_decay=0.1)


def _model(args):
    from labsupport import models
    cfg = models.GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, hidden=args.hidden,
                           heads=args.heads, layers=args.layers)
    return models.GPT(cfg, seed=0)


def _setup(version, model):
    """(model, optimizer, step) of one version; step(ids, targets) trains once."""
    import torch
    import torch.distributed as dist

    from labsupport.zero import zero

    if version in ("ZeRO-1", "ZeRO-2"):
        flat = zero.FlatParams(model.parameters())
        optimizer = torch.optim.AdamW([flat.shard(flat.data)], **ADAMW)

        def step(ids, targets):
            flat.alloc_grads()
            model(ids, targets).backward()
            zero.zero_step(flat, optimizer, int(version[-1]))
        return model, optimizer, step
    if version == "ZeRO-3":
        model = zero.Zero3(model, model.blocks)
    elif version == "FSDP2":
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    params = model.shards.parameters() if version == "ZeRO-3" else model.parameters()
    optimizer = torch.optim.AdamW(params, **ADAMW)

    def step(ids, targets):
        optimizer.zero_grad()
        model(ids, targets).backward()
        if version == "DP":
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        elif version == "ZeRO-3":
            model.sync_gradients()
        optimizer.step()
    return model, optimizer, step


def _data(args):
    import torch.distributed as dist

    from labsupport import models
    ids, targets = models.toy_tokens(args.batch, args.seq_len, args.vocab, seed=1)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return models.shard(ids, rank, world_size), models.shard(targets, rank, world_size)


def _held(version, args) -> float:
    """Bytes held after two steps over the formula, on this rank."""
    import torch.distributed as dist

    from labsupport.memory import tally
    model, optimizer, step = _setup(version, _model(args))
    for _ in range(2):
        step(*_data(args))
    held = list(model.parameters()) + [p for g in optimizer.param_groups for p in g["params"]]
    total = (tally.storage_bytes(held) + tally.storage_bytes(p.grad for p in held)
             + tally.optimizer_state_bytes(optimizer))
    psi = sum(p.numel() for p in _model(args).parameters())
    stage = {"DP": 0, "ZeRO-1": 1, "ZeRO-2": 2, "ZeRO-3": 3}[version]
    formula = tally.model_state_bytes(psi, "fp32", stage, dist.get_world_size())["total"]
    return total / formula


def _step_times(version, args) -> list[float]:
    import torch.distributed as dist
    _, _, step = _setup(version, _model(args))
    data = _data(args)
    step(*data)                                          # warm-up
    times = []
    for _ in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step(*data)
        times.append(time.perf_counter() - t0)
    return times


def bench_world_size(world_size, args) -> dict:
    from labsupport.launch import session
    out = {}
    with session.start(world_size=world_size, backend="gloo") as cluster:
        for version in ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"):
            out[version] = max(cluster.run(_held, version, args))
        rounds = {"ZeRO-3": [], "FSDP2": []}
        for _ in range(args.rounds):
            for version in rounds:
                by_rank = cluster.run(_step_times, version, args)
                rounds[version].append(statistics.median(map(max, zip(*by_rank))))
    out["step"] = {v: statistics.median(ts) for v, ts in rounds.items()}
    return out


def report(rows: dict):
    print(f"{'measured/formula (fp32)':26}" + "".join(f"{'world_size=' + str(n):>16}"
                                                      for n in rows))
    for version in ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"):
        print(f"{version:26}" + "".join(f"{r[version]:16.4f}" for r in rows.values()))
    for version in ("ZeRO-3", "FSDP2"):
        print(f"{version + ' step (median)':26}"
              + "".join(f"{r['step'][version] * 1e3:13.1f} ms" for r in rows.values()))
    mem = max(r[v] for r in rows.values() for v in ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"))
    ratio = statistics.median(r["step"]["ZeRO-3"] / r["step"]["FSDP2"] for r in rows.values())
    print(f"zero_mem_measured_over_formula_max={mem:.4f} zero3_step_ratio_vs_fsdp2={ratio:.3f}")


def main(argv):
    parser = argparse.ArgumentParser(prog="python -m labsupport.bench zero")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3, help="rounds per median (default 3)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--batch", type=int, default=8, help="global batch (default 8)")
    parser.add_argument("--vocab", type=int, default=255)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    if any(args.batch % n for n in args.world_sizes):
        parser.error(f"--batch {args.batch} must be divisible by every world size")
    report({n: bench_world_size(n, args) for n in args.world_sizes})
