"""Chapter 7, ZeRO and FSDP.

- ``zero``: the lesson (flat buffers, ZeRO-1/2 steps, ZeRO-3 with prefetch);
- ``args``: what the flat buffers and ZeRO-3's units accept (errors that say what to do);
- ``sharded_optimizer``: ``ShardedOptimizer``, ZeRO-1 around any torch optimizer;
- ``crossing``: a block's forward beside its all-gather, and prefetch's speed-up;
- ``checks``: the your-turn checks; ``bench``: ``python -m labsupport.bench zero``.

This package re-exports the lesson (the names the chapter defines).
"""
from labsupport.zero.zero import FlatParams, Zero3, zero_step

__all__ = ["FlatParams", "Zero3", "zero_step"]
