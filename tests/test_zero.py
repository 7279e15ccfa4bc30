"""labsupport.zero.zero, chapter 7's ZeRO stages: parity through the launcher, errors,
notebook copy.

Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_zero.py

After STEPS AdamW steps on N = 2 and 4 ranks, every parameter equals
single-process AdamW on the full batch (fp64, tight), for several models: the
shared GPT with its tied embedding / LM head and a parameter count that N
does not divide, the GPT untied, and the DeepMLP of chapters 3 and 5; ZeRO-3
with and without prefetch. In fp32 at N = 2, ZeRO-3 equals one process bit for
bit that adds the two micro-batches' gradients. Used as a user would:
ShardedOptimizer takes frozen parameters (= AdamW, = ZeroRedundancyOptimizer),
Zero3 gives its shards as parameters(), each module parameter's piece of the
gradient after backward, a clip_grad_norm_ over all ranks, and a bf16 compute
dtype equal to FSDP2's MixedPrecisionPolicy bit for bit at N = 2, holding half
the bytes gathered; prefetch holds one more unit. The ShardedOptimizer also
equals PyTorch's ZeroRedundancyOptimizer, keeps param groups and
add_param_group, and refuses what it cannot do; Zero3 refuses overlapping
units. The notebook's lesson code is the package's. The sweep of chapter 7's
time beside bytes runs small.
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import labsupport as ls
from labsupport import models
from labsupport.memory import tally
from labsupport.zero import sharded_optimizer, zero
from nbtools import assert_lesson_copy

STEPS, BATCH = 3, 8
ADAMW = dict(lr=1e-2, weight_decay=0.1)
TOL = dict(rtol=1e-9, atol=1e-9)  # fp64; Adam magnifies rounding where a gradient is ~0
GPT_ODD = models.GPTConfig(vocab_size=37, seq_len=8, hidden=15, heads=3, layers=2)  # Ψ odd
GPT_UNTIED = models.GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=4, layers=3,
                              tie_weights=False)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def make(name):
    if name == "mlp":
        return models.DeepMLP(d_in=8, width=13, depth=3, d_out=4, seed=0).double()
    return models.GPT(GPT_ODD if name == "gpt_tied" else GPT_UNTIED, seed=0).double()


def units(name, model):
    linears = [m for m in model if isinstance(m, torch.nn.Linear)] if name == "mlp" else []
    return linears[:-1] if name == "mlp" else list(model.blocks)  # the head in the root


def batch(name, step):
    if name == "mlp":
        x, y = models.toy_regression(STEPS * BATCH, 8, 4, seed=1)
        x = x.double()
        y = y.double()
    else:
        cfg = GPT_ODD if name == "gpt_tied" else GPT_UNTIED
        x, y = models.toy_tokens(STEPS * BATCH, cfg.seq_len, cfg.vocab_size, seed=1)
    return x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH]


def loss(name, model, x, y):
    return F.mse_loss(model(x), y) if name == "mlp" else model(x, y)


def my_batch(name, step):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return [models.shard(t, rank, world_size) for t in batch(name, step)]


def reference(name):
    model = make(name)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    for step in range(STEPS):
        loss(name, model, *batch(name, step)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def train(name, version):
    model = make(name)
    if version.startswith("zero3"):
        wrapped = zero.Zero3(model, units(name, model), prefetch=version == "zero3")
        optimizer = torch.optim.AdamW(wrapped.parameters(), **ADAMW)
    elif version == "zero1_2":  # the lesson's functions, stage 1 then stage 2 steps
        flat = zero.FlatParams(model.parameters())
        optimizer = torch.optim.AdamW([flat.shard(flat.data)], **ADAMW)
    else:
        optimizer = sharded_optimizer.ShardedOptimizer(model.parameters(), torch.optim.AdamW,
                                                       **ADAMW)
    for step in range(STEPS):
        if version == "zero1_2":
            flat.alloc_grads()
        loss(name, wrapped if version.startswith("zero3") else model,
             *my_batch(name, step)).backward()          # Zero3: reduced when it returns
        if version == "zero1_2":
            zero.zero_step(flat, optimizer, stage=1 + step % 2)
        else:
            optimizer.step()
            optimizer.zero_grad()
    if version.startswith("zero3"):
        return wrapped.full_parameters()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world_size={n}")
def cluster(request):
    c = ls.start(world_size=request.param, backend="gloo")
    yield c
    c.shutdown()


@pytest.mark.parametrize("name", ["gpt_tied", "gpt_untied", "mlp"])
@pytest.mark.parametrize("version", ["sharded_optimizer", "zero1_2", "zero3",
                                     "zero3_no_prefetch"])
def test_every_rank_equals_single_process_adamw(cluster, name, version):
    want = reference(name)
    for got in cluster.run(train, name, version):
        assert list(got) == list(want)
        torch.testing.assert_close(got, want, **TOL)


def test_the_models_exercise_padding_and_the_tied_weight():
    gpt = make("gpt_tied")
    psi = sum(p.numel() for p in gpt.parameters())
    assert gpt.lm_head.weight is gpt.tok.weight and psi % 4 and psi % 2
    assert sum(p.numel() for p in make("mlp").parameters()) % 4


def _against_zero_redundancy_optimizer():
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    ours, theirs = make("gpt_tied"), DistributedDataParallel(make("gpt_tied"))
    opt_ours = sharded_optimizer.ShardedOptimizer(ours.parameters(), torch.optim.AdamW, **ADAMW)
    opt_theirs = ZeroRedundancyOptimizer(theirs.parameters(), torch.optim.AdamW, **ADAMW)
    for step in range(STEPS):
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            model(*my_batch("gpt_tied", step)).backward()
            opt.step()
            opt.zero_grad()
    return [p.detach() for p in ours.parameters()], [p.detach() for p in theirs.parameters()]


def test_sharded_optimizer_equals_zero_redundancy_optimizer(cluster):
    for ours, theirs in cluster.run(_against_zero_redundancy_optimizer):
        torch.testing.assert_close(ours, theirs, **TOL)


def _groups_and_memory():
    n = dist.get_world_size()
    model = make("gpt_untied")
    blocks = list(model.blocks.parameters())
    rest = [p for p in model.parameters() if all(p is not b for b in blocks)]
    opt = sharded_optimizer.ShardedOptimizer([{"params": rest}], torch.optim.AdamW, lr=1e-2)
    opt.add_param_group({"params": blocks, "lr": 1e-3})
    opt.param_groups[1]["lr"] = 2e-3           # as a scheduler would
    ref_model = make("gpt_untied")
    ref_blocks = list(ref_model.blocks.parameters())
    ref_rest = [p for p in ref_model.parameters() if all(p is not b for b in ref_blocks)]
    ref = torch.optim.AdamW([{"params": ref_rest}, {"params": ref_blocks, "lr": 2e-3}],
                            lr=1e-2)
    for step in range(STEPS):
        model(*my_batch("gpt_untied", step)).backward()
        opt.step()
        opt.zero_grad()
        ref_model(*batch("gpt_untied", step)).backward()
        ref.step()
        ref.zero_grad()
    shard_numel = sum(f.shard_numel for f in opt.flats)
    state = tally.storage_bytes(v for s in opt.state.values() for v in s.values())
    return ([p.detach() for p in model.parameters()], [p.detach() for p in ref_model.parameters()],
            state, shard_numel, n, opt.param_groups[1]["lr"], len(opt.param_groups))


def test_param_groups_add_param_group_and_a_sharded_state(cluster):
    for got, want, state, shard_numel, _, lr, groups in cluster.run(_groups_and_memory):
        torch.testing.assert_close(got, want, **TOL)
        assert (lr, groups) == (2e-3, 2)
        assert state == 2 * 8 * shard_numel + 2 * 4  # fp64 m, v of each shard; fp32 steps


def _errors():
    model = make("gpt_tied")
    found = {}
    cases = {
        "optimizer_cls": lambda: sharded_optimizer.ShardedOptimizer(model.parameters(), "adam"),
        "frozen": lambda: (lambda m: (m.pos.weight.requires_grad_(False),
                                      zero.Zero3(m, list(m.blocks))))(make("gpt_tied")),
        "empty": lambda: sharded_optimizer.ShardedOptimizer([], torch.optim.AdamW),
        "mixed dtypes": lambda: zero.FlatParams([torch.zeros(2, requires_grad=True),
                                                 torch.zeros(2, dtype=torch.float64,
                                                             requires_grad=True)]),
        "two groups": lambda: sharded_optimizer.ShardedOptimizer(
            [{"params": [model.pos.weight]}, {"params": [model.pos.weight]}],
            torch.optim.AdamW),
        "overlapping units": lambda: zero.Zero3(make("gpt_tied"),
                                                [make("gpt_tied").blocks[0]]),
        "nested units": lambda: (lambda m: zero.Zero3(m, [m.blocks[0], m.blocks[0].attn]))(
            make("gpt_tied")),
        "no root": lambda: (lambda m: zero.Zero3(
            m, [x for x in m if isinstance(x, torch.nn.Linear)]))(
            make("mlp")),
        "unit without parameters": lambda: (lambda m: zero.Zero3(m, [m[1]]))(make("mlp")),
    }
    for name, case in cases.items():
        try:
            case()
            found[name] = "no error"
        except (ValueError, NotImplementedError) as err:
            found[name] = str(err)
    opt = sharded_optimizer.ShardedOptimizer(model.parameters(), torch.optim.AdamW)
    for name, case in {"closure": lambda: opt.step(lambda: 0.0),
                       "no grad": opt.step, "state_dict": opt.state_dict}.items():
        try:
            case()
            found[name] = "no error"
        except (ValueError, NotImplementedError) as err:
            found[name] = str(err)
    return found


def test_what_is_not_supported_fails_with_a_clear_message(cluster):
    found = cluster.run(_errors)[0]
    expected = {"optimizer_cls": "torch.optim.Optimizer class", "frozen": "is frozen",
                "empty": "no parameters", "mixed dtypes": "one flat buffer holds one dtype",
                "two groups": "in two parameter groups", "overlapping units": "submodule",
                "nested units": "in two units", "no root": "leave one module",
                "unit without parameters": "has no parameters",
                "closure": "takes no closure", "no grad": "has no gradient",
                "state_dict": "consolidate_state_dict"}
    for name, text in expected.items():
        assert text in found[name], (name, found[name])


def test_flat_params_needs_a_process_group():
    with pytest.raises(ValueError, match="process group"):
        zero.FlatParams(make("mlp").parameters())


# -- the notebook's copy of the lesson is the package's ---------------------------

def test_the_notebook_copy_is_the_package_code():
    assert_lesson_copy(zero)


# -- used as a user would ---------------------------------------------------------------

def _frozen_loop(kind):
    """An ordinary loop on the untied GPT with pos.weight and block 0's ln1 frozen."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    model = make("gpt_untied")
    for p in [model.pos.weight, *model.blocks[0].ln1.parameters()]:
        p.requires_grad_(False)
    if kind == "ours":
        opt = sharded_optimizer.ShardedOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
    else:
        model = DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
    for step in range(STEPS):
        loss("gpt_untied", model, *my_batch("gpt_untied", step)).backward()
        opt.step()
        opt.zero_grad()
    module = getattr(model, "module", model)
    if kind == "ours":   # unfreezing later is refused with a clear message
        module.pos.weight.requires_grad_(True)
        module(*my_batch("gpt_untied", 0)).backward()
        with pytest.raises(ValueError, match="was frozen when its group was added"):
            opt.step()
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def test_sharded_optimizer_takes_frozen_parameters_like_torch_and_zero_redundancy(cluster):
    ref = make("gpt_untied")
    for p in [ref.pos.weight, *ref.blocks[0].ln1.parameters()]:
        p.requires_grad_(False)
    opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    for step in range(STEPS):
        loss("gpt_untied", ref, *batch("gpt_untied", step)).backward()
        opt.step()
        opt.zero_grad()
    want = {n: p.detach() for n, p in ref.named_parameters()}
    for ours, theirs in zip(cluster.run(_frozen_loop, "ours"),
                            cluster.run(_frozen_loop, "zero_redundancy")):
        torch.testing.assert_close(ours, want, **TOL)
        torch.testing.assert_close(ours, theirs, **TOL)
        assert torch.equal(ours["pos.weight"], make("gpt_untied").pos.weight)


def _zero3_loop(clip):
    """backward (no sync call), read each parameter's piece, clip over all ranks, step."""
    model = make("gpt_tied")
    wrapped = zero.Zero3(model, units("gpt_tied", model))
    assert [p for p in wrapped.parameters()] == list(wrapped.shards)
    opt = torch.optim.AdamW(wrapped.parameters(), **ADAMW)
    pieces = []
    for step in range(STEPS):
        loss("gpt_tied", wrapped, *my_batch("gpt_tied", step)).backward()
        pieces = [(p.shape, p.grad.shape, p.grad.data_ptr() == 0 or any(
            p.grad.untyped_storage().data_ptr() == s.grad.untyped_storage().data_ptr()
            for s in wrapped.shards)) for p in model.parameters()]
        norm = wrapped.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
    return wrapped.full_parameters(), norm, pieces


def test_zero3_in_an_ordinary_loop_reads_pieces_and_clips_over_all_ranks(cluster):
    model, clip = make("gpt_tied"), 0.5
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    for step in range(STEPS):
        loss("gpt_tied", model, *batch("gpt_tied", step)).backward()
        want_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    assert want_norm > clip
    want = {n: p.detach() for n, p in model.named_parameters()}
    out = cluster.run(_zero3_loop, clip)
    for params, norm, pieces in out:
        torch.testing.assert_close(params, want, **TOL)
        torch.testing.assert_close(norm, want_norm, **TOL)
        assert all(shape == grad and len(shape) == 1 and inside for shape, grad, inside in pieces)
    # every parameter's pieces over the ranks add up to it
    sizes = [p.numel() for p in make("gpt_tied").parameters()]
    assert [sum(o[2][i][0][0] for o in out) for i in range(len(sizes))] == sizes


def _micro_batches_fp32(n):
    """One process: n micro-batches' gradients added (any order: n = 2), / n, AdamW."""
    model = make("gpt_tied").float()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    for step in range(STEPS):
        x, y = batch("gpt_tied", step)
        grads = []
        for r in range(n):
            model.zero_grad()
            loss("gpt_tied", model, models.shard(x, r, n), models.shard(y, r, n)).backward()
            grads.append([p.grad for p in model.parameters()])
        for p, *g in zip(model.parameters(), *grads):
            p.grad = (g[0] + g[1]) / n
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def _bitwise_and_mixed():
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    out = {}
    for dtype in (None, torch.bfloat16):
        model = make("gpt_tied").float()
        wrapped = zero.Zero3(model, units("gpt_tied", model), compute_dtype=dtype)
        opt = torch.optim.AdamW(wrapped.parameters(), **ADAMW)
        gathered = []
        gather = wrapped.flats[0].gather
        def logged(shard, gathered=gathered, wrapped=wrapped, gather=gather):
            gathered.append(tally.storage_bytes(f.data for f in wrapped.flats))
            return gather(shard)
        wrapped.flats[0].gather = logged
        for step in range(STEPS):
            loss("gpt_tied", wrapped, *my_batch("gpt_tied", step)).backward()
            opt.step()
            opt.zero_grad()
        out[dtype] = wrapped.full_parameters(), max(gathered)
    theirs = make("gpt_tied").float()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in theirs.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(theirs, mp_policy=policy)
    opt = torch.optim.AdamW(theirs.parameters(), **ADAMW)
    for step in range(STEPS):
        loss("gpt_tied", theirs, *my_batch("gpt_tied", step)).backward()
        opt.step()
        opt.zero_grad()
    fsdp = {n: p.full_tensor() for n, p in theirs.named_parameters()}
    return out[None], out[torch.bfloat16], fsdp, _micro_batches_fp32(dist.get_world_size())


def test_fp32_bitwise_at_two_ranks_and_bf16_compute_equals_fsdp2_mixed_precision():
    with ls.start(world_size=2, backend="gloo") as cluster:
        (fp32, gathered32), (bf16, gathered16), fsdp, one = cluster.run(_bitwise_and_mixed)[0]
    assert all(torch.equal(fp32[k], one[k]) for k in one), "fp32 ZeRO-3 != one process"
    assert all(torch.equal(bf16[k], fsdp[k]) for k in fsdp), "bf16 ZeRO-3 != FSDP2's"
    assert all(v.dtype == torch.float32 for v in bf16.values())
    assert 2 * gathered16 == gathered32 and not all(torch.equal(bf16[k], fp32[k]) for k in fp32)


def _peaks():
    out = {}
    for prefetch in (False, True):
        model = make("gpt_untied")
        wrapped = zero.Zero3(model, units("gpt_untied", model), prefetch=prefetch)
        peaks = []
        for flat in wrapped.flats:
            def logged(shard, gather=flat.gather, peaks=peaks, wrapped=wrapped):
                work = gather(shard)
                peaks.append(tally.storage_bytes(f.data for f in wrapped.flats))
                return work
            flat.gather = logged
        loss("gpt_untied", wrapped, *my_batch("gpt_untied", 0)).backward()
        out[prefetch] = max(peaks)
    unit = [f.data.numel() * 8 for f in wrapped.flats]
    return out, unit


def test_prefetch_holds_one_more_unit(cluster):
    (peaks, unit), *_ = cluster.run(_peaks)
    assert peaks == {False: unit[-1] + max(unit[:-1]), True: unit[-1] + 2 * max(unit[:-1])}


def test_the_zero3_sweep_runs_small_and_gives_its_crossings():
    from labsupport.crossings import Crossing
    from labsupport.zero import crossing
    c = crossing.sweep(small=True)
    assert isinstance(c, Crossing) and c.sizes == crossing.SIZES[True] == [16, 128, 512]
    assert all(t > 0 for t in c.compute + c.comm) and c.formula > 0
    assert len(c.extra["speedup"]) == len(c.extra["bound"]) == 3
    assert set(c.extra["events"][16]) == {False, True}
    assert {e["lane"] for e in c.extra["events"][16][True]} == {"compute", "comm"}
    with pytest.raises(ValueError, match="multiples of 16"):
        crossing.sweep(sizes=[10])
