# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_chapter_device_mesh.py
"""labsupport.device_mesh.checks, behind chapter 8's your-turn cells:
the reference solutions pass, plausible wrong answers fail with a message that
names the mistake, and an unwritten stub is reported as not written."""
import sys

import cloudpickle
import pytest
import torch.distributed as dist

import labsupport as ls
from labsupport.device_mesh import mesh
from labsupport.device_mesh import checks

cloudpickle.register_pickle_by_value(sys.modules[__name__])


# -- axis_groups: in the kernel -------------------------------------------------------

def test_the_reference_groups_are_devicemeshs_rows():
    assert checks.mesh_groups((2, 2, 2), 0) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert checks.mesh_groups((2, 3), 1) == [[0, 1, 2], [3, 4, 5]]
    checks.check_axis_groups(mesh.axis_groups)


def _flipped_axes(shape, axis):                  # counts axes from the innermost
    return mesh.axis_groups(shape, len(shape) - 1 - axis)


def _descending(shape, axis):
    return [g[::-1] for g in mesh.axis_groups(shape, axis)]


def _stride_one(shape, axis):                    # consecutive ranks, whatever the axis
    n = shape[axis]
    world = 1
    for size in shape:
        world *= size
    return [list(range(s, s + n)) for s in range(0, world, n)]


def _tuples(shape, axis):
    return [tuple(g) for g in mesh.axis_groups(shape, axis)]


@pytest.mark.parametrize("wrong, message", [
    (_flipped_axes, r"shape \(2, 2\), axis 0: .* those are the groups along axis 1; "
                    r"along axis 0 neighbours are 2 apart"),
    (_descending, "the right groups, out of order"),
    (_stride_one, r"shape \(2, 2\), axis 0: got \[\[0, 1\], \[2, 3\]\].*along axis 1"),
    (_tuples, "return a list of lists of ranks, got list"),
])
def test_axis_groups_check_names_the_mistake(wrong, message):
    with pytest.raises(AssertionError, match=message):
        checks.check_axis_groups(wrong)


def test_an_unwritten_axis_groups_is_reported_not_failed(capsys):
    def stub(shape, axis):
        raise ls.NotWritten("axis_groups")
    assert ls.your_turn.check(lambda: checks.check_axis_groups(stub), "axis_groups") is None
    assert "axis_groups is not written yet" in capsys.readouterr().out


# -- average_grads: on 4 ranks --------------------------------------------------------

def _world_average(model, dp_group):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def _sum_only(model, dp_group):
    for p in model.parameters():
        dist.all_reduce(p.grad, group=dp_group)


def _tp_average(model, dp_group):
    tp_group, _ = mesh.grid_groups(2, 2)
    for p in model.parameters():
        dist.all_reduce(p.grad, group=tp_group)
        p.grad /= 2


@pytest.fixture(scope="module")
def cluster():
    c = ls.start(world_size=4, backend="gloo")
    yield c
    c.shutdown()


def test_average_check_passes_the_solution(cluster):
    cluster.run(checks.check_average_grads, mesh.average_grads)


@pytest.mark.parametrize("wrong, message", [
    (_world_average, "averaged over the whole world"),
    (_sum_only, "summed but not divided"),
    (_tp_average, "averaged over the tp group")])
def test_average_check_names_the_mistake(cluster, wrong, message):
    with pytest.raises(ls.RankError, match=message):
        cluster.run(checks.check_average_grads, wrong)
