"""labsupport.zero, chapter 7's ZeRO stages: parity through the launcher, errors, notebook copy.

Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_zero.py

After K AdamW steps on N = 2 and 4 ranks, every parameter equals
single-process AdamW on the full batch (fp64, tight), for several models: the
shared GPT with its tied embedding / LM head and a parameter count that N
does not divide, the GPT untied, and the DeepMLP of chapters 3 and 5. The
ShardedOptimizer also equals PyTorch's ZeroRedundancyOptimizer, keeps
param groups and add_param_group, and refuses what it cannot do; Zero3
refuses overlapping units. The notebook's lesson code is the package's.
"""
import ast
import sys
from pathlib import Path

import cloudpickle
import nbformat
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import labsupport as ls
from labsupport import models, sharded_optimizer, zero
from nbtools import assert_lesson_copy

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "07_zero_fsdp.ipynb"
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
    if version == "zero3":
        wrapped = zero.Zero3(model, units(name, model))
        optimizer = torch.optim.AdamW(wrapped.shards.parameters(), **ADAMW)
    elif version == "zero1_2":  # the lesson's functions, stage 1 then stage 2 steps
        flat = zero.FlatParams(model.parameters())
        optimizer = torch.optim.AdamW([flat.shard(flat.data)], **ADAMW)
    else:
        optimizer = sharded_optimizer.ShardedOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
    for step in range(STEPS):
        if version == "zero1_2":
            flat.alloc_grads()
        loss(name, wrapped if version == "zero3" else model, *my_batch(name, step)).backward()
        if version == "zero3":
            wrapped.sync_gradients()
        if version == "zero1_2":
            zero.zero_step(flat, optimizer, stage=1 + step % 2)
        else:
            optimizer.step()
            optimizer.zero_grad()
    if version == "zero3":
        return wrapped.full_parameters()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world_size={n}")
def cluster(request):
    c = ls.start(world_size=request.param, backend="gloo")
    yield c
    c.shutdown()


@pytest.mark.parametrize("name", ["gpt_tied", "gpt_untied", "mlp"])
@pytest.mark.parametrize("version", ["sharded_optimizer", "zero1_2", "zero3"])
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
    state = ls.memory.storage_bytes(v for s in opt.state.values() for v in s.values())
    return ([p.detach() for p in model.parameters()], [p.detach() for p in ref_model.parameters()],
            state, shard_numel, n, opt.param_groups[1]["lr"], len(opt.param_groups))


def test_param_groups_add_param_group_and_a_sharded_state(cluster):
    import labsupport.memory  # noqa: F401 (ls.memory on the ranks)
    for got, want, state, shard_numel, n, lr, groups in cluster.run(_groups_and_memory):
        torch.testing.assert_close(got, want, **TOL)
        assert (lr, groups) == (2e-3, 2)
        assert state == 2 * 8 * shard_numel + 2 * 4  # fp64 m, v of each shard; fp32 steps


def _errors():
    model = make("gpt_tied")
    found = {}
    cases = {
        "optimizer_cls": lambda: sharded_optimizer.ShardedOptimizer(model.parameters(), "adam"),
        "frozen": lambda: sharded_optimizer.ShardedOptimizer([torch.zeros(3)], torch.optim.AdamW),
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
    expected = {"optimizer_cls": "torch.optim.Optimizer class", "frozen": "does not require grad",
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


# -- the your-turn checkers of the notebook, on right and wrong answers ----------------

def _notebook_namespace():
    """The notebook's definitions up to its checkers, with its small parameters."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    module = type(sys)("zero_chapter")
    sys.modules[module.__name__] = module
    small = nb.metadata["labsupport"]["small_parameters"]
    for cell in nb.cells:
        if cell.cell_type != "code" or "ls.run(" in cell.source and "def " not in cell.source:
            continue
        tree = ast.parse(cell.source)
        keep = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom,
                                                       ast.FunctionDef, ast.ClassDef))
                or "parameters" in cell.metadata.get("tags", [])
                or cell.source.startswith("CFG =")]
        code = "\n".join(ast.get_source_segment(cell.source, n) for n in keep)
        exec(compile(code, "<notebook>", "exec"), module.__dict__)
        if "parameters" in cell.metadata.get("tags", []):
            module.__dict__.update(small)
        if "def zero2_update" in cell.source and "solution" in cell.metadata.get("tags", []):
            break  # the reference solutions of both exercises are in
    module.PSI = sum(p.numel() for p in module.new_model().parameters())
    cloudpickle.register_pickle_by_value(module)
    return module


def _bounds_without_padding(numel, rank, world_size):
    shard = numel // world_size
    return rank * shard, (rank + 1) * shard


def _update_with_all_reduce(full_grad, param_shard, optimizer):
    dist.all_reduce(full_grad)
    full_grad /= dist.get_world_size()
    n = param_shard.numel()
    param_shard.grad = full_grad[dist.get_rank() * n:(dist.get_rank() + 1) * n]
    optimizer.step()
    return full_grad


def _update_without_mean(full_grad, param_shard, optimizer):
    grad = torch.empty_like(param_shard)
    dist.reduce_scatter_single(grad, full_grad)
    param_shard.grad = grad                      # the sum, not the mean
    optimizer.step()
    return grad


def test_the_notebooks_checkers_pass_right_answers_and_explain_wrong_ones():
    ns = _notebook_namespace()
    cases = [(ns.check_shard_bounds, ns.shard_bounds, None),
             (ns.check_zero2_update, ns.zero2_update, None),
             (ns.check_shard_bounds, _bounds_without_padding, "do not cover it"),
             (ns.check_zero2_update, _update_with_all_reduce, "not all-reduce"),
             (ns.check_zero2_update, _update_without_mean, "rank 0: Tensor-likes are not close")]
    with ls.start(world_size=4) as cluster:
        for check, fn, message in cases:
            if message is None:
                cluster.run(check, fn)
                continue
            with pytest.raises(ls.RankError, match=message):
                cluster.run(check, fn)
