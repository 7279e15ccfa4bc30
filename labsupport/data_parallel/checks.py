"""Chapter 3's your-turn checks: rank 0's model broadcast, gradients split into buckets.

    from labsupport.data_parallel import checks
    checks.check_broadcast(broadcast_parameters)   # in chapter 3's check cells
    checks.check_buckets(bucket_params)

``check_broadcast`` runs the reader's function on 2 ranks whose models
differ (each built from its own seed, with a frozen layer, a tied weight and
a buffer) and names the first parameter or buffer that is not rank 0's.
``check_buckets`` compares the reader's buckets with ``ddp.bucket_params``
at seven bucket sizes and shows both in bytes. Until the function is
written, a check says so without failing (``your_turn``).
"""
import torch
import torch.distributed as dist

from labsupport import your_turn
from labsupport.checking import collective_checks
from labsupport.checking.diagnosis import name_of

_STUB = "is not written yet"          # how collective_checks.run reports a NotWritten rank



def _seeded_model(seed):
    """A model with a frozen layer, a tied weight and buffers, built from ``seed``."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 6), torch.nn.Linear(6, 6),
                                torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 10, bias=False))
    model[1].requires_grad_(False)  # frozen
    model[3].weight = model[0].weight  # tied
    with torch.no_grad():
        model[2].running_mean.add_(seed)  # a buffer that differs too
    return model


def _broadcast_on_rank(fn):
    model = _seeded_model(100 + dist.get_rank())
    fn(model)
    return {name: t.detach().clone() for name, t in
            [*model.named_parameters(), *model.named_buffers()]}


def broadcast(fn, world_size: int = 2):
    """``fn(module)`` copies rank 0's parameters (frozen, tied) and buffers to every rank."""
    try:
        got = collective_checks.run(_broadcast_on_rank, fn, world_size=world_size)
    except AssertionError as failure:
        if _STUB in str(failure):
            raise your_turn.NotWritten(name_of(fn)) from None
        raise
    want = dict([*_seeded_model(100).named_parameters(),
                 *_seeded_model(100).named_buffers()])
    for rank, c in enumerate(got):
        for name, tensor in c["value"].items():
            if not torch.equal(tensor, want[name]):
                kind = "buffer" if "running" in name or "batches" in name else "parameter"
                raise AssertionError(
                    f"{name_of(fn)}: on rank {rank} the {kind} {name!r} is not rank 0's "
                    "(each rank built its model from its own seed). Broadcast every "
                    "parameter, frozen ones too, and every buffer (module.buffers()), "
                    "from src=0, in place.")


def check_broadcast(fn, world_size: int = 2):
    """The check cell of ``broadcast_parameters``."""
    return your_turn.check(lambda: broadcast(fn, world_size), name_of(fn),
                           "parameters (frozen, tied) and buffers = rank 0's")


def buckets(fn):
    """``fn(params, bucket_size)`` splits params as
    ``labsupport.data_parallel.ddp.bucket_params`` does."""
    from labsupport.data_parallel import ddp
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 32),
                                torch.nn.Linear(32, 4))
    params = list(model.parameters())[::-1]  # the order backward produces them
    nbytes = [p.numel() * 4 for p in params]
    for size in (0, 200, 528, 656, 4096, 8192, 2**30):
        got, want = fn(params, size), ddp.bucket_params(params, size)
        if [id(p) for b in got for p in b] != [id(p) for p in params]:
            raise AssertionError(f"{name_of(fn)}(params, {size}): the buckets, one after the "
                                 "other, must hold every parameter once, in the order given "
                                 "(the order backward produces the gradients).")
        if [len(b) for b in got] != [len(b) for b in want]:
            show = [[p.numel() * 4 for p in b] for b in got]
            raise AssertionError(
                f"{name_of(fn)}(params, {size}) with parameters of {nbytes} bytes gave "
                f"buckets of {show} bytes; expected "
                f"{[[p.numel() * 4 for p in b] for b in want]}: a bucket takes parameters "
                f"until the next would push it past {size} bytes, and never stays empty.")


def check_buckets(fn):
    """The check cell of ``bucket_params``."""
    return your_turn.check(lambda: buckets(fn), name_of(fn),
                           "the same buckets as labsupport's, 7 sizes")
