"""Measurement and checking helpers of chapter 4 (tensor parallelism).

    with tp_probe.record() as log:              # every collective of labsupport.tensor_parallel
        loss = tp_model(ids, targets)
    tp_probe.shard_like(tp_model, full_grads, tp_rank, tp_world_size)
    tp_probe.local_grad(dtensor_param)          # DTensor's gradient in our layout
"""
import contextlib

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch import nn

_log = None  # a list while record() is active


@contextlib.contextmanager
def record():
    """Log every collective of the chapter's operators: dicts(op, phase, nbytes, shape).

    ``nbytes`` is the collective's payload S: the tensor of an all-reduce, the
    gathered (full) tensor of an all-gather, the input of a reduce-scatter.
    """
    global _log
    outer, _log = _log, []
    try:
        yield _log
    finally:
        _log = outer


def log_collective(op: str, phase: str, tensor: torch.Tensor):
    """Called by the operators: append one entry to the active record(), if any."""
    if _log is not None:
        _log.append(dict(op=op, phase=phase, nbytes=tensor.numel() * tensor.element_size(),
                         shape=tuple(tensor.shape)))


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


# -- the checks behind the chapter's your-turn cells ----------------------------------

def check_reduce_from_tp(g):
    """The reader's g, ``g.apply(x, group)``, on this rank: sum forward, identity backward."""
    import torch.distributed as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    x = (torch.arange(6.0).view(2, 3) * (rank + 1)).requires_grad_()
    y = g.apply(x, None)
    want = torch.arange(6.0).view(2, 3) * n * (n + 1) / 2
    assert isinstance(y, torch.Tensor) and torch.equal(y.detach(), want), (
        f"rank {rank}: forward returned {_show(y)}; g's forward is the sum over the "
        f"{n} ranks, {want.tolist()} (dist.all_reduce of a copy of x)")
    y.backward(torch.full_like(y, rank + 1.0))
    assert x.grad is not None and torch.equal(x.grad, torch.full_like(x, rank + 1.0)), (
        f"rank {rank}: backward gave x.grad = {_show(x.grad)} for an incoming gradient of "
        f"{rank + 1.0} everywhere; g's backward is the identity: each rank keeps its own "
        "gradient (an all-reduce there is f's backward, and would sum the ranks' gradients)")
    return True


def check_masked_lookup(fn, vocab_size=12, hidden=3):
    """Run the reader's ``fn(ids, weight, start)`` on this rank's slice of a known table."""
    import torch.distributed as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    table = torch.arange(1.0, vocab_size * hidden + 1).view(vocab_size, hidden)
    rows = vocab_size // n
    start = rank * rows
    weight = table[start:start + rows].clone().requires_grad_()
    ids = torch.arange(vocab_size).flip(0).view(2, -1)                 # (b, s)
    out = fn(ids, weight, start)
    assert isinstance(out, torch.Tensor) and out.shape == (*ids.shape, hidden), (
        f"rank {rank}: expected a tensor of shape {(*ids.shape, hidden)} (b, s, h), "
        f"got {_show(out)}")
    for i in ids.flatten().tolist():
        mine = start <= i < start + rows
        want = table[i] if mine else torch.zeros(hidden)
        got = out.detach().reshape(-1, hidden)[ids.flatten().tolist().index(i)]
        assert torch.equal(got, want), (
            f"rank {rank} (rows {start}..{start + rows - 1} of the table): id {i} gave "
            f"{got.tolist()}, expected {want.tolist()}: " + (
                "its row, weight[id - start]" if mine else
                "zeros, since another rank owns it (the all-reduce adds that rank's row)"))
    out.sum().backward()
    assert weight.grad is not None and torch.equal(weight.grad, torch.ones_like(weight)), (
        f"rank {rank}: each id appears once, so every row of weight should get gradient 1; "
        f"got {_show(weight.grad)}. Ids outside the slice must add nothing to any row "
        "(zero their output rows, e.g. with masked_fill, after the lookup)")
    return True


def _show(t):
    return t.tolist() if isinstance(t, torch.Tensor) else repr(t)


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
