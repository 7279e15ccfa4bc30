"""The checks of chapter 9 (expert parallelism): the gate-weighted combine and the
split sizes of the dispatch.

    expert_parallel.check_combine(combine)                           # in the kernel
    ls.run(expert_parallel.check_exchange, exchange_counts, world_size=2)

Each check says what is wrong with an answer: the case, what came back, what
was expected and the likely reason.
"""
import torch
import torch.distributed as dist

from labsupport.launch.identity import device


def check_combine(fn):
    """``fn(rows, token_index, gates, num_tokens)`` against a loop over the rows:
    6 rows for 5 tokens, token 4 with none (every choice dropped), float64."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 3, generator=g, dtype=torch.float64, requires_grad=True)
    token = torch.tensor([2, 0, 2, 3, 0, 1])
    gates = torch.tensor([0.7, 0.4, 0.3, 1.0, 0.6, 0.5], dtype=torch.float64)
    want = torch.zeros(5, 3, dtype=torch.float64)
    for i, t in enumerate(token.tolist()):
        want[t] += gates[i] * rows[i].detach()
    got = fn(rows, token, gates, 5)
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != (5, 3):
        raise AssertionError(f"y is {_shape(got)}: one row per token, (5, 3)")
    plain = torch.zeros(5, 3, dtype=torch.float64).index_add(0, token, rows.detach())
    if torch.allclose(got, plain):
        raise AssertionError("y adds the rows without their gates: weight row i by gates[i]")
    for t in range(5):
        mine = (token == t).nonzero().flatten().tolist()
        if not torch.allclose(got[t], want[t]):
            raise AssertionError(
                f"token {t}: got {got[t].tolist()}; expected the sum over rows {mine} "
                f"(token_index == {t}) of gate x row: {want[t].tolist()}")
    if not got.requires_grad:
        raise AssertionError("y must stay differentiable (no .detach(), no torch.no_grad)")
    got.sum().backward()
    if not torch.allclose(rows.grad, gates.unsqueeze(1).expand(6, 3)):
        raise AssertionError("d y / d rows must be each row's gate: y is not linear "
                             "in the rows with the gates as weights")


def check_exchange(fn, num_experts=8):
    """On every rank: ``fn(counts)`` with rank i sending 10·i + e rows to expert e."""
    rank, n = dist.get_rank(), dist.get_world_size()
    per = num_experts // n
    sent = [[10 * i + e for e in range(num_experts)] for i in range(n)]
    out = fn(torch.tensor(sent[rank], device=device()))
    if not (isinstance(out, tuple) and len(out) == 3):
        raise AssertionError("return (input_split_sizes, output_split_sizes, received)")
    splits_in, splits_out, received = out
    want_in = [sum(sent[rank][j * per:(j + 1) * per]) for j in range(n)]
    want_out = [sum(sent[i][rank * per:(rank + 1) * per]) for i in range(n)]
    if not (isinstance(splits_in, list) and isinstance(splits_out, list)):
        raise AssertionError("all_to_all_single takes split sizes as Python lists "
                             "(.tolist())")
    if splits_in != want_in:
        raise AssertionError(
            f"rank {rank}: input_split_sizes {splits_in}, expected {want_in}: entry j "
            f"= rows this rank SENDS to rank j (its experts j*{per}..j*{per}+{per - 1})"
            + ("; you gave the rows it receives" if splits_in == want_out else ""))
    if splits_out != want_out:
        raise AssertionError(f"rank {rank}: output_split_sizes {splits_out}, expected "
                             f"{want_out}: entry i = rows rank i sends to this rank's "
                             "experts")
    _check_received(received, [s[rank * per:(rank + 1) * per] for s in sent], rank)


def _check_received(received, want, rank):
    want = torch.tensor(want)
    if not isinstance(received, torch.Tensor) or tuple(received.shape) != tuple(want.shape):
        raise AssertionError(f"received is {_shape(received)}, expected (N, E/N) = "
                             f"{tuple(want.shape)}")
    if not torch.equal(received.cpu(), want):
        raise AssertionError(f"rank {rank}: received {received.tolist()}, expected "
                             f"{want.tolist()}: row i = what rank i sends to each "
                             "local expert")


def _shape(x):
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"
