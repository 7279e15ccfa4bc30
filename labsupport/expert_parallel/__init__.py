"""Chapter 9, expert parallelism.

- ``moe``: the lesson (router, top-k, capacity, all-to-all dispatch and combine);
- ``crossing``: the experts' compute beside dispatch + combine;
- ``checks``: the your-turn checks; ``bench``: ``python -m labsupport.bench moe``.

This package re-exports the lesson (the names the chapter defines).
"""
from labsupport.expert_parallel.moe import (route, capacity, keep_mask,
                                            load_balancing_loss, expert_mlp,
                                            grouped_mm_runs, Experts, sort_by_expert,
                                            combine, MoE, AllToAll, exchange_counts,
                                            expert_major_order, check_config,
                                            ExpertParallelMoE)
