# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest \
#   tests/test_grading_hybrid_sharded_dp.py
# (add -m "not slow" for the checks alone)
"""Graded assignment 4 (HSDP on ranks placed on nodes): labsupport.grading.hybrid_sharded_dp,
then nbgrader.

Layer 1 (unit): the placement's messages on their own (no ranks); then each
check passes the reference (the source notebook's, ``sources.reference``) and
fails each plausible wrong answer, written as an edit of it, with the message
that says what to fix: among them chapter 8's ``grid_groups`` (consecutive
ranks as a node), ranks that make their groups in different orders (named, not
waited for) and a deadlock (an all-reduce only one rank of each replicate
group calls), which ends at the deadline. Layer 4 (slow): `nbgrader
generate_assignment`, `autograde` and `export` on the assignment in a
temporary course directory, with eight submissions whose scores are known.
"""
import time

import labsupport.grading.hybrid_sharded_dp as gh
import sources
from failing import fails, stopped_as_a_stall
from labsupport.grading.hybrid_sharded_dp import placement
from nbgrader_run import TimedRoundTrip

ASSIGNMENT = "hybrid_sharded_dp"
SHORT = 3.0  # s, deadline of the unit test that deadlocks on purpose
BLOCKS, ROUND_ROBIN = placement.BLOCKS, placement.ROUND_ROBIN
RS = "            dist.reduce_scatter_single(shard, grad, group=self.shard_group)\n"
AR = "            dist.all_reduce(shard, group=self.replicate_group)\n"
GRID_GROUPS = '''from labsupport.device_mesh.mesh import grid_groups


def hsdp_groups(node_of):
    """Chapter 8's grid: rows of S consecutive ranks as shard groups."""
    per_node = node_of.count(node_of[0])
    return grid_groups(len(node_of) // per_node, per_node)
'''
# Each wrong answer as edits of the reference's cells {grade_id: ((old, new), ...)} or,
# for a cell written anew, {grade_id: its source}.
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
    "keep_full_grads": {"hsdp": (  # every padded full gradient kept after reduce()
        ("        self.grads = [None] * len(self.params)\n",
         "        self.grads = [None] * len(self.params)\n"
         "        self.full = [None] * len(self.params)\n"),
        ("            self.grads[i] = shard / self.n\n",
         "            self.grads[i] = shard / self.n\n"
         "            self.full[i] = grad\n"))},
    "swapped": {"hsdp_groups": (('return mine["shard"], mine["replicate"]',
                                 'return mine["replicate"], mine["shard"]'),)},
    "grid_groups": {"hsdp_groups": GRID_GROUPS},  # chapter 8: consecutive ranks, one node
    "new_group_order": {"hsdp_groups": ((  # each rank makes its own node's group first
        "shards = list(by_node.values())",
        "shards = sorted(by_node.values(), key=lambda ranks: rank not in ranks)"),)},
    "columns": {"hsdp_groups": ((  # replicas as rank % S, chapter 8's columns
        "replicas = [list(same) for same in zip(*shards)]",
        "replicas = [list(range(i, len(node_of), len(shards[0])))\n"
        "                for i in range(len(shards[0]))]"),)},
    "deadlock": {"hsdp": ((AR, (  # only the first replica all-reduces
        "            if dist.get_rank(self.replicate_group) == 0:\n    " + AR)),)},
}


def edits(name) -> dict:
    return {gid: edit if isinstance(edit, str) else sources.replaced(*edit)
            for gid, edit in WRONG.get(name, {}).items()}


ref = sources.reference(ASSIGNMENT)
MODULES = {name: sources.reference(ASSIGNMENT, edits(name), name) for name in WRONG}



# -- layer 1: the placement, on its own ---------------------------------------------------

def test_the_groups_follow_the_nodes_whatever_their_numbers():
    assert [placement.expected_groups(r, ROUND_ROBIN) for r in range(4)] == [
        ((0, 2), (0, 1)), ((1, 3), (0, 1)), ((0, 2), (2, 3)), ((1, 3), (2, 3))]
    scattered = (1, 0, 0, 1)  # node 0 holds ranks 1, 2; node 1 ranks 0, 3
    assert [placement.expected_groups(r, scattered) for r in range(4)] == [
        ((0, 3), (0, 1)), ((1, 2), (0, 1)), ((1, 2), (2, 3)), ((0, 3), (2, 3))]
    assert placement.describe(ROUND_ROBIN) == "node_of = [0, 1, 0, 1] (2 nodes of 2)"


def test_each_wrong_group_is_named():
    problem = placement.group_problem
    assert problem(0, ((0, 2), (0, 1)), BLOCKS).endswith(
        "its shard group [0, 2] spans nodes [0, 1]: a shard group is the ranks of one node, "
        "[0, 1] here, so that every step's all-gathers and reduce-scatters stay on the "
        "node's fast links.")
    assert "leaves out rank(s) [3] of node 0" in problem(0, ((0,), (0, 1)), (0, 1, 1, 0))
    assert "does not hold rank 1" in problem(1, ((0, 2), (0, 1)), ROUND_ROBIN)
    assert "holds ranks [0, 2], all on node 0" in problem(0, ((0, 2), (0, 2)), ROUND_ROBIN)
    assert ("pairs ranks at different positions on their nodes (rank 0: position 0 of node "
            "0's [0, 1], rank 3: position 1 of node 1's [2, 3])") in problem(
                0, ((0, 1), (0, 3)), BLOCKS)
    assert problem(3, ((2, 3), (1, 3)), BLOCKS) is None


def test_new_group_calls_in_different_orders_are_named():
    mine_first = [[(0, 1), (2, 3)], [(0, 1), (2, 3)], [(2, 3), (0, 1)], [(2, 3), (0, 1)]]
    text = placement.order_problem(mine_first, BLOCKS)
    assert text.startswith("node_of = [0, 0, 1, 1] (2 nodes of 2): ranks 0 and 2 called "
                           "dist.new_group differently, at call 1: rank 0 asked for [0, 1]; "
                           "rank 2 asked for [2, 3].")
    skipped = [[(0, 1), (2, 3)], [(0, 1)], None, [(0, 1), (2, 3)]]  # rank 2 could not plan
    assert "rank 1 made no more group (1 in all)" in placement.order_problem(skipped, BLOCKS)
    assert placement.order_problem([[(0, 1)], None, [(0, 1)], [(0, 1)]], BLOCKS) is None


# -- layer 1: the checks ----------------------------------------------------------------

def test_the_reference_passes_every_check_on_every_placement():
    placements = gh.PLACEMENTS + gh.EDGE_PLACEMENTS
    gh.check_groups(ref.hsdp_groups, placements=placements)
    gh.check_parameters(ref.hsdp_groups, ref.HSDP, placements=placements)
    for check in (gh.check_own_groups, gh.check_bytes, gh.check_memory):
        check(ref.hsdp_groups, ref.HSDP, placements=placements)


def test_the_formula_counts_padded_parameters():
    assert gh.padded_numels(2) == [36, 8, 22, 4] and gh.padded_numels(4) == [36, 8, 24, 4]
    assert gh.payload_formula(ROUND_ROBIN) == (2 * 70 * 8, 35 * 8)
    assert gh.payload_formula((0, 1, 2, 3)) == (2 * 66 * 8, 66 * 8)  # DDP: the whole gradient


def test_chapter_8s_grid_groups_are_right_only_when_ranks_come_in_blocks():
    m = MODULES["grid_groups"]
    gh.check_groups(m.hsdp_groups, placements=(BLOCKS,))
    text = fails(gh.check_groups, m.hsdp_groups)
    assert text.startswith("node_of = [0, 1, 0, 1] (2 nodes of 2), rank 0 (on node 0): its "
                           "shard group [0, 1] spans nodes [0, 1]")
    assert "Consecutive ranks share a node only when the scheduler placed the ranks in " \
           "blocks: read the nodes from node_of." in text
    gh.check_parameters(m.hsdp_groups, m.HSDP)  # any grid of groups trains right
    text = fails(gh.check_bytes, m.hsdp_groups, m.HSDP)
    assert text.startswith("node_of = [0, 1, 0, 1] (2 nodes of 2), rank 0: 2 steps sent "
                           "2,240 B of payload on groups that span nodes "
                           "(dist.all_gather_single on [0, 1], dist.reduce_scatter_single "
                           "on [0, 1]); HSDP sends only the all-reduce of the gradient "
                           "shards between nodes, 560 B.")


def test_groups_made_in_different_orders_are_named_before_any_is_made():
    m = MODULES["new_group_order"]
    for check, args in ((gh.check_groups, ()), (gh.check_parameters, (m.HSDP,))):
        text = fails(check, m.hsdp_groups, *args, timeout=SHORT)  # named, not "did not finish"
        assert text.startswith("node_of = [0, 0, 1, 1] (2 nodes of 2): ranks 0 and 2 called "
                               "dist.new_group differently, at call 1: rank 0 asked for "
                               "[0, 1]; rank 2 asked for [2, 3].")
    gh.check_groups(ref.hsdp_groups)  # nothing was left half made


def test_replicas_by_rank_modulo_s_are_wrong_once_the_ranks_are_round_robin():
    m = MODULES["columns"]
    gh.check_groups(m.hsdp_groups, placements=(BLOCKS,))
    text = fails(gh.check_groups, m.hsdp_groups)
    assert "rank 0 (on node 0): its replicate group [0, 2] holds ranks [0, 2], all on node " \
           "0: it takes one rank from each node. Rank 0's is [0, 1]." in text
    assert "Its groups are not HSDP's (check_groups says how)" in fails(
        gh.check_parameters, m.hsdp_groups, m.HSDP)


def test_an_all_reduce_over_the_world_trains_right_but_talks_to_everyone():
    m = MODULES["world_allreduce"]
    gh.check_parameters(m.hsdp_groups, m.HSDP)
    text = fails(gh.check_own_groups, m.hsdp_groups, m.HSDP)
    assert text.startswith("node_of = [0, 0, 1, 1] (2 nodes of 2): rank 0 called "
                           "dist.all_reduce on ranks [0, 1, 2, 3] (the whole world: "
                           "group=None)")
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


def test_full_gradients_kept_by_the_object_are_counted_by_reference():
    """What the steps made and the object still reaches: the gradient shards (280 B) and
    every padded full gradient (560 B), however soon gloo lets go of its buffers."""
    m = MODULES["keep_full_grads"]
    gh.check_parameters(m.hsdp_groups, m.HSDP)
    text = fails(gh.check_memory, m.hsdp_groups, m.HSDP)
    assert "840 B made during the steps are still held by your code" in text
    assert "(2·Ψ'/S·8 = 560 B)" in text


def test_swapped_groups_lose_the_groups_only():
    m = MODULES["swapped"]
    text = fails(gh.check_groups, m.hsdp_groups)
    assert text.startswith("node_of = [0, 0, 1, 1] (2 nodes of 2), rank 0 (on node 0): its "
                           "shard group [0, 2] spans nodes [0, 1]")
    gh.check_parameters(m.hsdp_groups, m.HSDP)  # a transposed grid trains right


def test_a_deadlock_ends_at_the_deadline_then_the_next_check_passes():
    m = MODULES["deadlock"]
    t0 = time.monotonic()
    text = fails(gh.check_parameters, m.hsdp_groups, m.HSDP, timeout=SHORT)
    assert stopped_as_a_stall(text, time.monotonic() - t0, SHORT)
    assert text.startswith("with node_of = [0, 0, 1, 1] (2 nodes of 2): hsdp_training did "
                           "not finish within 3 s on 4 ranks")
    assert "all_reduce" in text
    gh.check_parameters(ref.hsdp_groups, ref.HSDP)  # fresh ranks, no stale groups


# -- layer 4: nbgrader on assignment 4 ------------------------------------------------

SUBMISSIONS = {"reference": {}, "untouched": None,
               **{name: edits(name) for name in ("world_allreduce", "wrong_dimension",
                                                  "full_allreduce", "deadlock", "grid_groups",
                                                  "new_group_order")}}
CELLS = {"test_groups": 2, "test_parameters": 3, "test_parameters_edges": 1,
         "test_own_groups": 1, "test_bytes": 2, "test_memory": 1}
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
    "grid_groups": {"test_groups": "spans nodes [0, 1]",
                    "test_bytes": "on groups that span nodes"},
    "new_group_order": dict.fromkeys(CELLS, "called dist.new_group differently"),
}


class TestNbgrader(TimedRoundTrip):
    assignment, submissions, cells, failed = ASSIGNMENT, SUBMISSIONS, CELLS, FAILED
    totals = {"reference": 10, "untouched": 0, "world_allreduce": 7,
              "wrong_dimension": 4, "full_allreduce": 8, "deadlock": 2,
              "grid_groups": 6, "new_group_order": 0}
    stubs, hidden = 5, ("EDGE_PLACEMENTS",)
    deadlocked = ("try-hsdp", "test-parameters", "test-own-groups", "test-bytes")
    # The deadlock waits for its deadlines beside the others (autograde's `beside`):
    # its memory check counts what the HSDP object holds by reference
    # (checking.held), not the allocator; no check reads a clock.
    beside = ("deadlock",)
