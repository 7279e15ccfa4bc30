# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_grading_mesh.py
# (add -m "not slow" for the checks alone, ~15 s)
"""Graded assignment 4 (a DP x TP step from process groups): labsupport.grading.mesh, then nbgrader.

Layer 1 (unit): each check passes the reference and fails each plausible
wrong answer with the message that says what to fix; a deadlock (an
all-reduce only one rank of a dp group calls) ends at the deadline. Layer 4 (slow): `nbgrader
generate_assignment`, `autograde` and `export` on the assignment in a
temporary course directory, with six submissions whose scores are known.
"""
import inspect
import re
import time

import nbformat
import pytest

import grading_mesh_fns as fns
import labsupport.grading.mesh as gm
from nbgrader_run import (assert_cell_scores, assert_exported_totals, autograde, cell_seconds,
                          source_path)

ASSIGNMENT = "dp_tp_step"
SHORT = 3.0  # s, deadline of the unit test that deadlocks on purpose


def fails(check, *args, **kwargs) -> str:
    with pytest.raises(AssertionError) as info:
        check(*args, **kwargs)
    return str(info.value)


# -- layer 1: the checks ----------------------------------------------------------------

def test_the_reference_passes_every_check():
    gm.check_groups(fns.make_groups)
    for check in (gm.check_parameters, gm.check_own_groups, gm.check_bytes):
        check(fns.make_groups, fns.dp_tp_step)


def test_swapped_rows_and_columns_lose_the_groups_only():
    text = fails(gm.check_groups, fns.swapped_groups)
    assert text.startswith("rank 0: tp group [0, 2], dp group [0, 1]; expected tp [0, 1]")
    gm.check_parameters(fns.swapped_groups, fns.dp_tp_step)  # a transposed grid trains right
    gm.check_bytes(fns.swapped_groups, fns.dp_tp_step)


def test_averaging_over_the_whole_world_is_named():
    text = fails(gm.check_parameters, fns.make_groups, fns.world_average_step)
    assert "a collective ran over the whole world (group=None)" in text
    text = fails(gm.check_own_groups, fns.make_groups, fns.world_average_step)
    assert text.startswith("rank 0 called dist.all_reduce on ranks [0, 1, 2, 3]")
    assert "on its dp group" in fails(gm.check_bytes, fns.make_groups, fns.world_average_step)


def test_all_reducing_the_tp_shards_gradients_is_named():
    text = fails(gm.check_parameters, fns.make_groups, fns.tp_sync_step)
    assert "a gradient of a TP-sharded weight was all-reduced over the tp group" in text
    gm.check_own_groups(fns.make_groups, fns.tp_sync_step)  # its own groups, wrongly used
    text = fails(gm.check_bytes, fns.make_groups, fns.tp_sync_step)
    assert "expected 384 B" in text


def test_a_deadlock_ends_at_the_deadline_then_the_next_check_passes():
    t0 = time.monotonic()
    text = fails(gm.check_parameters, fns.make_groups, fns.root_only_step, timeout=SHORT)
    assert time.monotonic() - t0 < SHORT + 10
    assert text.startswith("dp_tp_training did not finish within 3 s on 4 ranks")
    assert "root_only_step" in text  # where the stuck rank was
    gm.check_parameters(fns.make_groups, fns.dp_tp_step)  # fresh ranks, no stale groups


def solution_source(nb, grade_id) -> str:
    source = next(c.source for c in nb.cells
                  if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)
    return re.sub(r"\n *### (BEGIN|END) SOLUTION", "", source)


def test_the_reference_here_is_the_assignments_solution():
    nb = nbformat.read(source_path(ASSIGNMENT), as_version=4)
    for fn in (fns.make_groups, fns.dp_tp_step):
        assert solution_source(nb, fn.__name__) == inspect.getsource(fn).strip(), fn.__name__


# -- layer 4: nbgrader on assignment 4 ------------------------------------------------

def renamed(fn, name) -> str:
    source = inspect.getsource(fn)
    return source.replace(f"def {fn.__name__}(", f"def {name}(", 1) + "\n\n"


SUBMISSIONS = {
    "reference": {},
    "untouched": None,
    "swapped": {"make_groups": renamed(fns.make_groups, "_grid")
                + renamed(fns.swapped_groups, "make_groups").replace(
                    "make_groups(dp, tp)\n    return", "_grid(dp, tp)\n    return")},
    "world_average": {"dp_tp_step": renamed(fns.world_average_step, "dp_tp_step")},
    "tp_sync": {"dp_tp_step": renamed(fns.tp_sync_step, "dp_tp_step")},
    "deadlock": {"dp_tp_step": renamed(fns.root_only_step, "dp_tp_step")},
}
CELLS = {"test_groups": 2, "test_parameters": 4, "test_own_groups": 2, "test_bytes": 2}
STUCK = "did not finish within 4 s"
FAILED = {  # submission -> the test cells that score zero, and what their message says
    "reference": {},
    "untouched": {name: "in place of `raise NotImplementedError()`" for name in CELLS},
    "swapped": {"test_groups": "expected tp [0, 1]"},
    "world_average": {"test_parameters": "over the whole world",
                      "test_own_groups": "on ranks [0, 1, 2, 3]",
                      "test_bytes": "over dp only"},
    "tp_sync": {"test_parameters": "TP-sharded weight", "test_bytes": "expected 384 B"},
    "deadlock": dict.fromkeys(("test_parameters", "test_own_groups", "test_bytes"), STUCK),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    return autograde(ASSIGNMENT, SUBMISSIONS, tmp_path_factory.mktemp("course"))


@pytest.mark.slow
def test_the_student_version_has_stubs(graded):
    release = graded["release"].read_text()
    assert "### BEGIN SOLUTION" not in release
    assert release.count("raise NotImplementedError()") == 2


@pytest.mark.slow
def test_exported_grades_are_the_expected_totals(graded):
    assert_exported_totals(graded, CELLS, FAILED, {
        "reference": 10, "untouched": 0, "swapped": 8, "world_average": 2, "tp_sync": 4,
        "deadlock": 2})


@pytest.mark.slow
@pytest.mark.parametrize("student", SUBMISSIONS)
def test_each_test_cell_scores_as_expected_with_a_helpful_message(graded, student):
    assert_cell_scores(graded, student, CELLS, FAILED)


@pytest.mark.slow
def test_a_deadlock_ends_each_cell_at_the_deadline(graded):
    from nbgrader_run import DEADLINE, autograded
    seconds = cell_seconds(autograded(graded, "deadlock"))
    for cell_id in ("try-step", "test-parameters", "test-own-groups", "test-bytes"):
        assert DEADLINE <= seconds[cell_id] < DEADLINE + 20, (cell_id, seconds[cell_id])
