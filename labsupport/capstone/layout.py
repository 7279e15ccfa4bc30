"""A (dp, tp, pp, cp) layout: where each rank sits, and its groups.

    layout = Layout(dp=2, tp=2, pp=2, cp=1)          # 8 ranks
    layout.coords(5)                                 # Coords(dp=1, pp=0, cp=0, tp=1)
    groups = make_groups(layout)                     # on every rank: this rank's groups

The ranks fill a mesh of shape (dp, pp, cp, tp), row-major, tp varying
fastest: picotron's ``torch.arange(world).view(dp, pp, cp, tp)``
(``picotron/process_group_manager.py``). Tensor parallelism is innermost
because it communicates inside every layer, forward and backward, so its
ranks should be consecutive (one node, the fastest links); context
parallelism next (a ring step per attention); pipeline parallelism may sit
outside data parallelism because it needs only point-to-point messages
between neighbouring stages, once per micro-batch. torchtitan orders its
mesh ``["pp", "dp_replicate", "dp_shard", "cp", "tp"]``
(``torchtitan/distributed/parallel_dims.py``) and Megatron-LM's default
order is ``tp-cp-ep-dp-pp`` (``megatron/core/parallel_state.py``,
innermost first): all three put tp innermost; they differ in whether pp or
dp is outermost. The groups come from chapter 8's ``mesh.axis_groups``; the
ranks that hold pieces of the same weights but different tokens, dp × cp,
are picotron's ``cp_dp_group``: the gradients are averaged over them.
"""
import math
import typing

import torch.distributed as dist

from labsupport.device_mesh.mesh import axis_groups

AXES = ("dp", "pp", "cp", "tp")   # the mesh's dimensions, outermost first


class Coords(typing.NamedTuple):
    dp: int
    pp: int
    cp: int
    tp: int


class Layout(typing.NamedTuple):
    """The degrees of the four dimensions, in the issue's order (dp, tp, pp, cp)."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1

    @property
    def shape(self) -> tuple:
        """The mesh's shape, (dp, pp, cp, tp): tp fastest."""
        return tuple(getattr(self, a) for a in AXES)

    @property
    def world_size(self) -> int:
        return math.prod(self)

    def coords(self, rank) -> Coords:
        """Where ``rank`` sits on the mesh."""
        out = []
        for size in reversed(self.shape):
            rank, c = divmod(rank, size)
            out.append(c)
        return Coords(*reversed(out))

    def rank(self, coords) -> int:
        r = 0
        for c, size in zip(coords, self.shape):
            r = r * size + c
        return r

    def __str__(self):
        return "x".join(map(str, self))


def layout_groups(layout: Layout) -> dict:
    """{name: all the groups of that name}, as lists of ranks: one per axis,
    and "dp_cp", the ranks that differ only in their dp and cp coordinates."""
    out = {name: axis_groups(layout.shape, i) for i, name in enumerate(AXES)}
    cp_of = {r: g for g in out["cp"] for r in g}
    out["dp_cp"] = sorted({tuple(sorted(x for d in g for x in cp_of[d]))
                           for g in out["dp"]})
    out["dp_cp"] = [list(g) for g in out["dp_cp"]]
    return out


_CACHE = {}


def make_groups(layout: Layout) -> dict:
    """This rank's process group of each name of ``layout_groups``, plus
    "ranks": the ranks of each. Every rank creates every group, in one order
    (``dist.new_group`` is collective over the world). Cached per layout for
    the life of the process group."""
    if dist.get_world_size() != layout.world_size:
        raise ValueError(f"layout {layout} (dp x tp x pp x cp) needs "
                         f"{layout.world_size} ranks, not {dist.get_world_size()}: "
                         "start that many")
    key = (layout, id(dist.group.WORLD))
    if key not in _CACHE:
        _CACHE[key] = new_groups(layout_groups(layout))
    return _CACHE[key]


def new_groups(named: dict) -> dict:
    """This rank's process group of each name of ``named`` ({name: every group
    of that name, as lists of ranks}), plus "ranks": the ranks of each. Every
    rank must call it with the same lists: ``dist.new_group`` is collective."""
    rank, mine, ranks = dist.get_rank(), {}, {}
    for name, groups in named.items():
        for g in groups:
            group = dist.new_group(list(g))
            if rank in g:
                mine[name], ranks[name] = group, list(g)
    return dict(mine, ranks=ranks)
