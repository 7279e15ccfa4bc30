"""Where a step's time goes, from a rank's recorded timeline and calls.

    outs = ls.run(trainer.train, layout, steps, record_timeline=True, world_size=n)
    breakdown.step_parts(outs[0])        # {"tp": s, "dp x cp": s, ..., "other": s}
    breakdown.mean_parts(outs)           # the same, averaged over the ranks

``train(..., record_timeline=True)`` returns the last step's timeline:
chapter 5's spans (forward and backward "compute", the "wait" for a
neighbour stage, the "post" of sends), the sync's and the optimizer's spans,
and every torch.distributed call of the step (``calls.record``: group,
start, end), all on one clock. Each instant of the step goes to one part,
the first of ``PARTS`` that covers it:

- "tp": a collective on the rank's tp group (sequence parallelism's
  all-gathers and reduce-scatters, the f/g all-reduces, the SP gradients'
  all-reduce): the rank waits for it;
- "dp x cp": a collective on the dp x cp ranks, or on its dp or its cp
  group alone (the gradient all-reduce in chapter 3's buckets, the loss's);
- "pp wait": waiting for a neighbour stage's activation or gradient, posting
  the sends, broadcasting the loss: the pipeline's bubble and its transfers
  (chapter 5 measures the bubble from the same "wait" lane);
- "cp ring": a ring-attention transfer in flight (chapter 6): it runs while
  the previous block's attention computes, so this is what cp costs at most;
- "compute": the rest of the forward, backward and optimizer spans;
- "other": the rest of the step (Python between spans).

The rest of the gradient sync's span (flattening the buckets, dividing,
copying back) is the work of the reductions it made: it goes to "dp x cp"
if the sync called a collective on that dimension's groups, else to "tp"
if it called one on tp, else to "compute" (a sync that reduced nothing, as
at 1 x 1 x 1 x 1, did local work only). A collective on a group of one
rank moves nothing and is booked to no group. Each part is thus the group
the recorded calls really used, never a group the layout does not have.

Ranks that share a machine's cores also wait for a core inside "compute":
on 2 cores and 8 ranks, a rank's compute span is several ranks' work.
"""
from labsupport.capstone.layout import Layout, layout_groups

PARTS = ("tp", "dp x cp", "pp wait", "cp ring", "compute", "other")


def intervals(out) -> dict:
    """{part: [(start, end), ...]} of one rank's recorded step (``train``'s
    result with ``record_timeline=True``), before precedence."""
    tl, rank = out["timeline"], out["rank"]
    if tl is None:
        raise ValueError("no timeline: run train(..., record_timeline=True)")
    layout = Layout(*out["layout"])
    mine = {name: tuple(next(g for g in groups if rank in g))
            for name, groups in layout_groups(layout).items()}
    part_of = {mine["tp"]: "tp", mine["pp"]: "pp wait", mine["dp_cp"]: "dp x cp",
               mine["dp"]: "dp x cp", mine["cp"]: "dp x cp"}
    parts = {p: [] for p in PARTS}
    for c in tl["calls"]:
        span, ranks = (c["start"], c["end"]), tuple(c["ranks"])
        if c["kind"] == "collective":
            if len(ranks) > 1 and ranks in part_of:   # a group of one moves nothing
                parts[part_of[ranks]].append(span)
        elif c["peer"] in mine["cp"] and c["peer"] != rank:
            parts["cp ring"].append(span)
    for e in tl["events"]:
        span = (e["start"], e["end"])
        if e["lane"] == "wait" or e["name"] == "post":
            parts["pp wait"].append(span)
        elif e["name"] == "sync":
            parts[sync_part(parts, span)].append(span)
        elif e["lane"] == "compute":
            parts["compute"].append(span)
    parts["other"].append((tl["start"], tl["end"]))
    return parts


def sync_part(parts, span) -> str:
    """The part the gradient sync's own work goes to: that of the reductions it
    made (their calls in ``parts`` inside ``span``), dp x cp before tp; none:
    "compute"."""
    inside = {p for p in ("dp x cp", "tp")
              if any(span[0] <= s and e <= span[1] for s, e in parts[p])}
    return next((p for p in ("dp x cp", "tp") if p in inside), "compute")


def step_parts(out) -> dict:
    """{part: seconds} of one rank's step: each instant given to the first
    part of ``PARTS`` that covers it; the parts add up to the step."""
    parts = intervals(out)
    lo, hi = out["timeline"]["start"], out["timeline"]["end"]
    cuts = sorted({lo, hi, *(t for spans in parts.values() for s in spans for t in s
                             if lo < t < hi)})
    total = dict.fromkeys(PARTS, 0.0)
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        for p in PARTS:
            if any(s <= mid < e for s, e in parts[p]):
                total[p] += b - a
                break
    return total


def mean_parts(outs) -> dict:
    """``step_parts`` averaged over the ranks of one run."""
    each = [step_parts(o) for o in outs]
    return {p: sum(e[p] for e in each) / len(each) for p in PARTS}
