"""Chapter 0: training-state and activation bytes counted from real tensors, beside the formulas.

    python -m labsupport.bench memory [--seqs 64 128] [--batches 4 8] [--hidden 64]
                                      [--heads 4] [--layers 2] [--vocab 256] [--steps 5]
                                      [--threads 1]

For each sequence length s and batch b, the shared decoder (fp32, no
dropout) takes AdamW steps; it prints the states counted after a step over
16Ψ (4 + 4 + 8 bytes per parameter), the activations autograd saved in
forward over L·sbh(64 + 4as/h) + 4sb(2h + V) (Korthikanti et al.'s
sbh(34 + 5as/h) in 4-byte values without dropout, plus the LM head), the
bytes held after forward with full and selective checkpointing over those
without, and the median forward + backward time of each policy (timings
are of this machine, under its load). The last line is machine-readable;
its ratios are those of the largest configuration.
"""
import argparse
import statistics
import time

import torch

from labsupport import models
from labsupport.memory import calc as memory_calc
from labsupport.memory import checkpointing, tally

POLICIES = ("none", "selective", "full")


def measure(cfg, batch, steps):
    """One configuration: {"states", "activations", "held", "times"} ratios and medians."""
    model = models.GPT(cfg, seed=0)
    ids, targets = models.toy_tokens(batch, cfg.seq_len, cfg.vocab_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tally.saved_tensors(exclude=model.parameters()) as saved:
        loss = model(ids, targets)
    loss.backward()
    optimizer.step()
    psi = sum(p.numel() for p in model.parameters())
    params = list(model.parameters())
    states = (tally.storage_bytes(params) + tally.storage_bytes(p.grad for p in params)
              + tally.optimizer_state_bytes(optimizer))
    s, b, h, a = cfg.seq_len, batch, cfg.hidden, cfg.heads
    formula = cfg.layers * memory_calc.activation_bytes_per_layer(
        s, b, h, a, e=4, dropout=False) + memory_calc.head_activation_bytes(
        s, b, h, cfg.vocab_size, e=4, dropout=False)
    held, times = {}, {}
    for policy in POLICIES:
        with tally.peak_tally() as counter:
            loss = checkpointing.forward(model, ids, targets, policy)
            held[policy] = counter.live
        loss.backward()
        times[policy] = _median_time(model, ids, targets, policy, steps)
    return dict(states=states / sum(tally.PRECISIONS["fp32"]) / psi,
                activations=saved.bytes / formula, held=held, times=times)


def _median_time(model, ids, targets, policy, steps):
    checkpointing.forward(model, ids, targets, policy).backward()   # warm-up, untimed
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        checkpointing.forward(model, ids, targets, policy).backward()
        times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m labsupport.bench memory",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per policy")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{'s':>5} {'b':>3} {'states/16Ψ':>10} {'act/formula':>11} {'full/none':>9} "
          f"{'sel/none':>8}  median fwd+bwd none / selective / full (ms)")
    for s in args.seqs:
        for b in args.batches:
            cfg = models.GPTConfig(vocab_size=args.vocab, seq_len=s, hidden=args.hidden,
                                   heads=args.heads, layers=args.layers)
            r = measure(cfg, b, args.steps)
            held, t = r["held"], r["times"]
            print(f"{s:5d} {b:3d} {r['states']:10.4f} {r['activations']:11.4f} "
                  f"{held['full'] / held['none']:9.3f} {held['selective'] / held['none']:8.3f}"
                  f"  {' / '.join(f'{t[p] * 1e3:.1f}' for p in POLICIES)}", flush=True)
    print(f"memory_states_measured_over_formula={r['states']:.4f} "
          f"memory_activations_measured_over_formula={r['activations']:.4f} "
          f"checkpoint_saved_bytes_ratio={held['full'] / held['none']:.4f}")


if __name__ == "__main__":
    main()
