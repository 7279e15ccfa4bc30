"""Checks of chapter 11's your-turn cells (labsupport.your_turn runs them).

- ``check_rank_flops(fn)``: the reader's training FLOPs that one rank of a
  layout does per sequence of its replica, against ``flops.rank_flops`` (the
  count tests/test_capstone.py checks against torch's FLOP counter on each
  rank's stage), each usual slip named: tp's split forgotten, the positions
  not split over cp, the causal ring's skipped blocks counted, the causal
  half taken off the blocks the ring computes whole, the LM head on every
  stage or on none, blocks split as layers / pp, the forward alone;
- ``check_repair(repair)``: the reader's repair of ``mystery_sync``, a
  gradient synchronisation broken in two ways the reader finds with the
  parity procedure (``compare``); checked with ``compare`` on layouts where
  every group size differs from the others.
"""
import math

from labsupport.capstone import compare, flops
from labsupport.capstone.layout import Layout
from labsupport.capstone.model import config, stage_blocks
from labsupport.capstone.trainer import all_reduce_buckets

# (layers, hidden, seq_len, vocab, (dp, tp, pp, cp), pp_rank, cp_rank): one rank,
# whole, tp with pp, uneven stages, cp ranks first, middle and last, a big model
RANK_FLOPS_CASES = [(4, 64, 64, 256, (1, 1, 1, 1), 0, 0),
                    (4, 64, 64, 256, (2, 2, 2, 1), 1, 0),
                    (4, 64, 64, 256, (1, 1, 3, 1), 1, 0),
                    (4, 64, 64, 256, (1, 2, 2, 2), 0, 1),
                    (3, 48, 96, 264, (1, 3, 3, 4), 2, 2),
                    (4, 64, 64, 256, (1, 1, 3, 4), 0, 3),
                    (12, 768, 1024, 50304, (8, 4, 4, 2), 3, 0)]


def _case(layers, hidden, seq, vocab, lay):
    return config(vocab_size=vocab, seq_len=seq, hidden=hidden, heads=4,
                  layers=layers), Layout(*lay)


def _parts(layers, hidden, seq, vocab, lay, pp_rank, cp_rank, blocks=None):
    """(matmuls, head, attention per visited block, visited blocks) of one rank,
    forward, before tp's split: the pieces the slips recombine."""
    lay = Layout(*lay)
    c = seq // lay.cp
    if blocks is None:
        blocks = len(stage_blocks(layers, lay.pp, pp_rank))
    matmuls = 2 * c * blocks * 12 * hidden ** 2
    head = 2 * c * hidden * vocab
    block = 2 * 2 * hidden * c * c * blocks
    return matmuls, head, block, cp_rank + 1


def _slips(layers, hidden, seq, vocab, lay, pp_rank, cp_rank):
    """{description: what a reader who made that slip returns}."""
    L = Layout(*lay)
    last = pp_rank == L.pp - 1
    m, head, block, visited = _parts(layers, hidden, seq, vocab, lay, pp_rank, cp_rank)
    right = 3 * (m + head * last + block * visited) / L.tp
    whole_s = _parts(layers, hidden, seq, vocab, (1, 1, L.pp, 1), pp_rank, 0)
    even = _parts(layers, hidden, seq, vocab, lay, pp_rank, cp_rank,
                  blocks=layers / L.pp)
    return {
        "tensor parallelism splits every matmul and the heads over tp: divide "
        "by tp": right * L.tp,
        "context parallelism splits the positions: this rank holds seq_len / cp "
        "of them, and its attention is a ring over the cp blocks": 3 * (
            whole_s[0] + whole_s[1] * last + whole_s[2]) / L.tp,
        "the causal ring skips the blocks wholly in the future: cp rank i "
        "visits the key blocks 0 to i, i + 1 of them, not all cp":
            3 * (m + head * last + block * L.cp) / L.tp,
        "this decoder computes every block it visits whole, the diagonal one "
        "masked, not skipped: no causal half is taken off":
            3 * (m + head * last + block * (visited - 0.5)) / L.tp,
        "the causal half of the attention: the ring computes the blocks it "
        "visits whole": 3 * (m + head * last + block * visited / 2) / L.tp,
        "the LM head (h x V) is on the last stage only, and there always":
            3 * (m + head * (not last) + block * visited) / L.tp,
        "stages hold contiguous near-equal runs of whole blocks "
        "(model.stage_blocks), not layers / pp each": 3 * (
            even[0] + head * last + even[2] * visited) / L.tp,
        "a third of the answer: that is the forward; a training step adds the "
        "backward, twice the forward (Kaplan et al. 2020, §2.1)": right / 3,
        "6·V·h too many: the token embedding is a lookup (no FLOPs); only the "
        "LM head is a matmul": right + 6 * (seq // L.cp) * hidden * vocab / L.tp
        * (pp_rank == 0),
    }


def check_rank_flops(fn):
    """``fn(layers, hidden, seq_len, vocab, layout, pp_rank, cp_rank)`` for every
    case of RANK_FLOPS_CASES (``layout`` a ``Layout``, with .dp .tp .pp .cp)."""
    for layers, hidden, seq, vocab, lay, pp_rank, cp_rank in RANK_FLOPS_CASES:
        cfg, L = _case(layers, hidden, seq, vocab, lay)
        want = flops.rank_flops(cfg, seq, L, pp_rank, cp_rank)
        got = fn(layers, hidden, seq, vocab, L, pp_rank, cp_rank)
        if math.isclose(got, want, rel_tol=1e-9):
            continue
        where = (f"rank_flops(layers={layers}, hidden={hidden}, seq_len={seq}, "
                 f"vocab={vocab}, layout={L!s} (dp x tp x pp x cp), pp_rank={pp_rank}, "
                 f"cp_rank={cp_rank}) returned {got:,.0f}, not {want:,.0f}")
        for slip, value in _slips(layers, hidden, seq, vocab, lay, pp_rank,
                                  cp_rank).items():
            if value != want and math.isclose(got, value, rel_tol=1e-9):
                raise AssertionError(f"{where}: {slip}")
        raise AssertionError(f"{where} (x{got / want:.4g}; the MLP is h -> 4h -> h, "
                             "2 FLOPs per multiply-add)")


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
