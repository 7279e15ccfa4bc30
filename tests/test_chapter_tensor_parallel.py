# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest \
#   tests/test_chapter_tensor_parallel.py
"""labsupport.tensor_parallel.checks's check behind chapter 4's SP your-turn.

On 2 and 4 ranks: the chapter's own ``ShardSavingLinear`` (read from its
solution cell) passes; a layer that saves the gathered input, one that keeps
it on ctx and never gathers in backward, one whose backward returns the
input's gradient unreduced (identity) or all-gathered, one that keeps only
its chunk of its own partial product, one that all-reduces that product
before the reduce-scatter (TP x too large) and one that all-reduces the
weight's gradient each fail with a message that names the mistake; an
untouched stub is "not written yet".
"""
import sys

import cloudpickle
import pytest
import torch
import torch.nn.functional as F

import labsupport as ls
from labsupport.tensor_parallel import checks
from labsupport.tensor_parallel import tensor_parallel as tp
from nbtools import ROOT, notebook_definitions

cloudpickle.register_pickle_by_value(sys.modules[__name__])
CHAPTER = ROOT / "notebooks" / "04_tensor_parallel.ipynb"
exec(notebook_definitions(CHAPTER)["ShardSavingLinear"],
     {**vars(tp), "torch": torch, "F": F}, ns := {})
Solution = ns["ShardSavingLinear"]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"TP={n}")
def cluster(request):
    c = ls.start(world_size=request.param, backend="gloo")
    yield c
    c.shutdown()


def wrong(bwd, save_full=False):
    """A ShardSavingLinear whose backward is ``bwd(ctx, grad)``."""
    class Wrong(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, group):
            full = tp.all_gather(x, 1, group)
            ctx.save_for_backward(full if save_full else x, weight)
            ctx.full = full
            return F.linear(full, weight)

        backward = staticmethod(bwd)
    return Wrong


def _grad_w(grad, full):
    return grad.flatten(0, 1).T @ full.flatten(0, 1)


def _right_x(grad, weight):
    return tp.reduce_scatter(grad @ weight, 1)


def saved_full(ctx, grad):
    full, weight = ctx.saved_tensors
    return _right_x(grad, weight), _grad_w(grad, full), None


def no_gather(ctx, grad):
    _, weight = ctx.saved_tensors
    return _right_x(grad, weight), _grad_w(grad, ctx.full), None


def identity_x(ctx, grad):
    x, weight = ctx.saved_tensors
    return grad @ weight, _grad_w(grad, tp.all_gather(x, 1)), None


def gathered_x(ctx, grad):
    x, weight = ctx.saved_tensors
    full = tp.all_gather(x, 1)
    return tp.all_gather(grad @ weight, 1), _grad_w(grad, full), None


def own_chunk_x(ctx, grad):
    x, weight = ctx.saved_tensors
    full = tp.all_gather(x, 1)
    return tp.my_chunk(grad @ weight, 1), _grad_w(grad, full), None


def summed_w(ctx, grad):
    x, weight = ctx.saved_tensors
    full = tp.all_gather(x, 1)
    return _right_x(grad, weight), tp.all_reduce(_grad_w(grad, full)), None


def summed_x(ctx, grad):
    x, weight = ctx.saved_tensors
    full = tp.all_gather(x, 1)
    return tp.reduce_scatter(tp.all_reduce(grad @ weight), 1), _grad_w(grad, full), None


def test_the_chapters_solution_passes(cluster):
    assert cluster.run(checks.check_shard_saving_linear, Solution) == \
        [True] * cluster.world_size


@pytest.mark.parametrize("backward, save_full, message", [
    (saved_full, True, r"forward saved .* B for backward besides the weight; the "
                       r"shard x is"),
    (no_gather, False, r"no all-gather: the weight gradient needs the input of every"),
    (identity_x, False, r"wrong shape .*neither returning it as it is \(identity\) "
                        r"nor all-gathering it fits"),
    (gathered_x, False, r"wrong shape .*Reduce-scatter it along the sequence"),
    (own_chunk_x, False, r"gradient of x differs .*only this rank's chunk of its own "
                         r"partial product"),
    (summed_x, False, r"gradient of x differs .*x \(TP x\) too large"),
    (summed_w, False, r"gradient of weight differs .*summed over the ranks \(an "
                      r"all-reduce\)"),
], ids=lambda v: v.__name__ if callable(v) else None)
def test_each_mistake_is_named(cluster, backward, save_full, message):
    with pytest.raises(ls.RankError, match=message):
        cluster.run(checks.check_shard_saving_linear, wrong(backward, save_full))


class Stub(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group):
        raise ls.NotWritten("stub")


def test_an_untouched_stub_is_not_written_yet_not_a_failure(capsys):
    run = lambda: ls.run(checks.check_shard_saving_linear, Stub, world_size=2)  # noqa: E731
    assert ls.your_turn.check(run, "stub") is None
    assert "stub is not written yet" in capsys.readouterr().out
