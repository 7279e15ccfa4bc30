"""Chapter 7's your-turn checks: ZeRO-2 by whole tensors, FSDP2's rows of a parameter.

    from labsupport.zero import checks
    checks.owners(params, world_size)            # ZeroRedundancyOptimizer's layout
    checks.check_zero2_by_tensor(zero2_by_tensor)
    checks.check_fsdp2_rows(fsdp2_rows)

Each check runs the reader's function on 4 ranks and says which part is
wrong: for ``zero2_by_tensor`` the collectives called, each gradient after
it (the owner's mean, the others' dropped) and each parameter after the
step (AdamW in one process, fp64); for ``fsdp2_rows`` the rows against
those ``fully_shard`` really gives each rank. Until the function is
written, the check says so without failing (``your_turn``).
"""
import torch
import torch.distributed as dist
from torch import nn

from labsupport import calls, models, your_turn
from labsupport.launch.identity import device
from labsupport.launch.session import run

WORLD_SIZE = 4
STEPS, BATCH = 2, 8
ADAMW = dict(lr=1e-2, weight_decay=0.1)
GPT = models.GPTConfig(vocab_size=37, seq_len=8, hidden=15, heads=3, layers=2)
DIM0S = [1, 3, 4, 5, 9, 13, 16]   # rows of the parameters fully_shard cuts


def owners(params, world_size) -> list:
    """The rank owning each parameter, as ZeroRedundancyOptimizer partitions
    them: the largest first, each to the rank with the fewest elements so far
    (torch/distributed/optim/zero_redundancy_optimizer.py, _partition_parameters)."""
    params = list(params)
    load, out = [0] * world_size, [None] * len(params)
    for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        out[i] = min(range(world_size), key=load.__getitem__)
        load[out[i]] += params[i].numel()
    return out


# -- ZeRO-2 by whole tensors ----------------------------------------------------------

def check_zero2_by_tensor(fn, world_size=WORLD_SIZE):
    """``fn(params, owners, optimizer)`` after backward: reduce to owners, step, broadcast."""
    return your_turn.check(
        lambda: run(_by_tensor_on_rank, fn, world_size=world_size), "zero2_by_tensor",
        f"{STEPS} steps = AdamW in one process; one reduce and one broadcast per "
        "tensor; gradients only at their owners")


def _batch(step):
    ids, targets = models.toy_tokens(STEPS * BATCH, GPT.seq_len, GPT.vocab_size, seed=1)
    return ids[step * BATCH:(step + 1) * BATCH], targets[step * BATCH:(step + 1) * BATCH]


def _by_tensor_on_rank(fn):
    rank, n = dist.get_rank(), dist.get_world_size()
    model, ref = (models.GPT(GPT, seed=0).double().to(device()) for _ in range(2))
    names = [name for name, _ in model.named_parameters()]
    params, own = list(model.parameters()), owners(model.parameters(), n)
    optimizer = torch.optim.AdamW([p for p, o in zip(params, own) if o == rank], **ADAMW)
    ref_optimizer = torch.optim.AdamW(ref.parameters(), **ADAMW)
    for step in range(STEPS):
        ids, targets = (t.to(device()) for t in _batch(step))
        model(models.shard(ids, rank, n), models.shard(targets, rank, n)).backward()
        ref(ids, targets).backward()
        means = [p.grad.clone() for p in ref.parameters()]
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        with calls.record() as log:
            fn(params, own, optimizer)
        where = f"rank {rank}, step {step}"
        _check_calls(log.count(), len(params), where)
        _check_grads(params, own, means, names, rank, where)
        _check_params(model, ref, where)
        optimizer.zero_grad()


def _check_calls(count, n_params, where):
    others = {op: k for op, k in count.items() if op not in ("reduce", "broadcast")}
    assert not others, (
        f"{where}: called {others}: ZeRO-2 by tensor needs only dist.reduce (each gradient "
        "to its owner, dst=owners[i]) and dist.broadcast (each updated parameter from its "
        "owner, src=owners[i]); an all-reduce would leave every gradient on every rank")
    for op, what in (("reduce", "gradient to its owner"),
                     ("broadcast", "updated parameter from its owner")):
        assert count.get(op, 0) == n_params, (
            f"{where}: {count.get(op, 0)} calls of dist.{op} for {n_params} parameters: "
            f"one per parameter, each {what}")


def _check_grads(params, own, means, names, rank, where):
    for i, (p, owner, mean) in enumerate(zip(params, own, means)):
        what = f"{where}: parameter {i} ({names[i]}, owned by rank {owner})"
        if owner != rank:
            assert p.grad is None, (
                f"{what} still has a gradient after your function: ZeRO-2 keeps only "
                "the owner's; set p.grad = None on the other ranks once it is reduced")
            continue
        assert p.grad is not None, f"{what} has no gradient: its owner steps it with the mean"
        err = (p.grad - mean).abs().max().item()
        ratio = (p.grad.norm() / mean.norm()).item() if mean.norm() > 0 else float("nan")
        assert err <= 1e-9 * (1 + mean.abs().max().item()), (
            f"{what}: its gradient is not the mean over the ranks (max error {err:.3g}, "
            f"norm ratio {ratio:.3g}): reduce it to its owner (dst=owners[i]), the sum, "
            "and divide by world_size")


def _check_params(model, ref, where):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = (p.detach() - q.detach()).abs().max().item()
        assert err <= 1e-9, (
            f"{where}: {name} differs from AdamW in one process by {err:.3g} after the step: "
            "only its owner stepped it; every rank needs the update, broadcast from the "
            "owner (src=owners[i]) after optimizer.step()")


# -- FSDP2's rows ---------------------------------------------------------------------

def check_fsdp2_rows(fn, world_size=WORLD_SIZE):
    """``fn(dim0, rank, world_size)`` -> (start, end): the rows fully_shard gives ``rank``."""
    return your_turn.check(
        lambda: run(_rows_on_rank, fn, world_size=world_size), "fsdp2_rows",
        f"the rows fully_shard gives each rank, for {len(DIM0S)} sizes of dimension 0")


def _rows_on_rank(fn):
    from torch.distributed.fsdp import fully_shard
    rank, n = dist.get_rank(), dist.get_world_size()
    for dim0 in DIM0S:
        layer = nn.Linear(3, dim0, bias=False, device=device())
        with torch.no_grad():              # row i holds 3i, 3i+1, 3i+2
            layer.weight.copy_(torch.arange(dim0 * 3.0).view(dim0, 3))
        fully_shard(layer)
        rows = (layer.weight.to_local()[:, 0] / 3).long().tolist()
        held = f"rows [{rows[0]}, {rows[-1] + 1})" if rows else "no row"
        got = fn(dim0, rank, n)
        call = f"rank {rank} of {n}: fsdp2_rows({dim0}, {rank}, {n}) returned {got!r}"
        assert isinstance(got, tuple) and len(got) == 2 and all(
            isinstance(x, int) for x in got), f"{call}: return a pair of ints (start, end)"
        start, end = got
        right = end - start == len(rows) and (start == rows[0] if rows else start == end)
        chunk = -(-dim0 // n)
        assert right, (
            f"{call}, but fully_shard holds {held} of the {dim0} there: FSDP2 cuts "
            f"dimension 0 as torch.chunk does, into pieces of ceil({dim0}/{n}) = {chunk} "
            "rows in rank order, so the last ranks get fewer rows or none")
