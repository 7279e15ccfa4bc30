"""What every chapter's time-beside-bytes sweep returns, and the curves it reads.

    from labsupport.data_parallel import crossing
    c = crossing.sweep(small=True)      # on ranks started here
    c.measured, c.formula, c.ratio      # crossing sizes, measured / formula

Each chapter topic has a ``crossing.py`` (``labsupport/<topic>/crossing.py``)
exposing ``sweep(small: bool) -> Crossing``: it times
the technique's compute and its communication from a recorded timeline
across a sweep of one size (tokens per rank, hidden size, block length...),
finds where the two measured curves cross (``overlap.measured_crossing``)
and where the formula puts the crossing for this machine, from this
machine's measured FLOP/s and link (``overlap``). The chapter shows the
same sweep with its defaults; ``python -m labsupport.bench overlap`` runs
every chapter's small sweep (its list, ``SWEEPS``, is there) and prints the ratios.
"""
import dataclasses
import statistics


@dataclasses.dataclass(frozen=True)
class Crossing:
    """One sweep: sizes, the two measured times (seconds, by size), the crossings."""
    technique: str
    size_label: str
    sizes: list
    compute: list
    comm: list
    measured: float | None      # where the measured curves cross (None: not in the sweep)
    formula: float | None       # the formula's crossing with this machine's numbers
    extra: dict = dataclasses.field(default_factory=dict)  # a technique's own numbers

    @property
    def ratio(self) -> float | None:
        """measured / formula crossing; None when either is missing."""
        if not self.measured or not self.formula:
            return None
        return self.measured / self.formula



def curves(sizes, by_rank, comm_times):
    """Per size, from each rank's rows ``{"events": {overlap: [run's events]},
    "seconds": {overlap: [run's seconds]}}``: the median compute span (lane
    "compute", runs without overlap), the median transfer (``comm_times(runs)``
    gives one time per run; the rank that waited least per run waited only for
    the wire), the median speed-up of the slowest rank with overlap, and both
    runs' last events. Returns (compute, comm, speedup, events)."""
    compute, comm, speedup, events = [], [], [], {}
    for i, size in enumerate(sizes):
        rows = [rank[i] for rank in by_rank]
        compute.append(statistics.median(
            e["end"] - e["start"] for r in rows for run in r["events"][False]
            for e in run if e["lane"] == "compute"))
        waits = [comm_times(r["events"][False]) for r in rows]
        comm.append(statistics.median(map(min, zip(*waits))))
        slowest = {on: list(map(max, zip(*(r["seconds"][on] for r in rows))))
                   for on in (False, True)}
        speedup.append(statistics.median(a / b for a, b in zip(slowest[False],
                                                               slowest[True])))
        events[size] = {on: [e for r in rows for e in r["events"][on][-1]]
                        for on in (False, True)}
    return compute, comm, speedup, events
