"""Checks of chapter 11's your-turn cells (labsupport.your_turn runs them).

- ``check_flops_per_token(fn)``: the reader's training FLOPs per token of
  the shared decoder, both conventions, against ``overlap.decoder_flops``,
  each usual slip named (the embedding counted as a matmul, the head
  forgotten, the forward alone, the causal halving on the wrong side);
- ``check_repair(repair)``: the reader's repair of ``mystery_sync``, a
  gradient synchronisation broken in two ways the reader finds with the
  parity procedure (``compare``); checked with ``compare`` on layouts where
  every group size differs from the others.
"""
import math

from labsupport import overlap
from labsupport.capstone import compare
from labsupport.capstone.trainer import all_reduce_buckets

# (layers, hidden, seq_len, vocab): the chapter's decoder, odd sizes, GPT-2 small
FLOPS_CONFIGS = [(2, 32, 32, 256), (3, 48, 96, 256), (12, 768, 1024, 50257),
                 (5, 40, 20, 7)]


def _slips(layers, hidden, seq, vocab, causal):
    """{description: the value a reader who made that slip returns}."""
    right = overlap.decoder_flops(1, seq, layers, hidden, vocab, causal=causal)
    other = overlap.decoder_flops(1, seq, layers, hidden, vocab, causal=not causal)
    lookup = 6 * vocab * hidden
    return {
        "6·V·h too many: the token embedding is a lookup (no FLOPs); only the "
        "LM head is a matmul": right + lookup,
        "6·V·h missing: the LM head (h x V) is a matmul of every token":
            right - lookup,
        "a third of the answer: that is the forward; a training step adds the "
        "backward, twice the forward (Kaplan et al. 2020, §2.1)": right / 3,
        "the other convention's attention: causal=True counts 6·L·h·s "
        "(half the scores), causal=False 12·L·h·s": other,
    }


def check_flops_per_token(fn):
    """``fn(layers, hidden, seq_len, vocab, causal)`` for every config, both ways."""
    for layers, hidden, seq, vocab in FLOPS_CONFIGS:
        for causal in (False, True):
            got = fn(layers, hidden, seq, vocab, causal)
            want = overlap.decoder_flops(1, seq, layers, hidden, vocab, causal=causal)
            if math.isclose(got, want, rel_tol=1e-9):
                continue
            where = (f"flops_per_token(layers={layers}, hidden={hidden}, "
                     f"seq_len={seq}, vocab={vocab}, causal={causal}) returned "
                     f"{got:,.0f}, not {want:,.0f}")
            for slip, value in _slips(layers, hidden, seq, vocab, causal).items():
                if math.isclose(got, value, rel_tol=1e-9):
                    raise AssertionError(f"{where}: {slip}")
            raise AssertionError(f"{where} (x{got / want:.4g}; the MLP is "
                                 "h -> 4h -> h)")


def mystery_sync(stage, groups, layout):
    """Broken on purpose, in two ways, for the chapter's exercise: find them
    with ``compare`` (the chapter does not say which)."""
    all_reduce_buckets(stage, groups["dp_cp"], divide_by=layout.cp)


# dp alone, cp alone (a division by a constant 2 fails there), tp = 4 (a partial
# gradient over tp is not half of the whole), dp and cp together
REPAIR_LAYOUTS = [(2, 1, 1, 1), (1, 1, 1, 2), (2, 4, 1, 1), (2, 2, 1, 2)]


def repaired(repair):
    """``mystery_sync`` followed by the reader's ``repair``."""
    def sync(stage, groups, layout):
        mystery_sync(stage, groups, layout)
        repair(stage, groups, layout)
    return sync


def check_repair(repair, layouts=REPAIR_LAYOUTS, steps=2):
    """Train each layout with ``mystery_sync`` and ``repair`` and compare it with
    one process (``compare.compare``): the first layout that differs fails,
    with the parity procedure's report."""
    for layout in layouts:
        report = compare.compare((1, 1, 1, 1), layout, steps=steps,
                                 sync_b=repaired(repair))
        assert report.equal, (f"on {layout} (dp, tp, pp, cp), mystery_sync then "
                              f"repair still differ from one process:\n{report}")
