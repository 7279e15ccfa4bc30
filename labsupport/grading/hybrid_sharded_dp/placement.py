"""Assignment 4's placement of ranks on nodes, and the groups HSDP makes of it.

``node_of[r]`` is the node rank r runs on, as the scheduler placed it: in
blocks ("consecutive tasks share a node", Slurm's default when there are
more tasks than nodes) or round robin (``srun --distribution=cyclic``:
"consecutive tasks are distributed over consecutive nodes (in a round-robin
fashion)"; srun(1), https://slurm.schedmd.com/srun.html#OPT_distribution), or
any other way. A shard group is the ranks of one node, so that ZeRO-3's
all-gathers and reduce-scatters stay on the node's fast links; a replicate
group the ranks that keep the same shard, the i-th rank (in rank order) of
every node.

Before a graded run each rank calls the student's ``hsdp_groups`` once with
``dist.new_group`` replaced by a recorder that makes no group (``plan``),
and the ranks compare the groups each asked for, in order: ranks that make
them in different orders (the real ``new_group`` then waits forever) are
named instead of waited for.
"""
import torch.distributed as dist

from labsupport import _patch

BLOCKS, ROUND_ROBIN = (0, 0, 1, 1), (0, 1, 0, 1)
PLACEMENTS = (BLOCKS, ROUND_ROBIN)                      # the visible checks: 4 ranks
# Hidden: one node (ZeRO-3 alone), one rank per node (no sharding: DDP), and node
# numbers in no order the ranks follow.
EDGE_PLACEMENTS = ((0, 0, 0, 0), (0, 1, 2, 3), (1, 0, 0, 1))


def nodes(node_of) -> dict:
    """{node: its ranks in rank order}, the nodes sorted."""
    return {n: [r for r, m in enumerate(node_of) if m == n] for n in sorted(set(node_of))}


def shape(node_of) -> tuple[int, int]:
    """(R, S): nodes, and ranks per node."""
    by_node = nodes(node_of)
    return len(by_node), len(node_of) // len(by_node)


def expected_groups(rank, node_of) -> tuple:
    """(shard group, replicate group) of ``rank``, sorted: the ranks of its node; the
    ranks at its position on every node."""
    by_node = nodes(node_of)
    mine = by_node[node_of[rank]]
    at = mine.index(rank)
    return tuple(mine), tuple(sorted(ranks[at] for ranks in by_node.values()))


def describe(node_of) -> str:
    nodes_, per_node = shape(node_of)
    return f"node_of = {list(node_of)} ({nodes_} node{'s' * (nodes_ > 1)} of {per_node})"


def crossing(c, node_of) -> bool:
    """Does the collective ``c`` run on a group whose ranks are on more than one node?"""
    return len({node_of[r] for r in c["ranks"]}) > 1


def named_calls(calls) -> str:
    """The collectives of ``calls``, named once each with the ranks of their group."""
    names = sorted({(c["op"], c["ranks"]) for c in calls})
    return ", ".join(f"dist.{op} on {list(ranks)}" for op, ranks in names) or "none"


# -- on the ranks: the groups asked for, none made ------------------------------------

class Planned:
    """What ``dist.new_group`` returns while planning: the ranks asked for."""

    def __init__(self, ranks):
        self.ranks = tuple(sorted(ranks))


def plan(make_groups, node_of):
    """The ranks of every ``new_group`` call of ``make_groups(node_of)`` on this rank, in
    order, no group made; None if it cannot run without real groups (the real run then
    says what is wrong)."""
    asked = []

    def new_group(ranks=None, *args, **kwargs):
        asked.append(Planned(range(dist.get_world_size()) if ranks is None else ranks).ranks)
        return Planned(asked[-1])
    try:
        with _patch.patched({"new_group": new_group}):
            make_groups(list(node_of))
    except Exception:  # noqa: BLE001 - a stub, or code that needs a real group
        return None
    return asked


def same_plans(make_groups, node_of) -> list:
    """Every rank's ``plan``, gathered on every rank (one world collective)."""
    plans = [None] * dist.get_world_size()
    dist.all_gather_object(plans, plan(make_groups, node_of))
    return plans


# -- what is wrong, said once --------------------------------------------------------

def order_problem(plans, node_of) -> str | None:
    """Two ranks whose new_group calls differ, named; None when all that ran agree."""
    ran = [(rank, asked) for rank, asked in enumerate(plans) if asked is not None]
    differ = [(rank, asked) for rank, asked in ran[1:] if asked != ran[0][1]]
    if not differ:
        return None
    said = dict([ran[0], differ[0]])
    (first, mine), (rank, asked) = said.items()
    at = next((i for i, (a, b) in enumerate(zip(mine, asked)) if a != b),
              min(len(mine), len(asked)))
    call = "; ".join(f"rank {r} " + (f"asked for {list(c[at])}" if at < len(c) else
                                     f"made no more group ({len(c)} in all)")
                     for r, c in said.items())
    return (f"{describe(node_of)}: ranks {first} and {rank} called dist.new_group "
            f"differently, at call {at + 1}: {call}. new_group is collective over the "
            "whole world: every rank must make every group, those it is not in too, in "
            "the same order, or the real calls wait for each other forever. "
            + "; ".join(f"Rank {r} asked for {[list(g) for g in c]}" for r, c in said.items())
            + ".")


def group_problem(rank, got, node_of) -> str | None:
    """What is wrong with ``rank``'s (shard group, replicate group) ranks, or None."""
    want = expected_groups(rank, node_of)
    if tuple(got) == want:
        return None
    where = f"{describe(node_of)}, rank {rank} (on node {node_of[rank]}): "
    for kind, ranks in zip(("shard", "replicate"), got):
        if rank not in ranks:
            return where + (f"the {kind} group it returned, {list(ranks)}, does not hold "
                            f"rank {rank}: return the two groups this rank is in.")
    if got[0] != want[0]:
        return where + _shard_problem(got[0], want[0], node_of)
    return where + _replicate_problem(rank, got[1], want[1], node_of)


def _shard_problem(shard, want, node_of) -> str:
    spans = sorted({node_of[r] for r in shard})
    if len(spans) > 1:
        text = (f"its shard group {list(shard)} spans nodes {spans}: a shard group is "
                f"the ranks of one node, {list(want)} here, so that every step's "
                "all-gathers and reduce-scatters stay on the node's fast links.")
        if list(shard) == list(range(shard[0], shard[0] + len(shard))):
            text += (" Consecutive ranks share a node only when the scheduler placed the "
                     "ranks in blocks: read the nodes from node_of.")
        return text
    return (f"its shard group {list(shard)} leaves out rank(s) "
            f"{sorted(set(want) - set(shard))} of node {spans[0]}: a shard group is all "
            f"the ranks of one node, {list(want)} here.")


def _replicate_problem(rank, replicate, want, node_of) -> str:
    by_node = nodes(node_of)
    text = f"its replicate group {list(replicate)} "
    crowded = {n: [r for r in replicate if node_of[r] == n] for n in by_node}
    twice = {n: rs for n, rs in crowded.items() if len(rs) > 1}
    if twice:
        n, rs = next(iter(twice.items()))
        text += f"holds ranks {rs}, all on node {n}: it takes one rank from each node."
    elif missing := [n for n, rs in crowded.items() if not rs]:
        text += f"has no rank on node(s) {missing}: it takes one rank from each node."
    else:
        at = {r: by_node[node_of[r]].index(r) for r in replicate}
        text += ("pairs ranks at different positions on their nodes ("
                 + ", ".join(f"rank {r}: position {i} of node {node_of[r]}'s "
                             f"{by_node[node_of[r]]}" for r, i in at.items())
                 + "): a replicate group holds the ranks that keep the same shard, "
                 "those at the same position on every node.")
    return text + f" Rank {rank}'s is {list(want)}."
