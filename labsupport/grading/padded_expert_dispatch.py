"""Checks of graded assignment 7: the capacity-padded expert-parallel dispatch.

    import labsupport.grading.padded_expert_dispatch as gp
    gp.check_forward(padded_moe)          # = the MoE layer on one process, nothing dropped
    gp.check_drops(padded_moe)            # a skewed router at c_f = 1: the same rows dropped
    gp.check_backward(padded_moe)         # gradients of x, the router and the experts,
                                          # with nothing dropped and with drops
    gp.check_padded_traffic(padded_moe)   # bytes only: E x capacity rows per all-to-all

The student writes ``padded_moe(x, router, experts, top_k, capacity_factor,
group=None)``: ``x`` (T, h) this rank's tokens, ``router`` the replicated
``nn.Linear(h, E)``, ``experts`` a ``labsupport.expert_parallel.moe.Experts`` holding this
rank's E/N experts (rank r: experts r*E/N ...). It returns y (T, h), which
must equal chapter 9's ``labsupport.expert_parallel.moe.MoE`` on one process (``groups=N``:
each rank's tokens are one group for the capacity and its dropping rule) and
be differentiable. The dispatch pads every expert to its capacity: every
all-to-all moves E x capacity rows, whatever the routing. Each check runs on
the ranks through ``labsupport.grading.run`` (a deadline: a deadlock fails
with an explanation, never a hung grader) and raises AssertionError with a
message a student can act on.
"""
import functools

import torch
import torch.distributed as dist

from labsupport import models, traffic
from labsupport.checking import collective_checks
from labsupport.checking.collective_checks import WORLD_SIZES  # (2, 4): one home
from labsupport.checking.diagnosis import name_of
from labsupport.expert_parallel import moe

H, FFN, E = 8, 16, 8            # hidden, expert width, experts
TOKENS = 12                     # per rank, correctness checks
TRAFFIC = dict(tokens=64, hidden=32)   # larger, so that headers are negligible
_TOL = dict(rtol=1e-7, atol=1e-9)      # float64


def case(num_tokens, hidden, top_k, factor, n, skew=0.0, seed=0):
    """The chapter's layer (float64), n x num_tokens tokens, an output gradient."""
    with models.seeded(seed):
        layer = moe.MoE(hidden, 2 * hidden, E, top_k, factor, groups=n).double()
    g = torch.Generator().manual_seed(seed + 1)
    x, dy = torch.randn(2, n * num_tokens, hidden, generator=g, dtype=torch.float64)
    for e in (0, 1):                     # skew: every token leans to experts 0 and 1
        w = layer.router.weight[e].detach()
        x = x + skew * w / w.dot(w)
    return layer, x, dy


def expected(num_tokens, hidden, top_k, factor, n, skew):
    """y, the gradients and the rows each expert keeps, on one process."""
    layer, x, dy = case(num_tokens, hidden, top_k, factor, n, skew)
    x.requires_grad_()
    y = layer(x)
    y.backward(dy)
    return dict(y=y.detach(), dx=x.grad, router=layer.router.weight.grad,
                w1=layer.experts.w1.grad, w2=layer.experts.w2.grad, layer=layer, x=x.detach())


def _trial(fn, num_tokens, hidden, top_k, factor, skew, backward):
    rank, n = dist.get_rank(), dist.get_world_size()
    layer, x, dy = case(num_tokens, hidden, top_k, factor, n, skew)
    ep = moe.ExpertParallelMoE(layer)                # this rank's router and experts
    mine = x.chunk(n)[rank].clone().requires_grad_(backward)
    dist.barrier()
    with traffic.count() as wire:
        y = _settled(fn(mine, ep.router, ep.experts, top_k, factor, None))
        if backward and isinstance(y, torch.Tensor) and y.requires_grad:
            y.backward(dy.chunk(n)[rank])
        dist.barrier()
    grads = [p.grad for p in (ep.router.weight, ep.experts.w1, ep.experts.w2, mine)]
    if grads[0] is not None:
        dist.all_reduce(grads[0])                    # every rank's tokens add up
    return dict(y=y.detach() if isinstance(y, torch.Tensor) else y, grads=grads,
                wire=wire.wire_sent)


def _settled(y):
    """A functional collective's result, waited for (its detach() would not wait)."""
    return y.wait() if isinstance(y, torch.Tensor) and callable(getattr(y, "wait", None)) else y


def _runs(fn, world_sizes, num_tokens, hidden, top_k, factor, skew, backward, timeout):
    if not callable(fn):
        raise TypeError(f"pass your function, e.g. check_forward(padded_moe); got {fn!r}")
    trial = functools.partial(_trial, fn)
    trial.__name__ = name_of(fn)             # what a failure report names
    for n in world_sizes:
        calls = collective_checks.run(trial, num_tokens, hidden, top_k, factor, skew, backward,
                            world_size=n, timeout=timeout)
        yield n, [c["value"] for c in calls]


def check_forward(fn, world_sizes=WORLD_SIZES, *, timeout=None):
    """k = 1 and 2, capacity large enough to drop nothing: y equals the layer's."""
    for top_k in (1, 2):
        factor = E / top_k                            # capacity = T: nothing dropped
        _check_outputs(fn, world_sizes, top_k, factor, 0.0, timeout)


def check_drops(fn, world_sizes=WORLD_SIZES, *, timeout=None):
    """A router skewed to experts 0 and 1, c_f = 1: the same rows kept and dropped."""
    for top_k in (1, 2):
        _check_outputs(fn, world_sizes, top_k, 1.0, 3.0, timeout)


def _check_outputs(fn, world_sizes, top_k, factor, skew, timeout):
    name = name_of(fn)
    for n, ranks in _runs(fn, world_sizes, TOKENS, H, top_k, factor, skew, False, timeout):
        want = expected(TOKENS, H, top_k, factor, n, skew)
        for rank, r in enumerate(ranks):
            _assert_output(name, r["y"], want, rank, n, top_k, factor)


def _assert_output(name, y, want, rank, n, top_k, factor):
    where = f"{name} on {n} ranks, rank {rank} (k = {top_k}, capacity factor {factor:g})"
    mine = want["y"].chunk(n)[rank]
    if not isinstance(y, torch.Tensor) or y.shape != mine.shape:
        raise AssertionError(f"{where} returned {_describe(y)}; return y of shape "
                             f"{tuple(mine.shape)}, (T, h): one row per token of this rank")
    if torch.allclose(y.double(), mine, **_TOL):
        return
    layer, x = want["layer"], want["x"].chunk(n)[rank]
    dropless = _dropless(layer, x)
    t = int(((y.double() - mine).abs() > 1e-6).any(-1).nonzero()[0])
    _, chosen, _ = moe.route(layer.router(x), top_k)
    cap = moe.capacity(len(x), top_k, E, factor)
    keep = moe.keep_mask(chosen, E, cap)
    text = (f"{where}: token {t} is {_row(y[t])}, expected {_row(mine[t])} (it chose experts "
            f"{chosen[t].tolist()}, of which the layer keeps {keep[t].tolist()}; capacity "
            f"{cap} rows per expert).")
    if torch.allclose(y.double(), dropless, **_TOL):
        text += (" You kept every choice: an expert takes at most `capacity` rows from a "
                 "rank's tokens, the first ones in token order; drop the rest.")
    elif not keep.all():
        text += (" Each expert keeps the choices that reach it first in token order (token "
                 "0's, then token 1's, ...) up to its capacity, whatever their gates; a "
                 "dropped choice adds nothing.")
    else:
        text += (" y[t] is the sum over t's kept choices of gate x expert(x[t]), the gates "
                 "moe.route gives (renormalised over the k chosen for k > 1, the "
                 "probability itself for k = 1).")
    raise AssertionError(text)


def _dropless(layer, x):
    saved, layer.capacity_factor, layer.groups = layer.capacity_factor, None, 1
    with torch.no_grad():
        out = layer(x)
    layer.capacity_factor = saved
    return out


def check_backward(fn, world_sizes=WORLD_SIZES, *, timeout=None):
    """y.backward(dy), k = 2: the gradients of x, the router and the experts equal the
    layer's, first with nothing dropped, then with the skewed router at c_f = 1, where
    rows are dropped (a dropped choice gets no gradient, a kept one all of its own)."""
    for factor, skew in ((E / 2, 0.0), (1.0, 3.0)):
        _check_grads(fn, world_sizes, factor, skew, timeout)


def _check_grads(fn, world_sizes, factor, skew, timeout):
    name = name_of(fn)
    for n, ranks in _runs(fn, world_sizes, TOKENS, H, 2, factor, skew, True, timeout):
        want = expected(TOKENS, H, 2, factor, n, skew)
        per = E // n
        for rank, r in enumerate(ranks):
            _assert_output(name, r["y"], want, rank, n, 2, factor)
            x = want["x"].chunk(n)[rank]
            with torch.no_grad():
                _, chosen, _ = moe.route(want["layer"].router(x), 2)
            keep = moe.keep_mask(chosen, E, moe.capacity(len(x), 2, E, factor))
            if skew and keep.all():          # the case must test what it says it tests
                raise RuntimeError(f"grader: no row dropped on rank {rank} of {n} at "
                                   f"capacity factor {factor:g}; raise the skew")
            where = f"{name} on {n} ranks, rank {rank}"
            if not keep.all():
                where += (f" (capacity factor {factor:g}, {int((~keep).sum())} of "
                          f"{keep.numel()} choices dropped)")
            wants = [want["router"], want["w1"][rank * per:(rank + 1) * per],
                     want["w2"][rank * per:(rank + 1) * per], want["dx"].chunk(n)[rank]]
            for what, got, w in zip(_GRADS, r["grads"], wants):
                _assert_grad(where, what, got, w, chosen, keep)


_GRADS = {
    "router.weight.grad": "the router's gradient comes through the gates: weight each kept "
                          "row by its gate from moe.route without detaching it",
    "experts.w1.grad": "an expert's gradient needs every row it computed, from every rank: "
                       "send the results home with a differentiable all-to-all",
    "experts.w2.grad": "an expert's gradient needs every row it computed, from every rank: "
                       "send the results home with a differentiable all-to-all",
    "x.grad": "the gradient of x must flow back through the combine and the dispatch: use "
              "a differentiable all-to-all (all_to_all_single_autograd) both ways and build "
              "the padded buffer out of place (index_copy, index_put or new tensors, not "
              "writes into x)",
}


def _assert_grad(where, what, got, want, chosen, keep):
    if got is None:
        raise AssertionError(f"{where}: {what} is None after backward; {_GRADS[what]}")
    if torch.allclose(got.double(), want, **_TOL):
        return
    err = (got.double() - want).abs().max().item()
    text = f"{where}: {what} differs from the layer's on one process by up to {err:.3g}"
    if keep.all():
        raise AssertionError(f"{text}; {_GRADS[what]}")
    if what == "x.grad":                 # one row per token: name the first wrong one
        t = int(((got.double() - want).abs() > 1e-6).any(-1).nonzero()[0])
        text += (f"; token {t} (it chose experts {chosen[t].tolist()}, of which the layer "
                 f"keeps {keep[t].tolist()}) has gradient {_row(got[t])}, expected "
                 f"{_row(want[t])}")
    raise AssertionError(
        f"{text}. Right with nothing dropped, wrong with drops: a dropped choice adds "
        "nothing to y, so no gradient may flow back through it (to x, the router or an "
        "expert), and a kept choice gets its whole gradient, whether or not its token "
        "lost its other choice.")


def check_padded_traffic(fn, world_sizes=(2,), *, timeout=None):
    """Forward + backward send 4 all-to-alls of (N-1)/N x E x capacity rows per rank,
    with a skewed router at c_f = 1. Bytes only: the other checks judge the results."""
    name = name_of(fn)
    tokens, hidden = TRAFFIC["tokens"], TRAFFIC["hidden"]
    for n, ranks in _runs(fn, world_sizes, tokens, hidden, 2, 1.0, 3.0, True, timeout):
        cap = moe.capacity(tokens, 2, E, 1.0)
        padded = 4 * (n - 1) * E * cap * hidden * 8 // n
        for rank, r in enumerate(ranks):
            if not isinstance(r["y"], torch.Tensor) or r["y"].shape != (tokens, hidden):
                raise AssertionError(f"{name} on {n} ranks, rank {rank} returned "
                                     f"{_describe(r['y'])}; return y of shape "
                                     f"{(tokens, hidden)}, one row per token")
            _assert_wire(name, r["wire"], padded, rank, n, cap, tokens, hidden)


def _assert_wire(name, wire, padded, rank, n, cap, tokens, hidden):
    if abs(wire - padded) <= 0.05 * padded:
        return
    where = (f"{name} on {n} ranks, rank {rank}: forward and backward sent {wire:,} bytes; "
             f"the padded dispatch sends {padded:,}: 4 all-to-alls (dispatch and combine, "
             f"forward and backward) of (N-1)/N of E x capacity = {E} x {cap} rows of "
             f"{hidden} float64, whatever the routing.")
    if wire < padded:
        raise AssertionError(
            where + " Your results are right but you sent only the routed rows (variable "
            "split sizes, chapter 9's dispatch). Pad every expert to its capacity instead: "
            "one fixed shape for every all-to-all, known before routing, so no counts are "
            "exchanged and nothing waits for the host (and CUDA graphs can capture it).")
    raise AssertionError(
        where + f" That is {wire / padded:.1f}x too many: sending every token to every rank "
        f"(or gathering the batch) moves all {n} x {tokens} tokens. Send each rank only the "
        "capacity slots of its experts.")


def _describe(y) -> str:
    return f"a tensor of shape {tuple(y.shape)}" if isinstance(y, torch.Tensor) else repr(y)


def _row(t) -> str:
    return "[" + ", ".join(f"{v:.4g}" for v in t.tolist()[:4]) + (", ...]" if len(t) > 4 else "]")
