"""Measurement helpers of chapter 4 (tensor parallelism), built on ``labsupport.calls``.

    with calls.record() as log:                 # the one recorder of torch.distributed calls
        loss = tp_model(ids, targets)
    tp_probe.collectives(log)                   # [{"op", "phase", "nbytes", "ranks"}]
    tp_probe.shard_like(tp_model, full_grads, tp_rank, tp_world_size)
    tp_probe.local_grad(dtensor_param)          # DTensor's gradient in our layout

The chapter's your-turn checks are in ``labsupport.tensor_parallel.checks``.
"""
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

# torch.distributed's names of the lesson's collectives, and the book's
_SHORT = {"all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter"}


def collectives(log) -> list[dict]:
    """The collectives of a ``calls.record()`` block, in call order: ``op`` (all_reduce,
    all_gather, reduce_scatter), ``phase`` ("forward", or "backward" when autograd
    ran it), ``nbytes`` (the payload S: the tensor of an all-reduce, the full tensor
    of an all-gather or a reduce-scatter) and ``ranks`` (the group's)."""
    return [dict(op=_SHORT.get(c["op"], c["op"]), nbytes=c["nbytes"], ranks=c["ranks"],
                 phase="backward" if c["in_backward"] else "forward")
            for c in log.calls if c["kind"] == "collective"]


def local_grad(param) -> torch.Tensor:
    """This rank's gradient of a DTensor-parallel parameter, laid out as ours.

    A Shard(d) gradient is its local shard; a Partial(sum) one (the LayerNorms
    under DTensor's SequenceParallel) is summed over the mesh first (a
    collective: call it on every rank, for the same parameters in the same order).
    """
    grad = param.grad
    if not isinstance(grad, DTensor):
        return grad
    if any(p.is_partial() for p in grad.placements):
        grad = grad.redistribute(placements=[Replicate()] * len(grad.placements))
    return grad.to_local()


def shard_like(tp_model: nn.Module, full: dict, rank: int, world_size: int) -> dict:
    """{name: this rank's slice of full[name]} for every parameter name of ``tp_model``.

    ``full`` maps the single-process model's parameter names to tensors
    (weights or gradients); a parallel layer's ``shard_dims`` says which
    dimension it splits, other parameters are replicated.
    """
    modules = dict(tp_model.named_modules())
    out = {}
    for name, _ in tp_model.named_parameters():
        owner, _, attr = name.rpartition(".")
        dim = getattr(modules[owner], "shard_dims", {}).get(attr)
        out[name] = full[name] if dim is None else full[name].chunk(world_size, dim)[rank]
    return out


# -- pictures --------------------------------------------------------------------------

def holders(full: torch.Tensor, shards: list) -> torch.Tensor:
    """For each element of ``full``, the rank whose shard holds it; -1 where all ranks do.

    ``shards[r]`` is rank r's tensor: ``full`` itself (replicated) or a
    contiguous slice of it along one dimension, found by comparing values
    (to fp32 rounding: a slice of a product may round differently). -2: no holder.
    """
    def same(a, b):
        return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    grid = torch.full(full.shape, -2, dtype=torch.long)
    if all(same(s, full) for s in shards):
        return grid.fill_(-1)
    for rank, s in enumerate(shards):
        for dim in range(full.dim()):
            size = s.shape[dim]
            for start in range(0, full.shape[dim] - size + 1, size):
                if same(s, full.narrow(dim, start, size)):
                    grid.narrow(dim, start, size).fill_(rank)
    return grid


def sharding_figure(grids: dict, world_size: int, title: str):
    """One heatmap per tensor (name -> holders() grid): each element coloured by its holder."""
    from plotly.subplots import make_subplots

    from labsupport.plots import PALETTE
    names = list(grids)
    fig = make_subplots(rows=1, cols=len(names), subplot_titles=names, horizontal_spacing=0.06)
    colours = ["#bbbbbb"] + [PALETTE[r % len(PALETTE)] for r in range(world_size)]
    bands = len(colours)                  # one band of the colour scale per holder
    scale = [[edge / bands, c] for i, c in enumerate(colours) for edge in (i, i + 1)]
    for col, name in enumerate(names, start=1):
        grid = grids[name].float()
        text = [["all" if v < 0 else f"rank {int(v)}" for v in row] for row in grid.tolist()]
        fig.add_heatmap(z=grid.tolist(), zmin=-1.5, zmax=world_size - 0.5, colorscale=scale,
                        showscale=False, text=text, hovertemplate="%{text}<extra></extra>",
                        xgap=1, ygap=1, row=1, col=col)
        fig.update_yaxes(autorange="reversed", showticklabels=False, row=1, col=col)
        fig.update_xaxes(showticklabels=False, row=1, col=col)
    fig.update_layout(title=title, height=300)
    return fig
