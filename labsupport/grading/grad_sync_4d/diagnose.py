"""What is wrong with a student's sync or groups (assignment 9, parts 1 and 2).

``parity_problem``: the first gradient that differs from one process's and the
reduction that explains it (a group named, and for the tied weight the stages:
not summed across the stages, averaged instead of summed, or summed onto one
stage only, the other keeping its own part or what ``dist.reduce`` left
there). ``groups_problem``: what a rank's embedding group should have held.
The norms of part 3 are ``norms``'. Everything here compares tensors and
numbers; nothing reads a clock.
"""
from labsupport.capstone import compare
from labsupport.capstone.layout import Layout
from labsupport.grading.grad_sync_4d.config import TIED

GRAD_FACTOR = 10      # a factor holds within GRAD_RTOL x this (compare's reading)


def parity_problem(outs, ref, layout) -> str | None:
    """None if every rank's gradients at step 0 and the losses are one process's."""
    for o in outs:
        if o["missing"]:
            return (f"after your sync rank {o['rank']}'s {', '.join(o['missing'][:3])} "
                    "had no gradient (.grad is None): leave every gradient in its "
                    "parameter's .grad")
        for n, g in o["grads"].items():
            want = compare.local_slice(ref["grads"][n], o["shards"][n])
            if g.shape != want.shape or g.dtype != want.dtype:
                return (f"after your sync rank {o['rank']}'s {n}.grad is a {g.dtype} "
                        f"tensor of shape {tuple(g.shape)}, where its parameter is "
                        f"{want.dtype} {tuple(want.shape)}: keep each gradient the "
                        "shape of its parameter's shard")
    diffs = compare.grad_differences([dict(o, grads={0: o["grads"]}) for o in outs],
                                     ref["grads"], 0)
    bad = [n for n in ref["grads"] if n in diffs and diffs[n][1]]
    if bad:
        name = bad[0]
        ranks = diffs[name][1]
        why = explain(outs, ref["grads"], name, ranks, layout, alone=len(bad) == 1)
        more = f" ({len(bad) - 1} other parameters differ too)" if len(bad) > 1 else ""
        return (f"the gradient of {_label(name)} after your sync differs from one "
                f"process's on ranks {ranks}, by up to {diffs[name][0]:.2g} of its "
                f"largest entry{more}. {why}")
    return losses_problem(outs, ref)


def losses_problem(outs, ref) -> str | None:
    for k, (a, b) in enumerate(zip(outs[0]["losses"], ref["losses"])):
        if abs(a - b) > compare.LOSS_RTOL * abs(b):
            return (f"the gradients of step 0 are right, but the loss of step {k} is "
                    f"{a:.6f} where one process has {b:.6f}: every step must be "
                    "synchronised the same way (and only the gradients changed)")
    return None


def _label(name):
    if name == TIED:
        return (f"{TIED} (the token embedding, tied to the LM head: lm_head.weight on "
                "the last stage)")
    return name


def _close(a, b):
    scale = max(b.abs().max().item(), 1e-30)
    return (a - b).abs().max().item() / scale < compare.GRAD_RTOL * GRAD_FACTOR


def explain(outs, ref, name, ranks, layout, alone=False) -> str:
    """Which reduction explains the difference of ``name`` on ``ranks``; ``alone``:
    no other parameter differs (so a mistake of the tied weight's own)."""
    layout = Layout(*layout)
    local = {o["rank"]: o["grads"][name] for o in outs if name in o["grads"]}
    want = {o["rank"]: compare.local_slice(ref[name], o["shards"][name])
            for o in outs if name in o["grads"]}
    coords = {o["rank"]: layout.coords(o["rank"]) for o in outs}
    if name == TIED:
        tied = _tied(outs, local, want, coords, ranks, layout, alone)
        if tied:
            return tied
    return _reduction(outs, local, want, coords, name, ranks, layout)


def _stages(ranks, coords, layout) -> str:
    """'the first stage (ranks [0, 1]) and the last (ranks [4, 5])', of ``ranks``."""
    first = [r for r in ranks if coords[r].pp == 0]
    last = [r for r in ranks if coords[r].pp == layout.pp - 1]
    parts = ([f"the first stage (ranks {first})"] if first else []) + (
        [f"the last stage (ranks {last})"] if last else [])
    return " and ".join(parts)


def _tied(outs, local, want, coords, ranks, layout, alone) -> str | None:
    """The tied weight's own mistakes: across the stages (pp > 1) or on one (pp = 1)."""
    if layout.pp == 1:
        if all(_close(local[r], want[r] * 2) for r in ranks):
            return ("It is twice the one-process gradient. With pp = 1 the embedding "
                    "and the LM head are one Parameter on one stage: autograd has "
                    "already summed both uses, so there is nothing to add across "
                    "stages (and the embedding group is this rank alone).")
        return None
    if alone and all(_close(local[r] * 2, want[r]) for r in ranks):  # (a+b)/2 each
        return (f"It is half the one-process gradient on {_stages(ranks, coords, layout)}"
                ": the embedding group's two copies were averaged, not summed. Each "
                "stage holds a different use's part (the embedding's, the LM head's) and "
                "the tied weight's gradient is their sum: all_reduce over "
                "groups['embedding'] with no division (its ranks hold two different "
                "uses, not replicas that saw other tokens, as dp x cp's ranks are).")
    if _summed_over(local, want, coords, ranks, ("pp",)):
        return ("The first stage's gradient (the embedding's use) plus the last "
                "stage's (the LM head's) is the one-process gradient: the tied "
                "weight's two copies must be summed over the embedding group, "
                "groups['embedding'] (the first and last stage's ranks of the same dp, "
                "cp and tp), so that both stages step it the same way.")
    if not alone:
        return None
    ends = {coords[r].pp for r in ranks}
    others = [r for r in local if coords[r].pp not in ends]   # the other end: right
    if len(ends) > 1 or not others:
        return None
    # One end is right (the sum), the other not: the sum reached one end only.
    before = {o["rank"]: o["before"][TIED] for o in outs if TIED in o["before"]}
    own = all(_close(local[r], _replica_mean(before, coords, r)) for r in ranks)
    what = ("that stage's own part alone (what backward left there, averaged over "
            "dp x cp)" if own else "neither the sum nor that stage's own part")
    reduced = any(c["op"] == "reduce" for o in outs for c in o["calls"])
    note = (" Your sync called dist.reduce: only its destination receives the sum; "
            "what the other ranks' tensors hold after it is left to the algorithm "
            "(their own part, or a partial sum)." if reduced else "")
    return (f"On {_stages(ranks, coords, layout)} it is {what}, while "
            f"{_stages(others, coords, layout)} holds the sum: the sum reached one end "
            f"of the embedding group only.{note} Both copies must hold the sum, or the "
            "two stages step different weights: dist.all_reduce over "
            "groups['embedding'].")


def _summed_over(local, want, coords, ranks, axis) -> bool:
    """The sum over each group of ``axis`` (the ranks differing only there) is the
    reference, for every group holding one of ``ranks``."""
    groups = {}
    for r in local:
        c = coords[r]
        key = tuple(v for a, v in zip(c._fields, c) if a not in axis)
        groups.setdefault(key, []).append(r)
    return all(_close(sum(local[r] for r in g), want[g[0]])
               for g in groups.values() if any(r in ranks for r in g))


def _reduction(outs, local, want, coords, name, ranks, layout) -> str:
    sp = {o["rank"]: name in o["sp"] for o in outs}

    def factor(k):
        return k > 1 and all(_close(local[r], want[r] * k) for r in ranks)

    dp, cp, tp = layout.dp, layout.cp, layout.tp
    if tp > 1 and any(sp[r] for r in ranks) and _summed_over(local, want, coords, ranks,
                                                             ("tp",)):
        return ("Its sum over the tp group is the one-process gradient: under sequence "
                "parallelism each tp rank's LayerNorms (and row-parallel biases, the "
                "position embedding) saw only its s/tp positions, so their gradients "
                "are partial and must be summed over tp, not averaged.")
    if dp * cp > 1 and all(_close(_replica_mean(local, coords, q), want[q])
                           for q in ranks):
        return (f"The mean over the {dp * cp} dp x cp ranks is the one-process "
                "gradient: each of them saw different tokens (rows for dp, positions "
                "for cp), so every gradient must be averaged over dp_cp (a sum, then "
                "/ dp·cp).")
    readings = [(dp * cp, f"summed over dp x cp but not divided by dp·cp = {dp * cp}"),
                (cp, f"divided by dp = {dp} only: the cp ranks also saw different "
                     f"tokens (their positions), so divide by dp·cp = {dp * cp}"),
                (dp, f"divided by cp = {cp} only: divide by dp·cp = {dp * cp}"),
                (tp, "summed over tp once too often, or a tp sum applied to a "
                     "gradient that is not partial"),
                (2, "counted twice")]
    for k, text in readings:
        if factor(k):
            return f"It is {k} times the one-process gradient: {text}."
    for k, _ in readings[:3]:
        if k > 1 and all(_close(local[r] * k, want[r]) for r in ranks):
            return (f"It is 1/{k} of the one-process gradient: divided by {k} once too "
                    "often (average over dp x cp = a sum, then one division by dp·cp).")
    return ("No missing or doubled reduction over one group explains it: check "
            "which parameters are partial under sequence parallelism (sum over tp), "
            "that every gradient is averaged over dp x cp, and that only the tied "
            "weight is summed over the embedding group.")


def _replica_mean(local, coords, q):
    """The mean of ``local`` over the ranks holding rank q's piece of the model
    (those that differ from it in dp and cp only)."""
    piece = (coords[q].pp, coords[q].tp)
    same = [r for r in local if (coords[r].pp, coords[r].tp) == piece]
    return sum(local[r] for r in same) / len(same)


# -- the embedding groups ------------------------------------------------------------

def groups_problem(outs, truth, layout) -> str | None:
    """None if each rank returned its embedding group (``truth``: every group's
    ranks), None on a middle stage."""
    layout = Layout(*layout)
    for o in sorted(outs, key=lambda o: o["rank"]):
        r, c = o["rank"], layout.coords(o["rank"])
        want = next((g for g in truth if r in g), None)
        if want is None:
            if o["kind"] != "NoneType":
                return (f"rank {r} is on a middle stage (pp rank {c.pp} of {layout.pp}): "
                        f"it holds no tied weight and is in no embedding group, so "
                        f"embedding_group returns None there, not "
                        f"{o['ranks'] if o['ranks'] else o['kind']}")
            continue
        if o["ranks"] is None:
            alone = (" With pp = 1 the first stage is the last: the group is this "
                     "rank alone." if layout.pp == 1 else "")
            got = "None" if o["kind"] == "NoneType" else (
                "a group it is not a member of" if o["kind"] == "not a member"
                else f"a {o['kind']}")
            return (f"rank {r} (dp {c.dp}, pp {c.pp}, cp {c.cp}, tp {c.tp}) got {got} "
                    f"from embedding_group, where its embedding group is ranks {want}: "
                    f"return the ProcessGroup dist.new_group made for it.{alone}")
        if sorted(o["ranks"]) != want:
            return (f"rank {r}'s group holds ranks {sorted(o['ranks'])}, where its "
                    f"embedding group is {want}: the first and the last stage's ranks "
                    f"with rank {r}'s dp, cp and tp coordinates (dp {c.dp}, cp {c.cp}, "
                    f"tp {c.tp}; ranks fill the mesh (dp, pp, cp, tp), tp fastest: "
                    "layout.rank(coords)).")
        if o["summed"] != len(want):
            return (f"rank {r}'s group summed {o['summed']:g} ones over {len(want)} ranks")
    return None
