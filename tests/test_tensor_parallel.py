# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_tensor_parallel.py
"""labsupport.tensor_parallel.tensor_parallel, chapter 4's layers, through the launcher at
t = 2 and 4.

Against the single-process ``models.GPT``: the loss, the logits and every
parameter's gradient (TP, and TP+SP), and the parameters after K SGD steps;
against DTensor's ``parallelize_module``: the same loss and gradients; the
collectives each layer issues, forward and backward; the layers inside a
sub-group (as chapter 8 runs them); errors for sizes t does not divide; and
the notebook's copy of the lesson being the package's, character for character.
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import labsupport as ls
from labsupport import calls, models
from labsupport.tensor_parallel import checks
from labsupport.tensor_parallel import gpt as tp_gpt
from labsupport.tensor_parallel import probe as tp_probe
from labsupport.tensor_parallel import tensor_parallel as tp
from nbtools import assert_lesson_copy

CFG = models.GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2)
BATCH, STEPS, LR = 4, 3, 0.05
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32, values up to ~20: another order of the same sums
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"t={n}")
def cluster(request):
    c = ls.start(world_size=request.param, backend="gloo")
    yield c
    c.shutdown()


def data(step=0):
    return models.toy_tokens(BATCH, CFG.seq_len, CFG.vocab_size, seed=1 + step)


def reference():
    model = models.GPT(CFG, seed=0)
    ids, targets = data()
    logits = model(ids)
    loss = model(ids, targets)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _tp_grads(sp, group=None):
    model = tp_gpt.TensorParallelGPT(models.GPT(CFG, seed=0), group, sequence_parallel=sp)
    ids, targets = data()
    logits = model(ids).detach()
    loss = model(ids, targets)
    loss.backward()
    tp_gpt.allreduce_sequence_parallel_grads(model)
    return logits, loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("sp", [False, True], ids=["TP", "TP+SP"])
def test_logits_loss_and_every_gradient_equal_one_process(cluster, sp):
    logits, loss, grads = reference()
    n = cluster.world_size
    for rank, (got_logits, got_loss, got) in enumerate(cluster.run(_tp_grads, sp)):
        torch.testing.assert_close(got_logits, logits, **TOL)
        torch.testing.assert_close(got_loss, loss, **TOL)
        assert set(got) == set(grads)  # every parameter, none missing
        for name, want in _shards(got, grads, rank, n, sp).items():
            torch.testing.assert_close(got[name], want, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _shards(got, full, rank, n, sp):
    """full[name] sliced as TensorParallelGPT splits it (built on one process here)."""
    shapes = {name: g.shape for name, g in got.items()}
    out = {}
    for name, t in full.items():
        dims = [d for d in range(t.dim()) if t.shape[d] != shapes[name][d]]
        assert len(dims) <= 1, name
        out[name] = t.chunk(n, dims[0])[rank] if dims else t
    return out


def _shard_like(sp):
    model = tp_gpt.TensorParallelGPT(models.GPT(CFG, seed=0), sequence_parallel=sp)
    full = dict(models.GPT(CFG, seed=0).named_parameters())
    want = tp_probe.shard_like(model, full, dist.get_rank(), dist.get_world_size())
    return all(torch.equal(p, want[n]) for n, p in model.named_parameters())


def test_shard_like_gives_each_rank_its_parameters(cluster):
    assert cluster.run(_shard_like, True) == [True] * cluster.world_size


def _train(sp, steps=STEPS):
    model = tp_gpt.TensorParallelGPT(models.GPT(CFG, seed=0), sequence_parallel=sp)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        model(*data(step)).backward()
        tp_gpt.allreduce_sequence_parallel_grads(model)
        optimizer.step()
        optimizer.zero_grad()
    full = _train_reference(steps)
    want = tp_probe.shard_like(model, full, dist.get_rank(), dist.get_world_size())
    return {n: (p.detach() - want[n]).abs().max().item() for n, p in model.named_parameters()}


def _train_reference(steps):
    model = models.GPT(CFG, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        model(*data(step)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("sp", [False, True], ids=["TP", "TP+SP"])
def test_k_training_steps_give_the_same_parameters(cluster, sp):
    for diffs in cluster.run(_train, sp):
        assert len(diffs) == len(dict(models.GPT(CFG).named_parameters()))
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] < 1e-5, (worst, diffs[worst])


def _dtensor_vs_hand(sp):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    theirs = tp.parallelize_dtensor(models.GPT(CFG, seed=0), mesh, sp)
    ours = tp_gpt.TensorParallelGPT(models.GPT(CFG, seed=0), sequence_parallel=sp)
    loss_theirs, loss_ours = theirs(*data()), ours(*data())
    loss_theirs.backward()
    loss_ours.backward()
    tp_gpt.allreduce_sequence_parallel_grads(ours)
    torch.testing.assert_close(loss_theirs, loss_ours, **TOL)
    mine = dict(ours.named_parameters())
    for name, p in theirs.named_parameters():
        torch.testing.assert_close(tp_probe.local_grad(p), mine[name].grad, **TOL,
                                   msg=lambda m, n=name: f"{n}: {m}")
    return True


@pytest.mark.parametrize("sp", [False, True], ids=["TP", "TP+SP"])
def test_dtensor_parallelize_module_gives_the_same_loss_and_gradients(cluster, sp):
    assert cluster.run(_dtensor_vs_hand, sp) == [True] * cluster.world_size


def _counts(sp):
    model = tp_gpt.TensorParallelGPT(models.GPT(CFG, seed=0), sequence_parallel=sp)
    with calls.record() as log:
        model.blocks[0](torch.randn(BATCH, CFG.seq_len // (dist.get_world_size() if sp else 1),
                                    CFG.hidden)).sum().backward()
    return [(e["op"], e["phase"], e["nbytes"]) for e in tp_probe.collectives(log)]


@pytest.mark.parametrize("sp", [False, True], ids=["TP", "TP+SP"])
def test_one_layer_issues_the_chapters_collectives(cluster, sp):
    full = BATCH * CFG.seq_len * CFG.hidden * 4          # S = sbh, fp32
    if sp:
        want = [("all_gather", "forward", full), ("reduce_scatter", "forward", full)] * 2 + \
               [("all_gather", "backward", full), ("reduce_scatter", "backward", full)] * 2
    else:
        want = [("all_reduce", "forward", full)] * 2 + [("all_reduce", "backward", full)] * 2
    for log in cluster.run(_counts, sp):
        assert sorted(log) == sorted(want)


def _in_pairs(sp):
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    logits, loss, grads = _tp_grads(sp, group=groups[rank // 2])
    return logits, loss, grads


@pytest.mark.parametrize("sp", [False, True], ids=["TP", "TP+SP"])
def test_the_layers_run_inside_a_sub_group(cluster, sp):
    if cluster.world_size != 4:
        pytest.skip("two groups of two need four ranks")
    logits, loss, grads = reference()
    for rank, (got_logits, _, got) in enumerate(cluster.run(_in_pairs, sp)):
        torch.testing.assert_close(got_logits, logits, **TOL)
        for name, want in _shards(got, grads, rank % 2, 2, sp).items():
            torch.testing.assert_close(got[name], want, **TOL)


@pytest.mark.parametrize("cfg, sp, match", [
    (models.GPTConfig(vocab_size=63, seq_len=16, hidden=32, heads=4, layers=1), False,
     r"cannot split vocab_size=63: choose sizes divisible by 2"),
    (models.GPTConfig(vocab_size=64, seq_len=15, hidden=32, heads=4, layers=1), True,
     r"cannot split seq_len=15: .*feed sequences of exactly seq_len"),
    (models.GPTConfig(vocab_size=64, seq_len=16, hidden=30, heads=3, layers=1), False,
     r"cannot split heads=3: "),
])
def test_sizes_that_t_does_not_divide_are_refused(cluster, cfg, sp, match):
    if cluster.world_size != 2:
        pytest.skip("one world size is enough")
    with pytest.raises(ls.RankError, match=match):
        cluster.run(lambda: tp_gpt.TensorParallelGPT(models.GPT(cfg), sequence_parallel=sp))


# -- the notebook's copy of the lesson is the package's ---------------------------

def test_the_notebook_copy_is_the_package_code():
    assert_lesson_copy(tp)


# -- the checks behind the your-turn cells, with a right and a wrong answer -------------

def _lookup_without_zeros(ids, weight, start):
    local = (ids - start).clamp(0, weight.shape[0] - 1)
    return torch.nn.functional.embedding(local, weight)


def test_the_lookup_check_passes_masked_lookup_and_names_a_foreign_id(cluster):
    assert cluster.run(checks.check_masked_lookup, tp.masked_lookup) == \
        [True] * cluster.world_size
    with pytest.raises(ls.RankError, match=r"gave \[.*\], expected \[0\.0, 0\.0, 0\.0\]: "
                                           r"zeros, since another rank owns it"):
        cluster.run(checks.check_masked_lookup, _lookup_without_zeros)


def test_holders_colours_each_element_by_the_rank_that_holds_it():
    full = torch.arange(12.0).view(3, 4)
    assert tp_probe.holders(full, [full, full]).eq(-1).all()
    grid = tp_probe.holders(full, [full[:, :2], full[:, 2:]])
    assert grid.tolist() == [[0, 0, 1, 1]] * 3
