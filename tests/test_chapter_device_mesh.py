# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_chapter_device_mesh.py
"""labsupport.device_mesh.checks, behind chapter 8's your-turn cells:
the reference solutions pass, plausible wrong answers fail with a message that
names the mistake, and an unwritten stub is reported as not written."""
import sys

import cloudpickle
import pytest

import labsupport as ls
from labsupport.device_mesh import checks, mesh

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


# -- grad_sync_plan: on 8 ranks (2 x 2 x 2) -----------------------------------------

def _right(names, dp, cp, tp, sequence_parallel):
    plan = {}
    for name in names:
        axes = ("dp", "cp")
        if sequence_parallel and (name.startswith("ln.") or name == "fc2.bias"):
            axes += ("tp",)
        plan[name] = (axes, dp * cp)
    return plan


def _layernorm_not_over_tp(names, dp, cp, tp, sequence_parallel):
    plan = _right(names, dp, cp, tp, sequence_parallel)
    plan["ln.weight"] = plan["ln.bias"] = (("dp", "cp"), dp * cp)
    return plan


def _sp_bias_forgotten(names, dp, cp, tp, sequence_parallel):
    plan = _right(names, dp, cp, tp, sequence_parallel)
    plan["fc2.bias"] = (("dp", "cp"), dp * cp)
    return plan


def _dp_only(names, dp, cp, tp, sequence_parallel):      # chapter 3's loop
    return {name: (("dp",), dp) for name in names}


def _divided_by_tp_too(names, dp, cp, tp, sequence_parallel):
    return {name: (axes, dp * cp * tp if "tp" in axes else d)
            for name, (axes, d) in _right(names, dp, cp, tp, sequence_parallel).items()}


def _layernorm_over_tp_always(names, dp, cp, tp, sequence_parallel):
    return _right(names, dp, cp, tp, True)


@pytest.fixture(scope="module")
def cluster():
    c = ls.start(world_size=8, backend="gloo")
    yield c
    c.shutdown()


def test_grad_sync_check_passes_the_right_plan(cluster):
    cluster.run(checks.check_grad_sync, _right)


@pytest.mark.parametrize("wrong, message", [
    (_layernorm_not_over_tp, r"sequence_parallel=True, rank \d, ln.weight: partial "
                             r"over tp under SP .* not reduced over tp"),
    (_sp_bias_forgotten, r"sequence_parallel=True, rank \d, fc2.bias: partial over tp"),
    (_dp_only, r"sequence_parallel=False, rank \d, ln.weight: partial over cp"),
    (_divided_by_tp_too, r"sequence_parallel=True, rank \d, ln.weight: reduced over "
                         r"the right groups \('dp', 'cp', 'tp'\), but divided by 8: "
                         r".*needs 4"),
    (_layernorm_over_tp_always, r"sequence_parallel=False, rank \d, ln.weight: "
                                r"already whole on each tp rank .* counts it 2 times")])
def test_grad_sync_check_names_the_parameter_and_the_mistake(cluster, wrong, message):
    with pytest.raises(ls.RankError, match=message):
        cluster.run(checks.check_grad_sync, wrong)


def test_an_unwritten_grad_sync_plan_is_reported_not_failed(cluster, capsys):
    def stub(names, dp, cp, tp, sequence_parallel):
        raise ls.NotWritten("grad_sync_plan")
    assert ls.your_turn.check(lambda: cluster.run(checks.check_grad_sync, stub),
                              "grad_sync_plan") is None
    assert "grad_sync_plan is not written yet" in capsys.readouterr().out
