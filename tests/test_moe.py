# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_moe.py
"""labsupport.expert_parallel.moe, the mixture of experts and expert parallelism chapter 9 teaches.

Unit: the router, the capacity and its dropping rule, the load-balancing
loss, the layer against a per-token loop, the shared decoder's MoE option
(off by default), the errors for bad input. Parity through the launcher at
world sizes 2 and 4: expert parallelism's outputs and the gradients of the
input, the router and every expert equal the layer on one process (float64;
k = 1 and 2; dropping on and off; a skewed router with an expert no token
chooses; the router's gradient non-zero in every case, k = 1 included), torch's
all_to_all_single_autograd gives the hand-written Function's results bit for bit, and
the forward's bytes on the wire are the formula's. And the notebook's copy of the code
is the package's, character for character.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import labsupport as ls
from labsupport import models, traffic
from labsupport.expert_parallel import moe
from labsupport.memory import calc as memory_calc
from nbtools import assert_lesson_copy

H, FFN, T = 8, 16, 10          # hidden, expert width, tokens per rank


def _case(num_experts, k, factor, groups, skew=0.0, starve=None):
    """A float64 layer, groups * T tokens and an output gradient, the same everywhere."""
    with models.seeded(0):
        layer = moe.MoE(H, FFN, num_experts, k, factor, groups).double()
    w = layer.router.weight.detach()
    if starve is not None:
        w[starve] = -10 * w[0]
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(2, groups * T, H, generator=g, dtype=torch.float64)
    for e in (0, 1):                                   # skew: towards experts 0 and 1
        x = x + skew * w[e] / w[e].dot(w[e])
    return layer, x, dy


def _loop(layer, x, groups=1):
    """The layer one token at a time, with its own count of each expert's rows."""
    num_experts, k = layer.router.out_features, layer.top_k
    y = torch.zeros_like(x)
    for group in torch.arange(len(x)).tensor_split(groups):
        cap = moe.capacity(len(group), k, num_experts, layer.capacity_factor)
        taken = [0] * num_experts
        for t in group.tolist():
            g, chosen = (x[t] @ layer.router.weight.t()).softmax(-1).topk(k)
            for gate, e in zip(g / g.sum() if k > 1 else g, chosen.tolist()):
                if cap is None or taken[e] < cap:
                    taken[e] += 1
                    y[t] += gate * moe.expert_mlp(x[t], layer.experts.w1[e], layer.experts.w2[e])
    return y


# -- one process -----------------------------------------------------------------

def test_route_keeps_the_k_largest_and_renormalises():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    probs, experts, gates = moe.route(logits, 2)
    assert experts.tolist() == [[1, 3]]
    torch.testing.assert_close(gates.sum(-1), torch.ones(1))
    torch.testing.assert_close(gates, probs[:, [1, 3]] / probs[:, [1, 3]].sum())


def test_a_single_choice_is_gated_by_its_probability_and_trains_the_router():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [2.0, 0.0, 0.5, 0.0]], requires_grad=True)
    probs, experts, gates = moe.route(logits, 1)
    assert experts.tolist() == [[1], [0]]
    torch.testing.assert_close(gates, probs.gather(1, experts))    # Switch, not 1
    grad, = torch.autograd.grad(gates.sum(), logits)
    assert grad.abs().min(dim=1).values.gt(0).all()                # every logit learns


def test_capacity_is_megatrons_and_the_first_choices_in_token_order_are_kept():
    assert moe.capacity(10, 2, 8, 1.0) == 3 and moe.capacity(10, 2, 8, None) is None
    experts = torch.tensor([[0, 1], [1, 0], [0, 2], [0, 1]])
    keep = moe.keep_mask(experts, 3, 2)
    assert keep.tolist() == [[True, True], [True, True], [False, True], [False, False]]


def test_the_load_balancing_loss_is_one_when_uniform_and_e_when_collapsed():
    probs = torch.full((8, 4), 0.25)
    spread = torch.arange(8).remainder(4).unsqueeze(1)
    assert moe.load_balancing_loss(probs, spread, 4).item() == pytest.approx(1.0)
    one = torch.zeros(8, 4).index_fill_(1, torch.tensor([0]), 1.0)
    assert moe.load_balancing_loss(one, torch.zeros(8, 1, dtype=torch.long), 4).item() == 4.0


@pytest.mark.parametrize("factor", [None, 1.0, 0.5])
@pytest.mark.parametrize("k", [1, 2])
def test_the_layer_equals_a_per_token_loop(k, factor):
    for groups in (1, 2):
        layer, x, _ = _case(8, k, factor, groups)
        torch.testing.assert_close(layer(x), _loop(layer, x, groups))
        assert layer.tokens_per_expert.sum() <= len(x) * k


def test_bad_configurations_are_refused_with_what_to_do():
    with pytest.raises(ValueError, match="each token picks 1 to 4 experts"):
        moe.MoE(H, FFN, 4, top_k=5)
    with pytest.raises(ValueError, match="positive factor, or None"):
        moe.MoE(H, FFN, 4, capacity_factor=0)
    with pytest.raises(ValueError, match="6 experts over 4 ranks"):
        moe.check_config(6, 2, None, world_size=4)
    with pytest.raises(ValueError, match="moe_experts=-1"):
        models.GPTConfig(moe_experts=-1)


def test_grouped_mm_is_not_taken_on_cpu():
    assert not moe.grouped_mm_runs(torch.ones(1, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_path_equals_the_loop_where_torch_runs_grouped_mm_on_cpu(dtype):
    # torch 2.13 runs grouped_mm on CPU too: the GPU path's offsets and
    # transposes are checked here, with an expert that gets no row (not the
    # CUDA kernel)
    experts = moe.Experts(4, H, FFN).to(dtype)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, H, dtype=dtype, requires_grad=True)
    got, want = ([y, *torch.autograd.grad(y.float().square().sum(),
                                          [x, experts.w1, experts.w2])]
                 for y in (experts.grouped(x, counts), experts.looped(x, counts)))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_the_decoder_is_dense_by_default_and_adds_the_aux_loss_with_experts():
    base = dict(vocab_size=32, seq_len=8, hidden=H, heads=2, layers=2)
    dense = models.GPT(models.GPTConfig(**base), seed=0)
    assert all(isinstance(b.mlp, models.MLP) for b in dense.blocks)
    cfg = models.GPTConfig(**base, moe_experts=4, moe_every=2, moe_aux_coef=0.5)
    gpt = models.GPT(cfg, seed=0, moe=moe.MoE)
    assert [type(b.mlp).__name__ for b in gpt.blocks] == ["MLP", "MoE"]
    with pytest.raises(ValueError, match="needs the mixture-of-experts class"):
        models.GPT(cfg, seed=0)          # models.py does not import chapter 9
    ids, targets = models.toy_tokens(2, 8, 32, seed=3)
    loss = gpt(ids, targets)
    ce = F.cross_entropy(gpt(ids).flatten(0, 1), targets.flatten())
    torch.testing.assert_close(loss, ce + 0.5 * gpt.blocks[1].mlp.aux_loss)
    # off by default: the dense decoder chapter 0's calculator counts
    assert sum(p.numel() for p in dense.parameters()) == memory_calc.gpt_params(2, H, 32, 8)


# -- expert parallelism on the ranks ---------------------------------------------------

@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world_size={n}")
def cluster(request):
    c = ls.start(world_size=request.param, backend="gloo")
    yield c
    c.shutdown()


CASES = [(8, k, c) for k in (1, 2) for c in (None, 1.0)] + [(4, 2, 1.0), (8, 1, 1.0, 3.0, 5)]


def _torch_a2a(x, output_splits, input_splits, group=None):
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    return all_to_all_single_autograd(x, output_splits, input_splits, group or dist.group.WORLD)


def _distributed(cases, functional):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for num_experts, k, factor, *lean in cases:
        layer, x, dy = _case(num_experts, k, factor, n, *lean)
        ep = moe.ExpertParallelMoE(layer, all_to_all=_torch_a2a if functional
                                   else moe.AllToAll.apply)
        mine = x.chunk(n)[rank].clone().requires_grad_()
        y = ep(mine)
        y.backward(dy.chunk(n)[rank])
        dist.all_reduce(ep.router.weight.grad)
        out.append([y.detach(), mine.grad, ep.router.weight.grad, ep.experts.w1.grad,
                    ep.experts.w2.grad, ep.tokens_per_expert])
    return out


def test_expert_parallel_equals_one_process(cluster):
    n = cluster.world_size
    results = cluster.run(_distributed, CASES, False)
    for i, (num_experts, k, factor, *lean) in enumerate(CASES):
        layer, x, dy = _case(num_experts, k, factor, n, *lean)
        x.requires_grad_()
        y = layer(x)
        y.backward(dy)
        want = [y.detach(), x.grad, None, layer.experts.w1.grad, layer.experts.w2.grad,
                layer.tokens_per_expert]
        router = layer.router.weight.grad
        assert router.abs().max() > 1e-3, f"{CASES[i]}: no router gradient"
        for j, name in enumerate(["y", "dx", "router", "w1", "w2", "rows"]):
            got = results[0][i][2] if name == "router" else torch.cat([r[i][j] for r in results])
            torch.testing.assert_close(got, layer.router.weight.grad if name == "router"
                                       else want[j], msg=f"{CASES[i]}: {name}")
    starved = layer.tokens_per_expert                      # the last case
    assert starved[5] == 0 and starved.sum() < n * T       # no row for 5, rows dropped


def test_torchs_all_to_all_gives_the_same_bits(cluster):
    mine = cluster.run(_distributed, CASES[1:3], False)
    theirs = cluster.run(_distributed, CASES[1:3], True)
    for a, b in zip(mine, theirs):
        for case_a, case_b in zip(a, b):
            assert all(torch.equal(u, v) for u, v in zip(case_a, case_b))


def _wire(tokens, hidden, num_experts=8, k=2):
    rank, n = dist.get_rank(), dist.get_world_size()
    with models.seeded(0):
        layer = moe.MoE(hidden, 2 * hidden, num_experts, k)
    x = torch.randn(n * tokens, hidden, generator=torch.Generator().manual_seed(3)).chunk(n)[rank]
    ep = moe.ExpertParallelMoE(layer)
    dist.barrier()
    with traffic.count() as counted:
        ep(x)
    _, experts, _ = moe.route(layer.router(x), k)
    to_rank = experts.flatten() // (num_experts // n)
    return counted.wire_sent, torch.bincount(to_rank, minlength=n).tolist()


def test_forward_bytes_on_the_wire_are_the_formulas(cluster):
    n, hidden = cluster.world_size, 64
    out = cluster.run(_wire, 128, hidden)
    rows = [m for _, m in out]                               # rows[i][j]: rank i -> j
    for r, (wire, _) in enumerate(out):
        off = sum(rows[r]) - rows[r][r] + sum(m[r] for m in rows) - rows[r][r]
        formula = off * hidden * 4 + (n - 1) * (8 // n) * 8
        assert abs(wire / formula - 1) < 0.02, (r, wire, formula)


def test_experts_must_split_evenly(cluster):
    def build():
        return moe.ExpertParallelMoE(moe.MoE(H, FFN, 6, 2))
    if cluster.world_size == 4:
        with pytest.raises(ls.RankError, match="6 experts over 4 ranks"):
            cluster.run(build)


# -- the notebook's copy of the lesson is the package's ---------------------------

def test_the_notebook_shows_every_definition_of_the_package_character_for_character():
    assert_lesson_copy(moe)
