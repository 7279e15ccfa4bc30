"""Chapter 9: expert parallelism's bytes beside the formula, its all-to-all vs torch's, balance.

    python -m labsupport.bench moe [--world-sizes 2 4] [--tokens 1024] [--hidden 64]
                                   [--experts 8] [--top-k 2] [--repeats 5] [--train-steps 300]

For each world size N it runs chapter 9's ExpertParallelMoE (labsupport.expert_parallel.moe)
on N ranks, one thread each, ``--tokens`` tokens per rank (float32, a
uniform router, no capacity): the bytes each rank's forward puts on its TCP
sockets against the formula (rows to other ranks out, their rows' results
back, the counts exchange), and the median step time (forward + backward)
with the hand-written AllToAll Function against torch's
all_to_all_single_autograd, the two interleaved. Then it trains the shared
decoder with 8 experts in both blocks for ``--train-steps`` steps, without
and with the load-balancing loss (coefficient 0.1), and measures the busiest
expert's rows over the mean in the last quarter of the steps. The last line:

    moe_a2a_bytes_measured_over_formula=<the ratio farthest from 1, any rank, any N>
    moe_step_ratio_vs_functional=<hand AllToAll step / all_to_all_single_autograd step,
                                  median per N, mean over N>
    moe_aux_loss_imbalance_ratio=<max/mean rows per expert with the loss / without>

Goals: bytes within 1% of the formula, step ratio <= 1.0, imbalance ratio < 1.
CPU timings are noisy and are not GPU timings; the bytes are counted.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

from labsupport import models, traffic
from labsupport.expert_parallel import moe
from labsupport.launch import session

AUX_COEF = 0.1


def _torch_a2a(x, output_splits, input_splits, group=None):
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    return all_to_all_single_autograd(x, output_splits, input_splits, group or dist.group.WORLD)


def _layer_and_tokens(tokens, hidden, experts, top_k):
    rank = dist.get_rank()
    with models.seeded(0):
        layer = moe.MoE(hidden, 4 * hidden, experts, top_k)
    g = torch.Generator().manual_seed(rank)
    return layer, torch.randn(tokens, hidden, generator=g)


def wire_vs_formula(tokens, hidden, experts, top_k):
    """On each rank: (bytes its forward sent on the wire, the formula's bytes)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    layer, x = _layer_and_tokens(tokens, hidden, experts, top_k)
    ep = moe.ExpertParallelMoE(layer)
    dist.barrier()
    with traffic.count() as counted:
        ep(x)
    _, chosen, _ = moe.route(layer.router(x), top_k)
    sent = torch.bincount(chosen.flatten() // (experts // n), minlength=n)
    rows = [torch.empty_like(sent) for _ in range(n)]
    dist.all_gather(rows, sent)                       # rows[i][j]: rank i -> rank j
    off = int(sent.sum() - sent[rank]) + int(sum(r[rank] for r in rows) - sent[rank])
    return counted.wire_sent, off * hidden * 4 + (n - 1) * (experts // n) * 8


def step_times(tokens, hidden, experts, top_k, repeats):
    """Median forward + backward seconds with each all-to-all, interleaved."""
    layer, x = _layer_and_tokens(tokens, hidden, experts, top_k)
    layers = {"hand": moe.ExpertParallelMoE(layer),
              "torch": moe.ExpertParallelMoE(layer, all_to_all=_torch_a2a)}
    x.requires_grad_()
    times = {name: [] for name in layers}
    for i in range(repeats + 1):                       # the first round: warm-up
        for name, ep in layers.items():
            dist.barrier()
            start = time.perf_counter()
            ep(x).sum().backward()
            dist.barrier()
            if i:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def train_imbalance(aux_coef, steps, seed=0):
    """Busiest expert's rows over the mean, last quarter of ``steps`` (both blocks).

    One thread: the decoder's ops are tiny, and on a loaded machine a second
    thread mostly waits for the first (and the numerics stay the same anywhere).
    """
    torch.set_num_threads(1)
    cfg = models.GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2,
                           moe_experts=8, moe_top_k=2, moe_aux_coef=aux_coef)
    model = models.GPT(cfg, seed=seed, moe=moe.MoE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ratios = []
    for step in range(steps):
        ids, targets = models.toy_tokens(8, 16, 64, seed=1000 + step)
        opt.zero_grad()
        model(ids, targets).backward()
        opt.step()
        loads = torch.stack([b.mlp.tokens_per_expert for b in model.blocks]).float()
        ratios.append((loads.max(-1).values / loads.mean(-1)).mean().item())
    return statistics.mean(ratios[-max(1, steps // 4):])


def measure(n, args):
    session.start(world_size=n, threads=1)
    shape = (args.tokens, args.hidden, args.experts, args.top_k)
    wire = session.run(wire_vs_formula, *shape, world_size=n)
    times = session.run(step_times, *shape, args.repeats, world_size=n)[0]
    return dict(ratios=[w / f for w, f in wire], formula=[f for _, f in wire], times=times)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m labsupport.bench moe",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--train-steps", type=int, default=300)
    args = parser.parse_args(argv)
    if min(args.world_sizes) < 2:
        parser.error("--world-sizes: expert parallelism needs at least 2 ranks")
    if any(args.experts % n for n in args.world_sizes):
        parser.error(f"--experts {args.experts} must be divisible by every world size")
    print(f"T={args.tokens} tokens per rank, h={args.hidden}, f={4 * args.hidden}, "
          f"E={args.experts}, k={args.top_k}, float32, uniform router; medians of "
          f"{args.repeats}")
    print(f"{'N':>2} {'formula bytes (rank 0)':>23} {'measured/formula':>26} "
          f"{'hand step':>10} {'torch step':>11} {'ratio':>6}")
    results = {}
    for n in args.world_sizes:
        r = results[n] = measure(n, args)
        t = r["times"]
        print(f"{n:2d} {r['formula'][0]:23,} {' '.join(f'{x:.4f}' for x in r['ratios']):>26} "
              f"{t['hand'] * 1e3:7.2f} ms {t['torch'] * 1e3:8.2f} ms "
              f"{t['hand'] / t['torch']:6.3f}", flush=True)
    session.shutdown()
    imbalance = {c: train_imbalance(c, args.train_steps) for c in (0.0, AUX_COEF)}
    print(f"decoder, 8 experts, {args.train_steps} steps: max/mean rows per expert "
          f"{imbalance[0.0]:.3f} without the balancing loss, {imbalance[AUX_COEF]:.3f} "
          f"with it (coefficient {AUX_COEF})")
    worst = max((x for r in results.values() for x in r["ratios"]), key=lambda x: abs(x - 1))
    step = statistics.mean(r["times"]["hand"] / r["times"]["torch"] for r in results.values())
    print(f"moe_a2a_bytes_measured_over_formula={worst:.4f} "
          f"moe_step_ratio_vs_functional={step:.3f} "
          f"moe_aux_loss_imbalance_ratio={imbalance[AUX_COEF] / imbalance[0.0]:.3f}")


if __name__ == "__main__":
    main()
