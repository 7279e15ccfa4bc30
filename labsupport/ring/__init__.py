"""Chapter 2, the ring all-reduce.

- ``ring``: the lesson (whole-buffer ring, ring reduce-scatter + all-gather, pipelined);
- ``checks``: the your-turn checks; ``bench``: ``python -m labsupport.bench ring``.

This package re-exports the lesson (the names the chapter defines).
"""
from labsupport.ring.ring import (
    SEGMENT_BYTES,
    WINDOW,
    arrivals,
    exchange,
    finish,
    landing,
    pass_along,
    ring_allreduce,
    ring_allreduce_naive,
    ring_allreduce_simple,
)

__all__ = ["SEGMENT_BYTES", "WINDOW", "arrivals", "exchange", "finish", "landing", "pass_along",
           "ring_allreduce", "ring_allreduce_naive", "ring_allreduce_simple"]
