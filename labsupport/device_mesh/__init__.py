"""Chapter 8, hybrid parallelism on a DeviceMesh.

- ``mesh``: the lesson (a rank grid, the groups along any axis, a 2-D and a 3-D step);
- ``planner``: the layout planner (memory, bytes per dimension, step time, MFU);
- ``crossing``: the dp reduction on a 2 x 2 grid beside the backward;
- ``checks``: the your-turn checks.

This package re-exports the lesson (the names the chapter defines).
"""
from labsupport.device_mesh.mesh import (
    TPMLP,
    average_grads,
    axis_groups,
    cube_groups,
    grid_coords,
    grid_groups,
    grid_ranks,
    hybrid_step,
    mlp_stack,
    step_3d,
    train_3d,
    train_device_mesh,
)

__all__ = ["TPMLP", "average_grads", "axis_groups", "cube_groups", "grid_coords", "grid_groups",
           "grid_ranks", "hybrid_step", "mlp_stack", "step_3d", "train_3d", "train_device_mesh"]
