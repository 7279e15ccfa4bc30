"""The checks of chapter 9 (expert parallelism): the rank-major to expert-major
reorder after the dispatch, and aux-loss-free load balancing (DeepSeek-V3).

    expert_parallel.check_expert_major_order(expert_major_order)    # in the kernel
    expert_parallel.check_balanced_routing(route_balanced, update_bias)

Each check says what is wrong with an answer: the case, what came back, what
was expected and the likely reason. Both run in the kernel: the reorder is
index arithmetic on one rank's received counts, the routing a rule each rank
applies to its own tokens.
"""
import torch

# (N, E/N) received counts: row i = rows from rank i for each local expert
ORDER_CASES = [
    [[2, 1], [0, 3], [1, 1]],          # the chapter's: 3 ranks, 2 local experts
    [[0, 2, 1], [3, 0, 0]],            # a source with nothing for an expert
    [[1, 0], [0, 0], [2, 2], [0, 1]],  # a source with nothing at all
    [[0, 0], [0, 0]],                  # no rows at all
]


def expert_major_reference(received):
    """The order by a loop: for each local expert, each source's rows in turn."""
    starts, at = {}, 0
    for i, row in enumerate(received):
        for e, n in enumerate(row):
            starts[i, e], at = at, at + n
    return [starts[i, e] + j for e in range(len(received[0]))
            for i in range(len(received)) for j in range(received[i][e])]


def check_expert_major_order(fn):
    """``fn(received)`` on ORDER_CASES against the loop; the rows it lists,
    labelled by source rank and expert, in every message."""
    for case in ORDER_CASES:
        received = torch.tensor(case)
        want = expert_major_reference(case)
        labels = [f"r{i}e{e}" for i, row in enumerate(case) for e, n in enumerate(row)
                  for _ in range(n)]
        got = fn(received.clone())
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"received {case}: returned a {type(got).__name__}; "
                                 "return a tensor of row indices")
        if got.dtype not in (torch.int64, torch.int32):
            raise AssertionError(f"received {case}: indices of dtype {got.dtype}; rows "
                                 "are indexed by integers (torch.long)")
        got = got.tolist()
        if len(got) != len(want):
            raise AssertionError(
                f"received {case}: {len(got)} indices for {len(want)} rows; one index "
                "per received row (the sum of the counts)")
        if sorted(got) != list(range(len(want))):
            raise AssertionError(f"received {case}: {got} is not an ordering of the "
                                 f"rows 0..{len(want) - 1}: each row exactly once")
        if got == want:
            continue
        shown = " ".join(labels[i] for i in got)
        expected = " ".join(labels[i] for i in want)
        text = (f"received {case} (rank-major: {' '.join(labels)}): your order "
                f"lists {shown}; expected {expected} (indices {want})")
        inverse = [0] * len(want)
        for position, i in enumerate(want):
            inverse[i] = position
        if got == inverse:
            text += (". You returned the inverse: where each rank-major row goes. "
                     "order[j] must be the rank-major index of the j-th row the "
                     "experts take, so that rows[order] is expert-major")
        elif [labels[i] for i in got] == [labels[i] for i in want]:
            text += (". The labels agree but the rows do not: within one (source, "
                     "expert) block keep the rows in the order they arrived")
        elif sorted(got, key=lambda i: labels[i][2:]) == got:
            text += (". The experts are in order but their rows are not source by "
                     "source: expert e takes rank 0's rows for it, then rank 1's, ...")
        raise AssertionError(text)


def _route_reference(logits, top_k, bias):
    probs = logits.softmax(dim=-1)
    experts = (probs + bias).topk(top_k, dim=-1).indices
    gates = probs.gather(1, experts)
    if top_k > 1:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return probs, experts, gates


def check_balanced_routing(route_balanced, update_bias):
    """``route_balanced(logits, top_k, bias)``: experts chosen by probability +
    bias, gated by the probability alone (as ``moe.route``: renormalised over
    the k for k > 1, the probability itself for k = 1), differentiable;
    ``update_bias(bias, tokens_per_expert, speed)``: DeepSeek-V3's rule,
    bias - speed for an expert above the mean load, + speed below it."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4, generator=g, dtype=torch.float64)
    bias = torch.tensor([0.0, 0.5, 0.0, -0.5], dtype=torch.float64)
    for k in (1, 2):
        leaf = logits.clone().requires_grad_()
        out = route_balanced(leaf, k, bias)
        if not (isinstance(out, tuple) and len(out) == 3):
            raise AssertionError("return (probs, experts, gates), as moe.route does")
        probs, experts, gates = out
        want = _route_reference(logits, k, bias)
        plain = _route_reference(logits, k, torch.zeros_like(bias))
        where = f"k = {k}, bias {bias.tolist()}"
        if not torch.allclose(probs, want[0]):
            raise AssertionError(f"{where}: probs must be the softmax of the logits, "
                                 "without the bias (the balancing loss reads them)")
        if not torch.equal(experts, want[1]):
            hint = (" You chose by the probabilities alone: the bias decides the choice"
                    if torch.equal(experts, plain[1]) else "")
            raise AssertionError(f"{where}: chose experts {experts.tolist()}, "
                                 f"expected the top {k} of probs + bias, "
                                 f"{want[1].tolist()}.{hint}")
        biased_gates = (probs + bias).detach().gather(1, want[1])
        if k > 1:
            biased_gates = biased_gates / biased_gates.sum(-1, keepdim=True)
        if torch.allclose(gates, biased_gates) and not torch.allclose(gates, want[2]):
            raise AssertionError(f"{where}: the gates include the bias; it only "
                                 "chooses the experts, the gates are the "
                                 "probabilities")
        if k == 1 and torch.allclose(gates, torch.ones_like(gates)):
            raise AssertionError(f"{where}: every gate is 1: with one expert the "
                                 "gate is its probability, not renormalised (that "
                                 "1 has no gradient for the router)")
        if not torch.allclose(gates, want[2]):
            raise AssertionError(f"{where}: gates {gates.tolist()}, expected "
                                 f"{want[2].tolist()}: the chosen experts' "
                                 "probabilities"
                                 + (", renormalised over the k" if k > 1 else ""))
        if not gates.requires_grad:
            raise AssertionError(f"{where}: the gates carry no gradient (detached?): "
                                 "the router learns through them")
        grad, = torch.autograd.grad(gates.sum() if k == 1 else gates[:, 0].sum(), leaf)
        if grad.abs().max() == 0:
            raise AssertionError(f"{where}: the gates' gradient to the logits is zero")
    _check_update_bias(update_bias)


def _check_update_bias(update_bias):
    bias = torch.tensor([0.1, 0.0, -0.2, 0.0])
    load = torch.tensor([50, 32, 14, 32])                  # mean 32
    speed = 0.01
    want = torch.tensor([0.09, 0.0, -0.19, 0.0])
    got = update_bias(bias.clone(), load.clone(), speed)
    where = f"bias {bias.tolist()}, tokens per expert {load.tolist()}, speed {speed}"
    if not isinstance(got, torch.Tensor) or got.shape != bias.shape:
        raise AssertionError(f"{where}: return the new bias, a tensor of shape (E,)")
    if torch.allclose(got, bias - (want - bias)):
        raise AssertionError(f"{where}: got {got.tolist()}: the sign is reversed; an "
                             "expert above the mean load must become less attractive "
                             "(its bias goes down)")
    proportional = bias + speed * (load.float().mean() - load) / load.float().mean()
    if torch.allclose(got, proportional) or not torch.allclose(got, want, atol=1e-7):
        raise AssertionError(f"{where}: got {got.tolist()}, expected {want.tolist()}: "
                             "DeepSeek-V3 moves each bias by the fixed speed, down "
                             "above the mean load, up below it, not at all at the "
                             "mean (speed x sign(mean - load))")
