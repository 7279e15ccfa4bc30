"""Chapter 3, data parallelism.

- ``ddp``: the lesson (naive, overlapped and bucketed data parallelism);
- ``probe``: what DDP does, recorded (its all-reduces, their timeline);
- ``profiling``: a profiler trace read for the chapter's timeline;
- ``crossing``: the backward beside the gradient all-reduce (time beside bytes);
- ``checks``: the your-turn checks; ``bench``: ``python -m labsupport.bench ddp``.

This package re-exports the lesson (the names the chapter defines).
"""
from labsupport.data_parallel.ddp import (
    DataParallelBucket,
    DataParallelNaive,
    DataParallelOverlap,
    broadcast_parameters,
    bucket_params,
)

__all__ = ["DataParallelBucket", "DataParallelNaive", "DataParallelOverlap",
           "broadcast_parameters", "bucket_params"]
