"""Chapter 6: ring attention's overlap, causal imbalance and cost beside one-process SDPA.

    python -m labsupport.bench ring_attention [--world-sizes 2 4] [--seq-len 4096]
                                              [--heads 4] [--head-dim 64] [--repeats 5]

For each world size N it runs the forward of chapter 6's ring attention
(labsupport.context_parallel.ring_attention.ring_forward) on N ranks, one thread each, on a
sequence of ``--seq-len`` tokens (b = 1, float32), and prints the median step
time without and with overlap (the K/V transfer posted before the compute),
full and causal; the score blocks each rank computes with contiguous blocks
under a causal mask and the compute time per rank from a recorded timeline;
and single-process SDPA on the whole sequence. The last line, for the first
world size:

    ring_attn_overlap_speedup=<no overlap / overlap, full attention>
    causal_imbalance_contiguous=<max / min compute time per rank, causal>
    ring_attn_vs_sdpa_ms_ratio=<ring step (overlap, full) / one-process SDPA step>

CPU timings are noisy and are not GPU timings; the blocks counted are exact.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labsupport import timeline
from labsupport.context_parallel import ring_attention as ra
from labsupport.launch import session


def _inputs(seq_len, heads, head_dim):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, heads, seq_len, head_dim, generator=g) for _ in range(3)]


def ring_steps(seq_len, heads, head_dim, causal, overlap, repeats):
    """On each rank: median step time, blocks computed, last step's events."""
    rank, n = dist.get_rank(), dist.get_world_size()
    q, k, v = (ra.shard_sequence(t, rank, n) for t in _inputs(seq_len, heads, head_dim))
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        tl = timeline.Timeline(rank, q.device)  # timed as the device works
        ra.reset_scores()
        dist.barrier()
        start = tl.now()
        ra.ring_forward(q, k, v, causal, seq_len, overlap, tl)
        dist.barrier()
        times.append(tl.now() - start)
    c = q.shape[-2]
    return dict(ms=1e3 * statistics.median(times[1:]), events=tl.events,
                blocks=ra.SCORES["elements"] // (c * c))


def sdpa_ms(seq_len, heads, head_dim, repeats):
    """One process, one thread, the whole sequence."""
    torch.set_num_threads(1)
    q, k, v = _inputs(seq_len, heads, head_dim)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def measure(n, args):
    session.start(world_size=n, threads=1)
    shape = (args.seq_len, args.heads, args.head_dim)
    full = {o: session.run(ring_steps, *shape, False, o, args.repeats, world_size=n)[0]["ms"]
            for o in (False, True)}
    causal = session.run(ring_steps, *shape, True, True, args.repeats, world_size=n)
    events = timeline.merge([r["events"] for r in causal])
    busy = [timeline.busy_time(events, r) * 1e3 for r in range(n)]
    return dict(full=full, causal_ms=causal[0]["ms"], busy=busy,
                blocks=[r["blocks"] for r in causal])


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m labsupport.bench ring_attention",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if min(args.world_sizes) < 2:
        parser.error("--world-sizes: a ring needs at least 2 ranks")
    sdpa = sdpa_ms(args.seq_len, args.heads, args.head_dim, args.repeats)
    print(f"s={args.seq_len}, a={args.heads}, d={args.head_dim}, b=1, float32; "
          f"one-process SDPA: {sdpa:.2f} ms (median of {args.repeats})")
    print(f"{'N':>2} {'full, no overlap':>17} {'full, overlap':>14} {'speed-up':>9} "
          f"{'causal':>9} {'blocks per rank':>16}  compute ms per rank (causal)")
    results = {}
    for n in args.world_sizes:
        r = results[n] = measure(n, args)
        print(f"{n:2d} {r['full'][False]:14.2f} ms {r['full'][True]:11.2f} ms "
              f"{r['full'][False] / r['full'][True]:9.2f} {r['causal_ms']:6.2f} ms "
              f"{str(r['blocks']):>16}  " + " ".join(f"{b:.1f}" for b in r["busy"]),
              flush=True)
    session.shutdown()
    r = results[args.world_sizes[0]]
    print(f"ring_attn_overlap_speedup={r['full'][False] / r['full'][True]:.3f} "
          f"causal_imbalance_contiguous={max(r['busy']) / min(r['busy']):.3f} "
          f"ring_attn_vs_sdpa_ms_ratio={r['full'][True] / sdpa:.3f}")


if __name__ == "__main__":
    main()
