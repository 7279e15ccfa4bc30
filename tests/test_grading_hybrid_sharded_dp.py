# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_grading_hybrid_sharded_dp.py
# (add -m "not slow" for the checks alone, ~30 s)
"""Graded assignment 4 (HSDP from process groups): labsupport.grading.hybrid_sharded_dp, then
nbgrader.

Layer 1 (unit): each check passes the reference (the source notebook's,
``sources.reference``) and fails each plausible wrong answer, written as an
edit of it, with the message that says what to fix; a deadlock (an
all-reduce only one rank of each replicate group calls) ends at the
deadline. Layer 4 (slow): `nbgrader generate_assignment`, `autograde` and
`export` on the assignment in a temporary course directory, with six
submissions whose scores are known.
"""
import time

import pytest

import labsupport.grading.hybrid_sharded_dp as gh
import sources
from nbgrader_run import (DEADLINE, assert_cell_scores, assert_exported_totals,
                          assert_release_only, autograde, autograded, cell_seconds)

ASSIGNMENT = "hybrid_sharded_dp"
SHORT = 3.0  # s, deadline of the unit test that deadlocks on purpose
RS = "            dist.reduce_scatter_single(shard, grad, group=self.shard_group)\n"
AR = "            dist.all_reduce(shard, group=self.replicate_group)\n"
# Each wrong answer as edits of the reference's cells {grade_id: ((old, new), ...)}.
WRONG = {
    "world_allreduce": {"hsdp": ((RS + AR, (  # the full gradient over the whole world
        "            dist.all_reduce(grad)\n"
        "            shard.copy_(grad.chunk(self.s)[dist.get_rank(self.shard_group)])\n")),)},
    "wrong_dimension": {"hsdp": ((RS + AR, (  # shards cut across the replicas
        "            dist.reduce_scatter_single(shard, grad, group=self.replicate_group)\n"
        "            dist.all_reduce(shard, group=self.shard_group)\n")),)},
    "full_allreduce": {"hsdp": ((RS + AR, (  # the full gradient across the replicas first
        "            dist.all_reduce(grad, group=self.replicate_group)\n" + RS)),)},
    "view_shards": {"hsdp": (("[me].clone()", "[me]"),)},  # each shard keeps its flat copy
    "swapped": {"hsdp_groups": (('return mine["shard"], mine["replicate"]',
                                 'return mine["replicate"], mine["shard"]'),)},
    "deadlock": {"hsdp": ((AR, (  # only the first replica all-reduces
        "            if dist.get_rank(self.replicate_group) == 0:\n    " + AR)),)},
}


def edits(name) -> dict:
    return {gid: sources.replaced(*pairs) for gid, pairs in WRONG.get(name, {}).items()}


ref = sources.reference(ASSIGNMENT)
MODULES = {name: sources.reference(ASSIGNMENT, edits(name), name) for name in WRONG}


def fails(check, *args, **kwargs) -> str:
    with pytest.raises(AssertionError) as info:
        check(*args, **kwargs)
    return str(info.value)


# -- layer 1: the checks ----------------------------------------------------------------

def test_the_reference_passes_every_check_on_every_grid():
    grids = gh.GRIDS + gh.EDGE_GRIDS
    gh.check_groups(ref.hsdp_groups, grids=grids)
    gh.check_parameters(ref.hsdp_groups, ref.HSDP, grids=grids)
    for check in (gh.check_own_groups, gh.check_bytes, gh.check_memory):
        check(ref.hsdp_groups, ref.HSDP, grids=grids)


def test_the_formula_counts_padded_parameters():
    assert gh.padded_numels(2) == [36, 8, 22, 4] and gh.padded_numels(4) == [36, 8, 24, 4]
    assert gh.payload_formula((2, 2)) == (2 * 70 * 8, 35 * 8)
    assert gh.payload_formula((4, 1)) == (2 * 66 * 8, 66 * 8)   # DDP: the whole gradient


def test_an_all_reduce_over_the_world_trains_right_but_talks_to_everyone():
    m = MODULES["world_allreduce"]
    gh.check_parameters(m.hsdp_groups, m.HSDP)
    text = fails(gh.check_own_groups, m.hsdp_groups, m.HSDP)
    assert text.startswith("rank 0 called dist.all_reduce on ranks [0, 1, 2, 3] (the whole "
                           "world: group=None)")
    assert "HSDP sends only 1/S of it there" in text
    assert "ran on other groups" in fails(gh.check_bytes, m.hsdp_groups, m.HSDP)
    gh.check_memory(m.hsdp_groups, m.HSDP)


def test_reducing_over_the_wrong_dimension_is_named():
    m = MODULES["wrong_dimension"]
    text = fails(gh.check_parameters, m.hsdp_groups, m.HSDP)
    assert "The reduce-scatter ran across the replicas (ranks [0, 2])" in text
    gh.check_own_groups(m.hsdp_groups, m.HSDP)  # its own groups, each used for the other
    assert "it belongs to the shard group" in fails(gh.check_bytes, m.hsdp_groups, m.HSDP)


def test_full_gradients_all_reduced_across_replicas_cost_s_times_the_bytes():
    m = MODULES["full_allreduce"]
    gh.check_parameters(m.hsdp_groups, m.HSDP)
    gh.check_own_groups(m.hsdp_groups, m.HSDP)
    text = fails(gh.check_bytes, m.hsdp_groups, m.HSDP)
    assert "expected 2,240 B" in text and "and 560 B" in text
    assert "The replicate group carried the full gradients (1,120 B)" in text
    assert "S = 2 times fewer bytes" in text


def test_shards_that_are_views_keep_the_whole_copy():
    m = MODULES["view_shards"]
    gh.check_parameters(m.hsdp_groups, m.HSDP)
    text = fails(gh.check_memory, m.hsdp_groups, m.HSDP)
    assert "self.shards hold 560 B" in text and "Ψ'/S·8 = 280 B" in text


def test_swapped_rows_and_columns_lose_the_groups_only():
    m = MODULES["swapped"]
    text = fails(gh.check_groups, m.hsdp_groups)
    assert text.startswith("2 x 2 grid (replicate x shard), rank 0: shard group [0, 2], "
                           "replicate group [0, 1]; expected shard [0, 1]")
    gh.check_parameters(m.hsdp_groups, m.HSDP)  # a transposed grid trains right


def test_a_deadlock_ends_at_the_deadline_then_the_next_check_passes():
    m = MODULES["deadlock"]
    t0 = time.monotonic()
    text = fails(gh.check_parameters, m.hsdp_groups, m.HSDP, timeout=SHORT)
    assert time.monotonic() - t0 < SHORT + 15
    assert text.startswith("on the 2 x 2 grid: hsdp_training did not finish within 3 s on "
                           "4 ranks")
    assert "all_reduce" in text
    gh.check_parameters(ref.hsdp_groups, ref.HSDP)  # fresh ranks, no stale groups


# -- layer 4: nbgrader on assignment 4 ------------------------------------------------

SUBMISSIONS = {"reference": {}, "untouched": None,
               **{name: edits(name) for name in ("world_allreduce", "wrong_dimension",
                                                  "full_allreduce", "deadlock")}}
CELLS = {"test_groups": 1, "test_parameters": 3, "test_parameters_edges": 1,
         "test_own_groups": 2, "test_bytes": 2, "test_memory": 1}
STUCK = "did not finish within 4 s"
FAILED = {  # submission -> the test cells that score zero, and what their message says
    "reference": {},
    "untouched": {name: "in place of `raise NotImplementedError()`" for name in CELLS},
    "world_allreduce": {"test_own_groups": "(the whole world: group=None)",
                        "test_bytes": "ran on other groups"},
    "wrong_dimension": {"test_parameters": "The reduce-scatter ran across the replicas",
                        "test_parameters_edges": "hsdp_training failed",
                        "test_bytes": "it belongs to the shard group"},
    "full_allreduce": {"test_bytes": "The replicate group carried the full gradients"},
    "deadlock": dict.fromkeys(("test_parameters", "test_parameters_edges", "test_own_groups",
                               "test_bytes", "test_memory"), STUCK),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    return autograde(ASSIGNMENT, SUBMISSIONS, tmp_path_factory.mktemp("course"))


@pytest.mark.slow
def test_the_student_version_has_stubs_and_no_hidden_tests(graded):
    release = assert_release_only(graded)
    assert "EDGE_GRIDS" not in release
    assert release.count("raise NotImplementedError()") == 5


@pytest.mark.slow
def test_exported_grades_are_the_expected_totals(graded):
    assert_exported_totals(graded, CELLS, FAILED, {
        "reference": 10, "untouched": 0, "world_allreduce": 6, "wrong_dimension": 4,
        "full_allreduce": 8, "deadlock": 1})


@pytest.mark.slow
@pytest.mark.parametrize("student", SUBMISSIONS)
def test_each_test_cell_scores_as_expected_with_a_helpful_message(graded, student):
    assert_cell_scores(graded, student, CELLS, FAILED)


@pytest.mark.slow
def test_a_deadlock_ends_each_cell_at_the_deadline(graded):
    seconds = cell_seconds(autograded(graded, "deadlock"))
    for cell_id in ("try-hsdp", "test-parameters", "test-own-groups", "test-bytes"):
        assert DEADLINE <= seconds[cell_id] < DEADLINE + 20, (cell_id, seconds[cell_id])
