# Run: .venv/bin/python -m pytest tests/test_capstone_build.py   (~1 min)
"""Capstone I's your-turn checks and its grid figure (labsupport.capstone.build_checks, grid).

Each check passes the reference answer (written here, as the chapter's
collapsed solution is), tells the stub it is not written, and names wrong
answers precisely; the parity step fails on a run that is not one process's.
"""
import pytest

import labsupport as ls
from labsupport.capstone import build_checks, compare, grid, trainer
from labsupport.capstone.layout import Layout, layout_groups
from labsupport.context_parallel.ring_attention import RingSelfAttention
from labsupport.launch import session
from labsupport.tensor_parallel.tensor_parallel import (
    ColumnParallelLinear,
    TensorParallelBlock,
    VocabParallelEmbedding,
)

# --- the reference answers and their wrong versions -----------------------------------

FIXED = {"dp": ("pp", "cp", "tp"), "pp": ("dp", "cp", "tp"), "cp": ("dp", "pp", "tp"),
         "tp": ("dp", "pp", "cp"), "dp_cp": ("pp", "tp")}


def groups_by_fixed(layout, fixed=FIXED):
    """Every group of each kind: the ranks that share the kind's fixed coordinates."""
    out = {kind: {} for kind in fixed}
    for rank in range(layout.world_size):
        c = layout.coords(rank)._asdict()
        for kind, keep in fixed.items():
            out[kind].setdefault(tuple(c[a] for a in keep), []).append(rank)
    return {kind: list(g.values()) for kind, g in out.items()}


def process_groups(layout):
    return groups_by_fixed(layout)


def cut(gpt, layout, coords, groups, batch, seq_len, floor_blocks=False,
        whole_head=False, no_ring=False, positions_from_zero=False):
    layers, pp = gpt.cfg.layers, layout.pp
    if floor_blocks:
        lo, hi = coords.pp * layers // pp, (coords.pp + 1) * layers // pp
    else:
        lo, hi = round(coords.pp * layers / pp), round((coords.pp + 1) * layers / pp)
    tp = groups["tp"]
    blocks = {}
    for i in range(lo, hi):
        block = TensorParallelBlock(gpt.blocks[i], tp, sequence_parallel=True)
        if layout.cp > 1 and not no_ring:
            block.attn = RingSelfAttention(block.attn, groups["cp"])
        blocks[i] = block
    piece = {"blocks": blocks}
    if coords.pp == 0:
        piece.update(tok=VocabParallelEmbedding(gpt.tok, tp, sequence_parallel=True),
                     pos=gpt.pos)
    if coords.pp == pp - 1:
        piece.update(ln_f=gpt.ln_f, lm_head=gpt.lm_head if whole_head
                     else ColumnParallelLinear(gpt.lm_head, tp))
    b, c = batch // layout.dp, seq_len // layout.cp
    first = 0 if positions_from_zero else coords.cp * c
    piece.update(rows=range(coords.dp * b, (coords.dp + 1) * b),
                 positions=range(first, first + c))
    return piece


def stub(*args):
    raise ls.NotWritten("stub")


def checked(run):
    """What ``ls.your_turn.check`` returns for ``run`` (None: "not written yet")."""
    return ls.your_turn.check(run, "answer")


# --- your turn 1: the process groups ----------------------------------------------------

def test_process_groups_reference_passes_structure_and_parity(capsys):
    build_checks.check_process_groups(process_groups)


def test_process_groups_stub_is_not_written(capsys):
    assert checked(lambda: build_checks.check_process_groups(stub)) is None
    assert "answer is not written yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, words", [
    (lambda lay: dict(groups_by_fixed(lay), tp=groups_by_fixed(lay)["dp"]),
     "the tp groups are strided ([0, 8]...: the layout's dp groups): tp must be "
     "consecutive ranks"),
    (lambda lay: dict(groups_by_fixed(lay), dp_cp=groups_by_fixed(lay)["dp"]),
     "dp_cp is missing ranks of the cp axis: its groups are the dp groups"),
    (lambda lay: dict(groups_by_fixed(lay), tp=[[r, r + 1] for r in range(
        lay.world_size - 1)]), "rank 1 is in two tp groups, [0, 1] and [1, 2]"),
    (lambda lay: dict(groups_by_fixed(lay), pp=[g[::-1] for g in groups_by_fixed(lay)["pp"]]),
     "pp group [4, 0] lists its ranks out of order"),
    (lambda lay: dict(groups_by_fixed(lay), cp=[g[:1] for g in groups_by_fixed(lay)["cp"]]),
     "rank 2 is in no cp group"),
    (lambda lay: dict(groups_by_fixed(lay), pp=groups_by_fixed(
        lay, dict(FIXED, pp=("dp", "cp")))["pp"]),
     "pp group [0, 1, 4, 5] mixes ranks 0 and 1, which differ in tp"),
    (lambda lay: {k: v for k, v in groups_by_fixed(lay).items() if k != "dp_cp"},
     "no dp_cp groups"),
    (layout_groups, "it called layout_groups or axis_groups"),
])
def test_process_groups_wrong_answers_are_named(wrong, words):
    with pytest.raises(AssertionError) as err:
        build_checks.check_group_structure(wrong)
    assert words in str(err.value)
    assert str(err.value).startswith("process_groups(Layout(dp=2, tp=2, pp=2, cp=2)): ")


def test_groups_too_small_are_named_on_a_layout_of_degree_4():
    def pairs(lay):          # tp = 4 cut into pairs of consecutive ranks
        return dict(groups_by_fixed(lay), tp=[[r, r + 1] for r in range(0, 4, 2)])
    with pytest.raises(AssertionError, match=r"tp group \[0, 1\] has 2 ranks, should "
                                             r"have tp = 4"):
        build_checks.check_group_structure(pairs, [(1, 4, 1, 1)])


# --- your turn 2: the stage cut ---------------------------------------------------------

def test_cut_reference_passes_structure_and_parity():
    build_checks.check_stage_cut(cut)


def test_cut_stub_is_not_written(capsys):
    assert checked(lambda: build_checks.check_stage_cut(stub)) is None
    assert "answer is not written yet" in capsys.readouterr().out


@pytest.mark.parametrize("layout, kw, words", [
    ((1, 1, 3, 1), dict(floor_blocks=True),
     "stage 1 of pp=3 holds blocks [1] but should "
     "hold [1, 2]: runs are near-equal and contiguous"),
    ((1, 1, 1, 3), dict(positions_from_zero=True),
     "positions 0..11 on cp rank 1 of 3: its slice of c = s/cp = 12 positions starts "
     "at c·cp_rank = 12"),
    ((1, 4, 1, 1), dict(whole_head=True),
     "lm_head.weight is (264, 48) on tp rank 0 of 4, should be (66, 48): tp splits its "
     "dim 0"),
    ((1, 1, 1, 3), dict(no_ring=True),
     "blocks.0.attn is not a ring: with cp > 1 every attention runs as a causal ring"),
])
def test_cut_wrong_answers_are_named(layout, kw, words):
    def wrong(*args):
        return cut(*args, **kw)
    with pytest.raises(AssertionError) as err:
        build_checks.check_cut_structure(wrong, [layout])
    assert words in str(err.value)
    assert str(err.value).startswith(f"cut on {Layout(*layout)!r}, rank ")


def test_a_cut_on_another_tp_group_is_named():
    def cp_for_tp(gpt, layout, coords, groups, batch, seq_len):
        return cut(gpt, layout, coords, dict(groups, tp=groups["cp"]), batch, seq_len)
    # rank 0 holds the right shard (its cp rank is its tp rank): its layers' group is wrong
    with pytest.raises(AssertionError, match=r"rank 0 \(dp=0, tp=0, pp=0, cp=0\): tok "
                                             r"communicates over ranks \[0, 2\], should "
                                             r"over \[0, 1\]: this rank's tp group"):
        build_checks.check_cut_structure(cp_for_tp, [(1, 2, 1, 2)])


def test_parity_fails_on_a_run_that_is_not_one_process():
    lay = (3, 1, 1, 1)
    outs = session.run(trainer.train, lay, build_checks.PARITY_STEPS, world_size=3,
                       backend="gloo", sync=compare.sync_without_dp,
                       record_grads=tuple(range(build_checks.PARITY_STEPS)),
                       **build_checks.PARITY)
    with pytest.raises(AssertionError, match="the mean over the dp group is the reference"):
        build_checks._assert_parity(lay, outs, "a broken sync")


def test_a_head_cut_over_another_group_is_named_by_its_shard():
    def head_over_cp(gpt, layout, coords, groups, batch, seq_len):
        piece = cut(gpt, layout, coords, groups, batch, seq_len)
        piece["lm_head"] = ColumnParallelLinear(gpt.lm_head, groups["cp"])
        return piece
    with pytest.raises(AssertionError, match=r"rank 1 \(dp=0, tp=1, pp=0, cp=0\): "
                                             r"lm_head.weight holds tp shard 0 of 2 on tp "
                                             r"rank 1, should hold shard 1"):
        build_checks.check_cut_structure(head_over_cp, [(1, 2, 1, 2)])


# --- the grid -----------------------------------------------------------------------------

@pytest.mark.parametrize("layout", [(2, 2, 2, 2), (3, 1, 2, 4)])
def test_grid_draws_every_rank_once_per_panel(layout):
    lay = Layout(*layout)
    fig = grid.grid_figure(lay)
    panels = {}
    for trace in fig.data:
        panels.setdefault(trace.xaxis, []).extend(int(t) for t in trace.text)
    assert len(panels) == len(grid.KINDS)
    for ranks in panels.values():
        assert sorted(ranks) == list(range(lay.world_size))
    places = [grid.position(lay, r) for r in range(lay.world_size)]
    assert len(set(places)) == lay.world_size         # no two ranks on one spot
    # one trace per group, its ranks' places the trace's points
    groups = layout_groups(lay)
    assert len(fig.data) == sum(len(groups[k]) for k in grid.KINDS)
    assert fig.layout.title.text.startswith(
        f"{lay.world_size} ranks, dp={lay.dp} tp={lay.tp} pp={lay.pp} cp={lay.cp}")

