"""Assignment 9's traffic: the bytes a rank's sync sent against what its layout needs.

Counted the way a ring moves them (chapter 2: an all-reduce of S bytes over n
ranks sends 2(n-1)/n·S per rank) from the calls ``labsupport.calls``
recorded at step 0; no clock is read. The layout needs the partial gradients
under SP summed over tp, every gradient averaged over dp x cp, the tied weight
summed over its embedding group.
"""
from labsupport.capstone.layout import Layout
from labsupport.grading.grad_sync_4d.config import TIED


def needed(out) -> dict:
    """{group name: payload bytes} of the reductions rank ``out`` must take part in."""
    layout = Layout(*out["layout"])
    nbytes = {n: g.numel() * g.element_size() for n, g in out["grads"].items()}
    need = {}
    if layout.tp > 1 and out["sp"]:
        need["tp"] = sum(nbytes[n] for n in out["sp"])
    if layout.dp * layout.cp > 1:
        need["dp_cp"] = sum(nbytes.values())
    if layout.pp > 1 and TIED in nbytes:
        need["embedding"] = nbytes[TIED]
    return need


def needed_bytes(out) -> float:
    """What a ring sends per rank for ``needed(out)``: 2(n-1)/n of each payload."""
    sizes = {name: len(ranks or ()) for name, ranks in out["group_ranks"].items()}
    return sum(2 * (sizes[n] - 1) / sizes[n] * b for n, b in needed(out).items())


_FACTOR = {"all_reduce": 2, "broadcast": 1, "reduce": 1}   # others: 1 (gather, scatter)


def sent(recorded) -> float:
    """Bytes a rank sends for its recorded calls: point-to-point payloads, and
    each collective as a ring moves it, factor·(n-1)/n of its payload."""
    total = 0.0
    for c in recorded:
        n = len(c["ranks"])
        if c["kind"] == "p2p":
            total += c["nbytes"] if "send" in c["op"] else 0
        else:
            total += _FACTOR.get(c["op"], 1) * (n - 1) / n * c["nbytes"]
    return total


def _group_name(ranks, out) -> str:
    """The layout's name for a group of ranks, as the student's ``groups`` has it."""
    ranks = tuple(sorted(ranks))
    for name in ("tp", "dp_cp", "embedding", "dp", "cp", "pp"):
        if tuple(sorted(out["group_ranks"][name] or ())) == ranks:
            return name
    if len(ranks) == Layout(*out["layout"]).world_size:
        return "the world"
    return f"the group of ranks {list(ranks)}"


def message(over, layout) -> str:
    o = over[0]
    need = needed(o)
    used = {}
    for c in o["calls"]:
        if c["kind"] == "collective" or "send" in c["op"]:
            name = _group_name(c["ranks"], o)
            used[name] = used.get(name, 0) + sent([c])
    extra = [n for n in used if n not in need and used[n] > 0]
    sizes = {n: len(r or ()) for n, r in o["group_ranks"].items()}
    mine = ", ".join(f"{n} {b:.0f} B" for n, b in used.items()) or "nothing"
    want = ", ".join(f"{n} {2 * (sizes[n] - 1) / sizes[n] * b:.0f} B"
                     for n, b in need.items()) or "nothing"
    text = (f"rank {o['rank']} sent {sent(o['calls']):.0f} B for the gradients' "
            f"synchronisation (ring bytes: 2(n-1)/n of each all-reduce's payload), "
            f"where the layout needs {needed_bytes(o):.0f} B; by group: {mine}; "
            f"needed: {want}. ")
    if extra:
        text += ("Unnecessary groups: " + ", ".join(extra) + ". ")
    text += ("Reduce each gradient only over the ranks whose copies must be "
             "combined: the partial ones of sequence parallelism over tp, every one "
             "averaged over dp x cp in one all-reduce (dp_cp, not dp then cp), the "
             "tied weight summed over its embedding group (the two ranks holding it, "
             "not every stage).")
    others = sorted({x["rank"] for x in over} - {o["rank"]})
    if others:
        text += f" Ranks {others} too."
    return text
