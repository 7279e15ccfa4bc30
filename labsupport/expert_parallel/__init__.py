"""Chapter 9, expert parallelism.

- ``moe``: the lesson (router, top-k, capacity, all-to-all dispatch and combine);
- ``crossing``: the experts' compute beside dispatch + combine;
- ``checks``: the your-turn checks; ``bench``: ``python -m labsupport.bench moe``.

This package re-exports the lesson (the names the chapter defines).
"""
from labsupport.expert_parallel.moe import (
    AllToAll,
    ExpertParallelMoE,
    Experts,
    MoE,
    capacity,
    check_config,
    combine,
    exchange_counts,
    expert_major_order,
    expert_mlp,
    grouped_mm_runs,
    keep_mask,
    load_balancing_loss,
    route,
    sort_by_expert,
)

__all__ = ["AllToAll", "ExpertParallelMoE", "Experts", "MoE", "capacity", "check_config",
           "combine", "exchange_counts", "expert_major_order", "expert_mlp", "grouped_mm_runs",
           "keep_mask", "load_balancing_loss", "route", "sort_by_expert"]
