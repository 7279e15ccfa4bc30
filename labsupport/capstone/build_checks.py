"""Checks of the your-turn cells of notebooks/11_building_the_composition.ipynb.

- ``check_process_groups(fn)``: the reader's ``process_groups(layout)``,
  every group of each kind (dp, pp, cp, tp, dp_cp) as lists of ranks, from the
  ranks' coordinates (picotron's ``process_group_manager.py``). Compared with
  ``layout.layout_groups`` on layouts up to 72 ranks, each fault named (a
  strided tp group, a rank in two groups, dp_cp without its cp ranks...);
  then the decoder trains on the reader's groups and is compared with one
  process (``compare``), on layouts with degrees of 3 and 4.
- ``check_stage_cut(cut)``: the reader's ``cut(gpt, layout, coords, groups,
  batch, seq_len)``, this rank's piece of the whole seeded decoder (its
  blocks, TP shards, ring attention, rows and positions of the batch).
  Compared on every rank with ``capstone.model.Stage`` (parameters, shapes,
  values, the groups each layer talks over), each fault named; then the
  decoder trains on the reader's stages, reading the reader's rows and
  positions, and is compared with one process.
"""
import contextlib
import dataclasses
import math

import torch
import torch.distributed as dist
from torch import nn

from labsupport import models
from labsupport.capstone import compare, trainer
from labsupport.capstone import data as capdata
from labsupport.capstone import layout as caplayout
from labsupport.capstone.layout import AXES, Layout, layout_groups, make_groups, new_groups
from labsupport.capstone.model import Stage, stage_blocks
from labsupport.context_parallel.ring_attention import RingSelfAttention
from labsupport.device_mesh import mesh
from labsupport.launch import session
from labsupport.tensor_parallel.gpt import sequence_parallel_params

KINDS = (*AXES, "dp_cp")
# which coordinates the ranks of one group of each kind may differ in
VARIES = {"dp": {"dp"}, "pp": {"pp"}, "cp": {"cp"}, "tp": {"tp"}, "dp_cp": {"dp", "cp"}}
# The structural layouts (no ranks started): every degree 1 to 4, up to 72 ranks.
GROUP_LAYOUTS = [(2, 2, 2, 2), (3, 1, 1, 1), (1, 4, 1, 1), (1, 1, 3, 1), (1, 1, 1, 3),
                 (3, 4, 2, 3), (2, 3, 4, 1), (4, 2, 1, 3)]
# A decoder that degrees 3 and 4 divide (heads, hidden, vocabulary, positions
# under cp x tp with sequence parallelism, rows per replica and micro-batch),
# with 4 blocks, so that pp = 3 cuts uneven runs [0], [1, 2], [3].
PARITY = dict(batch=12, seq_len=36,
              model=dict(vocab_size=264, hidden=48, heads=12, layers=4))
PARITY_STEPS = 2
# The layouts trained (dp, tp, pp, cp): tp = 4 and pp = 3; dp = 3 and cp = 3.
GROUP_PARITY_LAYOUTS = [(3, 2, 1, 2), (1, 4, 3, 1)]
# 12 ranks first, as turn 1's check ends: the chapter's running ranks are reused
STAGE_LAYOUTS = [(1, 4, 3, 1), (2, 3, 2, 1), (3, 1, 1, 3)]


def name_of(layout) -> str:
    """``Layout(dp=2, tp=2, pp=2, cp=2)``: the one order the chapter prints."""
    return repr(Layout(*layout))


def where(layout, rank) -> str:
    c = Layout(*layout).coords(rank)
    return f"rank {rank} (dp={c.dp}, tp={c.tp}, pp={c.pp}, cp={c.cp})"


# --- your turn 1: the process groups --------------------------------------------------

@contextlib.contextmanager
def _answers_hidden(layout):
    """``layout_groups`` and ``axis_groups`` refuse while the reader's function runs."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"process_groups({name_of(layout)}): it called "
                             "layout_groups or axis_groups, which the check compares "
                             "it with: derive the groups from the coordinates "
                             "(layout.coords(rank))")
    saved = [(caplayout, "layout_groups"), (caplayout, "axis_groups"),
             (mesh, "axis_groups")]
    old = [getattr(m, n) for m, n in saved]
    for m, n in saved:
        setattr(m, n, refuse)
    try:
        yield
    finally:
        for (m, n), f in zip(saved, old):
            setattr(m, n, f)


def groups_problem(got, layout) -> str | None:
    """What is wrong with ``got`` ({kind: [[ranks], ...]}) for ``layout``, or None."""
    layout = Layout(*layout)
    want = layout_groups(layout)
    if not isinstance(got, dict) or set(KINDS) - set(got):
        missing = sorted(set(KINDS) - set(got)) if isinstance(got, dict) else list(KINDS)
        return (f"no {', '.join(missing)} groups: return a dict with every group of each "
                f"kind, {{'dp': [[0, ...], ...], 'pp': ..., 'cp': ..., 'tp': ..., "
                f"'dp_cp': ...}}")
    for kind in ("tp", "cp", "pp", "dp", "dp_cp"):
        groups = [[int(r) for r in g] for g in got[kind]]
        problem = (_coverage(kind, groups, layout) or _wrong_kind(kind, groups, want)
                   or _mixed(kind, groups, layout) or _size(kind, groups, want)
                   or _order(kind, groups))
        if problem:
            return problem
    return None


def _coverage(kind, groups, layout):
    seen = {}
    for g in groups:
        for r in g:
            if not 0 <= r < layout.world_size:
                return (f"{kind} group {g} holds rank {r}, outside the world's "
                        f"{layout.world_size} ranks")
            if r in seen and seen[r] is not g:
                return (f"rank {r} is in two {kind} groups, {seen[r]} and {g}: each rank "
                        f"is in exactly one group of each kind")
            if r in seen:
                return f"{kind} group {g} lists rank {r} twice"
            seen[r] = g
    missing = [r for r in range(layout.world_size) if r not in seen]
    if missing:
        return (f"rank {missing[0]} is in no {kind} group ({len(missing)} ranks are "
                f"missing): every rank is in exactly one group of each kind")
    return None


def _as_set(groups):
    return {tuple(sorted(g)) for g in groups}


def _wrong_kind(kind, groups, want):
    """The reader's groups of ``kind`` are exactly another kind's."""
    other = next((k for k in KINDS if k != kind and _as_set(groups) == _as_set(want[k])
                  and _as_set(want[k]) != _as_set(want[kind])), None)
    if other is None:
        return None
    sample = sorted(groups)[0]
    if kind == "tp":
        return (f"the tp groups are strided ({sample}...: the layout's {other} groups): "
                f"tp must be consecutive ranks, tp varies fastest on the mesh "
                f"(dp, pp, cp, tp)")
    if kind == "dp_cp" and other in ("dp", "cp"):
        lost = "cp" if other == "dp" else "dp"
        return (f"dp_cp is missing ranks of the {lost} axis: its groups are the "
                f"{other} groups ({sample}...); a dp_cp group holds the dp·cp ranks "
                f"that share pp and tp, every dp and cp coordinate")
    return (f"the {kind} groups are the layout's {other} groups ({sample}...): a {kind} "
            f"group's ranks share every coordinate but {kind}")


def _mixed(kind, groups, layout):
    """A group whose ranks differ in a coordinate its kind keeps fixed."""
    for g in groups:
        for a in g:
            for b in g:
                ca, cb = layout.coords(a), layout.coords(b)
                off = [ax for ax in AXES if ax not in VARIES[kind]
                       and getattr(ca, ax) != getattr(cb, ax)]
                if off:
                    keep = " and ".join(sorted(set(AXES) - VARIES[kind]))
                    return (f"{kind} group {g} mixes ranks {a} and {b}, which differ "
                            f"in {off[0]} ({where(layout, a)}, {where(layout, b)}): "
                            f"the ranks of a {kind} group share {keep}")
    return None


def _size(kind, groups, want):
    size = len(want[kind][0])
    small = next((g for g in groups if len(g) != size), None)
    if small is None:
        return None
    what = "dp·cp" if kind == "dp_cp" else kind
    return (f"{kind} group {small} has {len(small)} ranks, should have {what} = {size}: "
            f"every rank whose coordinates differ only in {' and '.join(VARIES[kind])}")


def _order(kind, groups):
    bad = next((g for g in groups if g != sorted(g)), None)
    if bad is None:
        return None
    return (f"{kind} group {bad} lists its ranks out of order: list them by their "
            f"{kind} coordinate (rank order; the pp group's first rank is stage 0, its "
            f"last the stage that holds the loss)")


def check_group_structure(fn, layouts=GROUP_LAYOUTS):
    """``fn(layout)`` against ``layout_groups`` on ``layouts``; the first fault named."""
    for lay in layouts:
        with _answers_hidden(lay):
            got = fn(Layout(*lay))
        problem = groups_problem(got, lay)
        assert problem is None, f"process_groups({name_of(lay)}): {problem}"


def _train_with_groups(process_groups, layout, steps, **fields):
    """On every rank: ``trainer.train`` with the reader's groups as process groups."""
    def groups_of(lay):
        return new_groups(process_groups(lay))
    return trainer.train(layout, steps, groups_of=groups_of, **fields)


def check_process_groups(fn, layouts=GROUP_LAYOUTS, parity_layouts=GROUP_PARITY_LAYOUTS):
    """Structure first (no ranks), then training on ``fn``'s groups against one process."""
    check_group_structure(fn, layouts)
    for lay in parity_layouts:
        _assert_parity(lay, session.run(
            _train_with_groups, fn, tuple(lay), PARITY_STEPS, world_size=math.prod(lay),
            backend="gloo", record_grads=tuple(range(PARITY_STEPS)), **PARITY),
            "trained on process_groups' groups")


_REFERENCE = {}


def one_process(steps=PARITY_STEPS):
    """``trainer.reference`` (models.GPT in this process) with the checks' decoder."""
    if steps not in _REFERENCE:
        _REFERENCE[steps] = trainer.reference(steps, record_grads=tuple(range(steps)),
                                              **PARITY)
    return _REFERENCE[steps]


def against_one_process(layout, outs) -> compare.Report:
    """``compare.first_difference`` of a run's ``outs`` (gradients recorded at
    every step) against ``one_process()``."""
    ref = one_process()
    one = [dict(losses=ref["losses"], layout=(1, 1, 1, 1))]
    return compare.first_difference(one, outs, layout, ref=ref)


def _assert_parity(layout, outs, what):
    report = against_one_process(layout, outs)
    assert report.equal, f"on {name_of(layout)}, {what}, not one process:\n{report}"


# --- your turn 2: this rank's stage, cut from the whole model --------------------------

ENDS = {"tok": "first", "pos": "first", "ln_f": "last", "lm_head": "last"}
HINTS = {"tok": "the token embedding is vocab-parallel (VocabParallelEmbedding: V/tp "
                "rows on each tp rank)",
         "lm_head": "the LM head is column-parallel (ColumnParallelLinear: V/tp output "
                    "rows on each tp rank)",
         "blocks": "the blocks are tensor-parallel (TensorParallelBlock: heads and MLP "
                   "split over tp)"}


def _span(r) -> str:
    r = list(r)
    return f"{r[0]}..{r[-1]}" if r else "none"


class PieceStage(Stage):
    """``Stage`` put together from the reader's piece: its modules, its blocks, the
    start of its positions; forward, loss and shards are ``Stage``'s."""

    def __init__(self, piece, cfg, group, sequence_parallel=True):
        nn.Module.__init__(self)
        self.split = dist.get_world_size(group) > 1    # as Stage: tp = 1 splits nothing
        sequence_parallel = sequence_parallel and self.split
        self.cfg, self.group, self.sequence_parallel = cfg, group, sequence_parallel
        self.first, self.last = "tok" in piece, "lm_head" in piece
        c = len(piece["positions"])
        self.cp_rank, self.cp = piece["positions"][0] // c, cfg.seq_len // c
        for name in ENDS:
            if name in piece:
                setattr(self, name, piece[name])
        self.blocks = nn.ModuleDict({str(i): piece["blocks"][i]
                                     for i in sorted(piece["blocks"])})
        ends = [getattr(self, n) for n in ("pos", "ln_f") if hasattr(self, n)]
        self.sp_params = sequence_parallel_params(self.blocks.values(), *ends)


def piece_problem(piece, layout, coords, groups, cfg, batch, seq_len) -> str | None:
    """What is wrong with the reader's piece on this rank, or None (run on the rank)."""
    layout = Layout(*layout)
    keys = {"blocks", "rows", "positions"}
    if not isinstance(piece, dict) or keys - set(piece):
        return ("cut must return a dict: 'blocks' ({index: module}), 'rows' and "
                "'positions' (ranges of the global batch), and 'tok', 'pos', 'ln_f', "
                "'lm_head' where this rank holds them")
    return (_blocks(piece, layout, coords, cfg) or _ends(piece, layout, coords)
            or _batch_slice(piece, layout, coords, batch, seq_len)
            or _parameters(piece, layout, coords, groups, cfg))


def _blocks(piece, layout, coords, cfg):
    got = sorted(piece["blocks"])
    want = list(stage_blocks(cfg.layers, layout.pp, coords.pp))
    if got == want:
        return None
    return (f"stage {coords.pp} of pp={layout.pp} holds blocks {got} but should hold "
            f"{want}: runs are near-equal and contiguous, stage i from block "
            f"round(i·L/pp) (L = {cfg.layers})")


def _ends(piece, layout, coords):
    holds = {"first": coords.pp == 0, "last": coords.pp == layout.pp - 1}
    for name, end in ENDS.items():
        what = ("the embeddings (tok, pos)" if end == "first"
                else "the final LayerNorm and the LM head (ln_f, lm_head)")
        if holds[end] and name not in piece:
            return (f"stage {coords.pp} of pp={layout.pp} lacks {name}: the {end} stage "
                    f"holds {what}")
        if not holds[end] and name in piece:
            return (f"stage {coords.pp} of pp={layout.pp} holds {name}: only the {end} "
                    f"stage holds {what}")
    return None


def _batch_slice(piece, layout, coords, batch, seq_len):
    b, c = batch // layout.dp, seq_len // layout.cp
    rows, positions = list(piece["rows"]), list(piece["positions"])
    want_rows = list(range(coords.dp * b, (coords.dp + 1) * b))
    want_pos = list(range(coords.cp * c, (coords.cp + 1) * c))
    if rows != want_rows:
        return (f"rows {_span(rows)} on dp rank {coords.dp} of {layout.dp}: its "
                f"b/dp = {b} rows start at dp_rank·b/dp = {want_rows[0]}")
    if positions != want_pos:
        return (f"positions {_span(positions)} on cp rank {coords.cp} of {layout.cp}: its "
                f"slice of c = s/cp = {c} positions starts at c·cp_rank = {want_pos[0]}")
    return None


def _parameters(piece, layout, coords, groups, cfg):
    """Names, shapes, values and groups against ``Stage`` of a fresh seeded decoder."""
    whole = dict(models.GPT(cfg, seed=0).named_parameters())
    want = Stage(models.GPT(cfg, seed=0), layout, coords, groups)
    got = PieceStage(piece, cfg, groups["tp"])
    mine, theirs = dict(got.named_parameters()), dict(want.named_parameters())
    for name in theirs:
        if name not in mine:
            return f"this rank lacks {name}"
    for name in mine:
        if name not in theirs:
            return f"this rank holds {name}, which its stage does not"
    shards, tp = want.shards(), layout.tp
    for name, p in theirs.items():
        q, top = mine[name], name.split(".")[0]
        if q.shape != p.shape:
            split = shards[name]
            how = (f"tp splits its dim {split[0]} (1/{tp} on each tp rank)" if split
                   else "it is whole on every tp rank")
            return (f"{name} is {tuple(q.shape)} on tp rank {coords.tp} of {tp}, should "
                    f"be {tuple(p.shape)}: {how}; {HINTS.get(top, HINTS['blocks'])}")
        if not torch.equal(q.detach(), p.detach()):
            return _which_values(name, q.detach(), whole, shards[name], coords)
    return _groups_used(got, want, groups) or _sequence_parallel(got, want)


def _which_values(name, got, whole, shard, coords):
    full = whole[name].detach()
    if shard is not None:
        dim, rank, tp = shard
        k = next((k for k, part in enumerate(full.chunk(tp, dim))
                  if torch.equal(part, got)), None)
        if k is not None:
            return (f"{name} holds tp shard {k} of {tp} on tp rank {rank}, should hold "
                    f"shard {rank}: cut it with this rank's tp group, groups['tp']")
    if name.startswith("blocks."):
        i = name.split(".")[1]
        rest = name.split(".", 2)[2]
        for j in range(len({n.split(".")[1] for n in whole if n.startswith("blocks.")})):
            cand = whole.get(f"blocks.{j}.{rest}")
            if cand is not None and cand.shape == got.shape and torch.equal(cand, got):
                return f"blocks.{i} holds block {j}'s weights: key each block by its index"
    return (f"{name} on this rank differs from the seeded decoder's "
            f"(largest difference {(got - _local(full, shard)).abs().max():.3g}): cut it "
            f"from gpt, the whole seeded model, without changing its values")


def _local(full, shard):
    return full if shard is None else full.chunk(shard[2], shard[0])[shard[1]]


def _ranks(group):
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def _groups_used(got, want, groups):
    """Every layer that communicates talks over the right ranks (tp, or cp's ring)."""
    mine = dict(got.named_modules())
    for mname, module in want.named_modules():
        if not mname or getattr(module, "group", None) is None:
            continue
        theirs = mine.get(mname)
        if isinstance(module, RingSelfAttention) and not isinstance(theirs,
                                                                      RingSelfAttention):
            return (f"{mname} is not a ring: with cp > 1 every attention runs as a causal "
                    f"ring over the cp group (RingSelfAttention)")
        if theirs is None or not hasattr(theirs, "group"):
            continue                # its shapes or values were compared already
        have, need = _ranks(theirs.group), _ranks(module.group)
        if have != need:
            kind = next(k for k, r in groups["ranks"].items() if r == need)
            return (f"{mname} communicates over ranks {have}, should over {need}: this "
                    f"rank's {kind} group, groups[{kind!r}]")
    return None


def _sequence_parallel(got, want):
    mine = dict(got.named_modules())
    for mname, module in want.named_modules():
        if getattr(module, "sequence_parallel", False) and mname and not getattr(
                mine.get(mname), "sequence_parallel", True):
            return (f"{mname} runs without sequence parallelism: the trainer's stages "
                    f"run with sequence_parallel=True (pass it to TensorParallelBlock "
                    f"and VocabParallelEmbedding)")
    return None


def _cut_on_rank(cut, layout, cfg, batch, seq_len):
    """On every rank: this rank's finding (a sentence), or None."""
    layout = Layout(*layout)
    groups = make_groups(layout)
    coords = layout.coords(dist.get_rank())
    piece = cut(models.GPT(cfg, seed=0), layout, coords, groups, batch, seq_len)
    return piece_problem(piece, layout, coords, groups, cfg, batch, seq_len)


def check_cut_structure(cut, layouts=STAGE_LAYOUTS):
    """The reader's pieces against ``Stage`` on every rank of ``layouts``."""
    cfg = trainer.TrainConfig.of(**PARITY).gpt_config()
    for lay in layouts:
        found = session.run(_cut_on_rank, cut, tuple(lay), cfg, PARITY["batch"],
                            PARITY["seq_len"], world_size=math.prod(lay), backend="gloo")
        bad = [(r, f) for r, f in enumerate(found) if f]
        more = len(bad) - 1
        assert not bad, (f"cut on {name_of(lay)}, {where(lay, bad[0][0])}: {bad[0][1]}"
                         + (f" ({more} other rank{'s' * (more > 1)} wrong too)" if more
                            else ""))


class PieceLoader(capdata.Loader):
    """The global batches, this rank keeping the reader's rows and positions."""

    def __init__(self, data, batch, seq_len, seed, rows, positions):
        super().__init__(data, batch, seq_len, seed)
        self.rows, self.positions = rows, positions

    def local(self, ids, targets):
        return tuple(t[self.rows[0]:self.rows[-1] + 1,
                       self.positions[0]:self.positions[-1] + 1].contiguous()
                     for t in (ids, targets))


@dataclasses.dataclass(frozen=True)
class PieceConfig(trainer.TrainConfig):
    """``TrainConfig`` whose loader reads the rows and positions the reader's cut
    chose (``piece``: filled on the rank when the stage is cut)."""
    piece: dict = dataclasses.field(default_factory=dict)

    def loader(self, layout=None, coords=None):
        if layout is None:
            return super().loader()
        text = capdata.split(capdata.corpus())[0] if self.text is None else self.text
        return PieceLoader(text, self.batch, self.seq_len, self.data_seed,
                           self.piece["rows"], self.piece["positions"])


def _train_with_cut(cut, layout, steps, **fields):
    """On every rank: ``trainer.train`` on the reader's stage, rows and positions."""
    config = PieceConfig(**fields)

    def stage_class(gpt, layout, coords, groups, sequence_parallel):
        piece = cut(gpt, layout, coords, groups, config.batch, config.seq_len)
        config.piece.update(rows=piece["rows"], positions=piece["positions"])
        return PieceStage(piece, gpt.cfg, groups["tp"], sequence_parallel)

    return trainer.train(layout, steps, config, stage_class=stage_class,
                         record_grads=tuple(range(steps)))


def train_on_cut(cut, layout) -> list:
    """``PARITY_STEPS`` steps of the checks' decoder on ``cut``'s stages, rows and
    positions, with no structural check first: every rank's ``train`` record."""
    return session.run(_train_with_cut, cut, tuple(layout), PARITY_STEPS,
                       world_size=math.prod(layout), backend="gloo", **PARITY)


def check_stage_cut(cut, layouts=STAGE_LAYOUTS):
    """Structure on every rank first, then training on the reader's cut against one
    process, on each of ``layouts``."""
    for lay in layouts:     # one layout at a time: its ranks start once
        check_cut_structure(cut, [lay])
        _assert_parity(lay, train_on_cut(cut, lay),
                       "trained on cut's stages, rows and positions")
