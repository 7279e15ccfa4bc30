"""Chapter 3's data-parallel versions (labsupport.data_parallel.ddp) and probe: parity,
counts, errors, notebook copy.

Run: .venv/bin/python -m pytest tests/test_ddp.py
"""
import contextlib
import functools
import re
import sys
from pathlib import Path

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import labsupport as ls
from labsupport import models, timeline
from labsupport.data_parallel import ddp
from labsupport.data_parallel import probe as ddp_probe
from nbtools import assert_lesson_copy

SIZES = dict(d_in=8, width=32, depth=3, d_out=4)   # 4 Linear layers: 8 parameter tensors
BATCH, STEPS, LR = 16, 3, 0.1
TOL = dict(rtol=1e-6, atol=1e-7)  # fp32 rounding of another summation order, no more
# Ship this module's functions to the ranks by value: importing the test module there
# would import pytest and nbformat in every rank (seconds per fresh group).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def new_model():
    return models.DeepMLP(**SIZES, seed=0)


def batches(steps):
    x, y = models.toy_regression(steps * BATCH, SIZES["d_in"], SIZES["d_out"], seed=1)
    return [(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]) for i in range(steps)]


def reference(steps=STEPS, lr=LR):
    """Single-process SGD on the full batch."""
    model = new_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches(steps):
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach() for p in model.parameters()]


class TorchDDP(DistributedDataParallel):
    def sync_gradients(self):
        pass  # DDP waits for its all-reduces inside backward


def train_on_rank(wrap, steps=STEPS, micro_batches=1):
    """SGD on this rank's shard of each batch, gradients accumulated over micro-batches."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = wrap(new_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in batches(steps):
        xs, ys = (models.shard(t, rank, world_size).chunk(micro_batches) for t in (x, y))
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            last = i == micro_batches - 1
            with contextlib.nullcontext() if last else model.no_sync():
                (F.mse_loss(model(xm), ym) / micro_batches).backward()
        model.sync_gradients()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach() for p in model.parameters()]


def bucketed(size):
    return functools.partial(ddp.DataParallelBucket, bucket_size=size)


def run_all(world_size, versions, **kwargs):
    """{name: parameters of every rank} for each version, on one group."""
    return {name: ls.run(train_on_rank, wrap, world_size=world_size, **kwargs)
            for name, wrap in versions.items()}


# -- the notebook's copy of the lesson is the package's ---------------------------

def test_the_notebook_copy_is_the_package_code():
    assert_lesson_copy(ddp)


# -- every rank starts from rank 0's model, as with DDP -------------------------------

class TiedFrozen(torch.nn.Module):
    """An embedding tied to the output layer, a frozen layer and a buffer."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 6)
        self.frozen = torch.nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.norm = torch.nn.BatchNorm1d(6)  # buffers: running mean and variance
        self.out = torch.nn.Linear(6, 10, bias=False)
        self.out.weight = self.embed.weight  # tied

    def forward(self, tokens):
        return self.out(self.norm(self.frozen(self.embed(tokens))))


def states(module):
    return [t.detach().clone() for t in [*module.parameters(), *module.buffers()]]


def train_seeded_by_rank(wrap, steps=2):
    """Build the model with a seed of this rank's own; train on the same data everywhere."""
    torch.manual_seed(100 + dist.get_rank())
    model = TiedFrozen()
    with torch.no_grad():
        model.norm.running_mean.add_(dist.get_rank())  # differing buffers too
    model = wrap(model)
    start = states(model.module)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    tokens = torch.arange(8) % 10
    for _ in range(steps):
        F.cross_entropy(model(tokens), tokens).backward()
        model.sync_gradients()
        optimizer.step()
        optimizer.zero_grad()
    tied = model.module.out.weight is model.module.embed.weight
    return start, states(model.module), tied


@pytest.mark.parametrize("name", ["naive", "overlapped", "bucketed", "DDP"])
def test_ranks_seeded_differently_start_and_end_equal_frozen_tied_and_buffers(name):
    wrap = dict(naive=ddp.DataParallelNaive, overlapped=ddp.DataParallelOverlap,
                bucketed=bucketed(64), DDP=TorchDDP)[name]
    out = ls.run(train_seeded_by_rank, wrap, world_size=2)
    (start0, end0, tied0), (start1, end1, tied1) = out
    assert tied0 and tied1, "the wrapper must keep the tied weight one tensor"
    for a, b in zip(start0, start1):  # parameters (frozen and tied) and buffers
        assert torch.equal(a, b)
    for a, b in zip(end0, end1):
        assert torch.equal(a, b)


def test_without_the_broadcast_ranks_seeded_differently_train_different_models():
    class NoBroadcast(ddp.DataParallelNaive):
        def __init__(self, module):
            torch.nn.Module.__init__(self)
            self.module, self.world_size = module, dist.get_world_size()

    (start0, end0, _), (start1, end1, _) = ls.run(train_seeded_by_rank, NoBroadcast,
                                                  world_size=2)
    assert not torch.equal(start0[0], start1[0]) and not torch.equal(end0[0], end1[0])


def test_broadcast_parameters_copies_rank_0_in_place():
    def run():
        torch.manual_seed(dist.get_rank())
        model = TiedFrozen()
        weight = model.embed.weight
        ddp.broadcast_parameters(model)
        assert model.embed.weight is weight  # the same tensor, overwritten
        return states(model)

    torch.manual_seed(0)
    want = states(TiedFrozen())
    for got in ls.run(run, world_size=2):
        for a, b in zip(got, want):
            assert torch.equal(a, b)


# -- parity through the launcher ------------------------------------------------------

@pytest.mark.parametrize("world_size", [2, 4])
def test_every_version_trains_like_one_process_on_the_full_batch(world_size):
    ref = reference()
    versions = {"naive": ddp.DataParallelNaive, "overlap": ddp.DataParallelOverlap,
                "bucket 0 B": bucketed(0), "bucket 4 KiB": bucketed(4096),
                "bucket 1 GiB": bucketed(2**30), "DDP": TorchDDP}
    results = run_all(world_size, versions)
    for name, by_rank in results.items():
        assert len(by_rank) == world_size
        for rank, params in enumerate(by_rank):
            torch.testing.assert_close(params, ref, **TOL,
                                       msg=lambda m, n=name, r=rank: f"{n}, rank {r}: {m}")
    for name in versions:  # the optimised versions against the starting point, too
        for params, naive in zip(results[name], results["naive"]):
            torch.testing.assert_close(params, naive, **TOL)


@pytest.mark.parametrize("world_size", [2, 4])
def test_gradient_accumulation_with_no_sync_trains_like_one_process(world_size):
    ref = reference()
    versions = {"overlap": ddp.DataParallelOverlap, "bucket": bucketed(2048), "DDP": TorchDDP}
    for name, by_rank in run_all(world_size, versions, micro_batches=2).items():
        for params in by_rank:
            torch.testing.assert_close(params, ref, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_a_single_rank_is_plain_training():
    ref = reference()
    for params in ls.run(train_on_rank, bucketed(4096), world_size=1):
        torch.testing.assert_close(params, ref, **TOL)


def test_forgetting_the_division_is_a_learning_rate_n_times_larger():
    class NoDivide(ddp.DataParallelNaive):
        def sync_gradients(self):
            for param in self.module.parameters():
                dist.all_reduce(param.grad)

    params = ls.run(train_on_rank, NoDivide, world_size=4)[0]
    torch.testing.assert_close(params, reference(lr=4 * LR), **TOL)


# -- exact counts ---------------------------------------------------------------------

def calls_per_step(wrap, micro_batches=1):
    with ddp_probe.watch_all_reduce() as log:
        train_on_rank(wrap, steps=1, micro_batches=micro_batches)
    return log.count, log.nbytes


def test_one_all_reduce_per_tensor_or_per_bucket_and_all_gradients_once():
    params = list(new_model().parameters())
    psi_bytes = 4 * sum(p.numel() for p in params)
    expected = {"naive": (ddp.DataParallelNaive, len(params)),
                "overlap": (ddp.DataParallelOverlap, len(params))}
    for size in (0, 1024, 4096, 2**30):
        expected[f"bucket {size}"] = (bucketed(size), len(ddp.bucket_params(params[::-1], size)))
    for name, (wrap, calls) in expected.items():
        for micro_batches in (1, 3):  # no_sync: still one all-reduce per bucket per step
            if micro_batches > 1 and name == "naive":
                continue
            counted = ls.run(calls_per_step, wrap, micro_batches, world_size=2)
            assert counted == [(calls, psi_bytes)] * 2, name


def test_wire_bytes_per_step_are_the_ring_formula_plus_headers():
    x, y = batches(1)[0]
    psi_bytes = 4 * sum(p.numel() for p in new_model().parameters())

    def count(wrap):
        rank, n = dist.get_rank(), dist.get_world_size()
        return ddp_probe.count_step(new_model, wrap, models.shard(x, rank, n),
                                    models.shard(y, rank, n))

    for world_size in (2, 4):
        for wrap in (ddp.DataParallelNaive, bucketed(2**30)):
            for got in ls.run(count, wrap, world_size=world_size):
                formula = 2 * (world_size - 1) * psi_bytes // world_size
                assert got["nbytes"] == psi_bytes
                assert 0 <= got["wire_sent"] - formula <= 4096 * got["calls"], got


def test_bucket_params_keeps_order_and_sizes():
    params = [torch.zeros(n) for n in (10, 10, 300, 5, 5)]     # 40, 40, 1200, 20, 20 bytes
    sizes = [[p.numel() for p in b] for b in ddp.bucket_params(params, 100)]
    assert sizes == [[10, 10], [300], [5, 5]]
    assert len(ddp.bucket_params(params, 0)) == len(params)
    assert len(ddp.bucket_params(params, 10**9)) == 1
    flat = [p for b in ddp.bucket_params(params, 100) for p in b]
    assert all(a is b for a, b in zip(flat, params))


# -- the probe ------------------------------------------------------------------------

def profile_on_rank(wrap):
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = (models.shard(t, rank, n) for t in batches(1)[0])
    return ddp_probe.profile_steps(new_model, wrap, x, y, steps=3, warmup=1)


def test_profile_records_backward_segments_and_comm_spans_on_every_rank():
    n_tensors = len(list(new_model().parameters()))
    for wrap, overlapped in ((ddp.DataParallelNaive, False), (ddp.DataParallelOverlap, True)):
        results = ls.run(profile_on_rank, wrap, world_size=2)
        events = timeline.merge([r["events"] for r in results])
        for rank, result in enumerate(results):
            assert len(result["times"]) == 3 and result["calls"] == n_tensors
            mine = [e for e in events if e["rank"] == rank]
            backward = [e for e in mine if e["name"] == "backward"]
            comm = [e for e in mine if e["lane"] == "comm"]
            assert len(backward) == n_tensors and len(comm) == n_tensors
            assert {e["name"] for e in mine} >= {"forward", "optimizer", "sync_gradients"}
            first_comm, last_grad = min(e["start"] for e in comm), max(e["end"] for e in backward)
            assert (first_comm < last_grad) == overlapped
        assert ddp_probe.step_time(results) >= max(min(r["times"]) for r in results)


def test_watch_all_reduce_logs_sync_and_async_calls_and_restores_dist():
    def watch():
        tl = timeline.Timeline()
        before = (dist.all_reduce, torch.distributed.distributed_c10d.all_reduce)
        with ddp_probe.watch_all_reduce(tl) as log:
            dist.all_reduce(torch.ones(4))
            dist.all_reduce(torch.ones(2, dtype=torch.float64), async_op=True).wait()
        restored = (dist.all_reduce, torch.distributed.distributed_c10d.all_reduce) == before
        ordered = all(c["end"] >= c["start"] for c in log.calls)
        return log.count, log.nbytes, len(tl.events), restored, ordered

    assert ls.run(watch, world_size=2) == [(2, 32, 2, True, True)] * 2


def test_state_bytes_counts_params_grads_and_adam_state():
    model = new_model()
    optimizer = torch.optim.Adam(model.parameters())
    F.mse_loss(model(torch.ones(2, SIZES["d_in"])), torch.ones(2, SIZES["d_out"])).backward()
    optimizer.step()
    psi = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    assert ddp_probe.state_bytes(model, optimizer) == dict(
        params=4 * psi, grads=4 * psi, optimizer=8 * psi + 4 * n_tensors)


# -- bad input and misuse -------------------------------------------------------------

def test_bucket_params_refuses_bad_input():
    with pytest.raises(ValueError, match="bucket_size is in bytes"):
        ddp.bucket_params([torch.zeros(1)], -1)
    with pytest.raises(ValueError, match="no parameter requires a gradient"):
        ddp.bucket_params([], 1024)


def test_profile_steps_refuses_bad_step_counts():
    with pytest.raises(ValueError, match="steps >= 1"):
        ddp_probe.profile_steps(new_model, ddp.DataParallelNaive, None, None, steps=0)


def test_bucket_sync_without_backward_or_with_unused_parameters_says_what_to_do():
    def misuse():
        errors = []
        model = ddp.DataParallelBucket(new_model(), bucket_size=0)
        try:
            model.sync_gradients()                 # no backward yet
        except RuntimeError as exc:
            errors.append(str(exc))
        partial = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        model = ddp.DataParallelBucket(partial, bucket_size=0)
        model.module[0](torch.ones(1, 2)).sum().backward()   # the second layer is unused
        try:
            model.sync_gradients()
        except RuntimeError as exc:
            errors.append(str(exc))
        return errors

    errors = ls.run(misuse, world_size=2)[0]
    assert len(errors) == 2
    assert "0 of 8 buckets were all-reduced" in errors[0]
    assert "2 of 4 buckets" in errors[1] and "every parameter used in forward" in errors[1]
    ls.shutdown()


def test_the_step_time_table_is_masked_for_nbval_and_nothing_else():
    from nbval.plugin import get_sanitize_patterns

    cfg = (Path(__file__).resolve().parent / "nbval_sanitize.cfg").read_text()

    def sanitize(text):
        for regex, replace in get_sanitize_patterns(cfg):
            text = re.sub(regex, replace, text)
        return text

    assert sanitize("  naive       3.93x DDP, took 38.3 ms") == \
        sanitize("  naive       12.50x DDP, took 9.1 ms")
    for kept in ("naive       18  1,884,192", "N = 4: DDP fp16 sends 1,416,600 bytes",
                 "bucket 2x"):
        assert sanitize(kept) == kept


def unused_then_full_steps():
    """A bucketed model whose first backward misses a layer, then two full steps."""
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model = ddp.DataParallelBucket(layers, bucket_size=2**20)  # one bucket for all
    model.module[0](torch.ones(1, 2)).sum().backward()       # layer 1 unused
    try:
        model.sync_gradients()
    except RuntimeError as exc:
        error = str(exc)
    grads = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        model(torch.ones(1, 2) * (dist.get_rank() + 1)).sum().backward()
        model.sync_gradients()
        grads.append([p.grad.clone() for p in model.parameters()])
    return error, grads


def test_a_bucketed_step_that_failed_leaves_nothing_behind_for_the_next():
    error, grads = ls.run(unused_then_full_steps, world_size=2)[0]
    assert "only 0 of 1 buckets were all-reduced" in error
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    layers(torch.ones(1, 2) * 1.5).sum().backward()  # the mean of the two ranks' inputs
    for step in grads:
        for got, param in zip(step, layers.parameters()):
            torch.testing.assert_close(got, param.grad)


def wrapped_twice():
    module = new_model()
    first = ddp.DataParallelOverlap(module)
    try:
        ddp.DataParallelBucket(module)
    except ValueError as exc:
        refused = str(exc)
    first.close()  # hooks removed: the module may be wrapped again
    second = ddp.DataParallelOverlap(module)
    x, y = batches(1)[0]
    F.mse_loss(second(x), y).backward()
    second.sync_gradients()
    return refused, [p.grad.clone() for p in module.parameters()]


def test_a_module_is_wrapped_once_and_close_removes_the_hooks():
    refused, grads = ls.run(wrapped_twice, world_size=2)[0]
    assert "already wrapped for data parallelism" in refused and "close()" in refused
    model = new_model()
    x, y = batches(1)[0]
    F.mse_loss(model(x), y).backward()  # every rank had the same batch: its mean is it
    for got, param in zip(grads, model.parameters()):
        torch.testing.assert_close(got, param.grad, **TOL)
    ls.shutdown()
