"""Which rank is late: read from each rank's time inside its collectives (chapter 12's lesson).

    from labsupport.debugging import straggler
    straggler.waits(collective_times)     # {rank: seconds spent inside collectives}
    straggler.late_rank(collective_times) # the rank that waits least: the others wait for it

A collective ends on every rank at about the same moment (when the last
rank's data has arrived), so the time a rank spends inside it is how long it
waited for the latest one. The late rank waits least. Per-rank phase times
hide it: its extra time is spent before the collective, and the collective
evens the ranks out, so every rank's step takes as long and the others'
"communication" phase grows instead of its own (traceopt-ai/traceml #252).
``collective_times``: {rank: [{seq, op, group, enter, exit}, ...]}, on one clock
(the call recorder's, ``labsupport.calls``; the artefacts' shape, ``gather``).
"""

# --- lesson: notebooks/12_debugging_distributed_runs.ipynb (the notebook's copy must match) ---


def waits(collective_times):
    """{rank: seconds this rank spent inside its collectives, over the whole run}."""
    return {rank: sum(c["exit"] - c["enter"] for c in calls)
            for rank, calls in collective_times.items()}


def late_rank(collective_times):
    """The rank the others waited for: the one that spent least time inside the
    collectives they shared (it arrived last, so its wait was the shortest)."""
    wait = waits(collective_times)
    return int(min(wait, key=wait.get))

# --- end of lesson ---
