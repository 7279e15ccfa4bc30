"""Checks of assignment 6: causal ring attention with the zig-zag layout, forward.

    import labsupport as ls
    g = ls.grading.zigzag_ring_attention
    g.check_positions(zigzag_positions)                    # a partition, s/N each
    g.check_output(zigzag_positions, zigzag_ring_attention, world_sizes=(2,))
    g.check_traffic(zigzag_positions, zigzag_ring_attention)  # N-1 K/V blocks
    g.check_balance(zigzag_positions, zigzag_ring_attention)  # equal work

The student writes ``positions(seq_len, rank, world_size)``, the sequence
positions a rank holds (in the order of its local tensors), and
``attention(q, k, v)``, which gets this rank's q, k, v (b, a, s/N, d) in that
order and returns its part of causal attention. Each check runs them on the
ranks through ``labsupport.grading.run`` (a deadline, so a deadlock fails with
an explanation, never a hung grader) and raises AssertionError with a message
a student can act on. Work per rank is counted by
``labsupport.context_parallel.ring_attention.block_attention``, which the student must use for
every score block, in units of one chunk-block, (s/2N)^2 score entries.
"""
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labsupport.checking import collective_checks
from labsupport.checking.collective_checks import WORLD_SIZES  # (2, 4): one home
from labsupport.checking.diagnosis import name_of
from labsupport.context_parallel import ring_attention

LENGTHS = (8, 16, 24)  # multiples of 2N for N = 2 and 4
B, A, D = 1, 2, 4


def inputs(seq_len, seed=0):
    """q, k, v (b, a, s, d) in float64, the same on every rank."""
    g = torch.Generator().manual_seed(1000 * seq_len + seed)
    return [torch.randn(B, A, seq_len, D, generator=g, dtype=torch.float64)
            for _ in range(3)]


def expected(seq_len):
    """Causal SDPA over the whole sequence, on one process."""
    return F.scaled_dot_product_attention(*inputs(seq_len), is_causal=True)


def check_positions(positions, world_sizes=WORLD_SIZES, lengths=LENGTHS):
    """Each rank holds s/N positions and every position is held exactly once."""
    name = name_of(positions)
    for n in world_sizes:
        for s in lengths:
            held = [positions(s, r, n) for r in range(n)]
            bad = [r for r, p in enumerate(held) if not _is_index(p, s // n)]
            if bad:
                p = held[bad[0]]
                raise AssertionError(
                    f"{name}({s}, {bad[0]}, {n}) returned {_show(p)}: give a 1-D "
                    f"integer tensor of {s // n} positions (s/N), each in [0, {s})")
            counts = torch.bincount(torch.cat(held), minlength=s)
            if not torch.all(counts == 1):
                twice = (counts > 1).nonzero().flatten().tolist()[:4]
                never = (counts == 0).nonzero().flatten().tolist()[:4]
                raise AssertionError(
                    f"{name} on {n} ranks, s={s}: positions {twice} are held by "
                    f"more than one rank and {never} by none. Every position "
                    "must be on exactly one rank.")


def check_output(positions, attention, world_sizes=WORLD_SIZES, lengths=LENGTHS,
                 timeout=None):
    """The output at each rank's positions equals causal SDPA's (float64)."""
    for n in world_sizes:
        for s in lengths:
            calls = _run(positions, attention, s, n, timeout)
            want = expected(s)
            for rank, call in enumerate(calls):
                _compare(name_of(attention), rank, n, s, call["value"], want)


def check_traffic(positions, attention, world_sizes=WORLD_SIZES, seq_len=16,
                  timeout=None):
    """Each rank sends N-1 K/V blocks, b·a·(s/N)·d·2 numbers each, with isend/send."""
    name = name_of(attention)
    for n in world_sizes:
        calls = _run(positions, attention, seq_len, n, timeout)
        block = 2 * B * A * (seq_len // n) * D * 8  # k and v, float64
        sent = [c["sent"] for c in calls]
        if sent != [(n - 1) * block] * n:
            blocks = ", ".join(f"rank {r}: {b / block:g}" for r, b in enumerate(sent))
            raise AssertionError(
                f"{name} on {n} ranks, s={seq_len}: K/V blocks sent per rank "
                f"({blocks}); expected {n - 1} each ({(n - 1) * block} bytes: "
                f"k and v of one rank are {block} bytes). In a ring each rank "
                "passes on the block it holds at every step but the last, and "
                "never sends q or the output." + _traffic_hint(sent, block, n))


def check_balance(positions, attention, world_sizes=WORLD_SIZES, seq_len=16,
                  timeout=None):
    """Score chunk-blocks computed per rank are equal within one."""
    name = name_of(attention)
    for n in world_sizes:
        calls = _run(positions, attention, seq_len, n, timeout)
        chunk = seq_len // (2 * n)
        work = [c["value"]["elements"] / chunk**2 for c in calls]
        if not any(work):
            raise AssertionError(
                f"{name} computed no score block through "
                "ls.context_parallel.ring_attention.block_attention: compute every block of "
                "scores with it, so that the work per rank can be counted.")
        if max(work) - min(work) > 1:
            busiest = max(range(n), key=work.__getitem__)
            idlest = min(range(n), key=work.__getitem__)
            raise AssertionError(
                f"{name} is unbalanced on {n} ranks, s={seq_len}: score blocks "
                f"of (s/2N)^2 computed per rank {[round(w, 2) for w in work]}; "
                f"rank {busiest} does {work[busiest]:g}, rank {idlest} "
                f"{work[idlest]:g}, and the step lasts as long as the busiest. "
                "With contiguous blocks under a causal mask the last rank "
                "computes N times the first; give rank r chunks r and 2N-1-r "
                "of 2N (zig-zag) and compute only the chunk pairs the mask "
                "needs, so every rank does the same work.")


# -- on the ranks -----------------------------------------------------------------

def _trial(positions, attention, seq_len):
    rank, n = dist.get_rank(), dist.get_world_size()
    held = positions(seq_len, rank, n)
    q, k, v = (t[..., held, :].contiguous() for t in inputs(seq_len))
    ring_attention.reset_scores()
    out = attention(q, k, v)
    return dict(positions=held, out=out, elements=ring_attention.SCORES["elements"])


def _run(positions, attention, seq_len, n, timeout):
    check_positions(positions, (n,), (seq_len,))
    trial = functools.partial(_trial)
    trial.__name__ = name_of(attention)  # what the messages call it
    calls = collective_checks.run(trial, positions, attention, seq_len, world_size=n,
                        timeout=timeout)
    collective_checks.assert_rules(calls, name_of(attention))
    return calls


def _compare(name, rank, n, s, value, want):
    out, held = value["out"], value["positions"]
    shape = (B, A, s // n, D)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise AssertionError(f"{name} on rank {rank} of {n} returned {got}; expected "
                             f"this rank's output, a tensor of shape {shape}")
    want = want[..., held, :]
    wrong = (~torch.isclose(out.double(), want, rtol=1e-7, atol=1e-9)).any(-1).any(0).any(0)
    if wrong.any():
        i = int(wrong.nonzero()[0])
        raise AssertionError(
            f"{name} is not causal attention on {n} ranks, s={s}: rank {rank}'s "
            f"output at its local index {i} (sequence position {int(held[i])}) is "
            f"{_show(out[0, 0, i])}, expected {_show(want[0, 0, i])}; wrong at "
            f"{int(wrong.sum())} of its {len(held)} positions. Each query must see "
            "every key at or before its position, once: check which chunk pairs "
            "you compute, their masks, and the log-sum-exp merge of the partial "
            "results (lse_merge).")


def _traffic_hint(sent, block, n):
    if any(s > (n - 1) * block for s in sent):
        return " Sending more (q too, or a block twice) costs bandwidth for nothing."
    if not any(sent):
        return " Nothing went through dist.isend/dist.send."
    return ""


def _is_index(p, size):
    return (isinstance(p, torch.Tensor) and p.dim() == 1 and len(p) == size
            and not p.is_floating_point() and bool(((p >= 0) & (p < size * 1e9)).all()))


def _show(t):
    if not isinstance(t, torch.Tensor):
        return repr(t)
    return "[" + ", ".join(f"{v:.4g}" for v in t.flatten().tolist()[:6]) + "]"
