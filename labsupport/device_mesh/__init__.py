"""Chapter 8, hybrid parallelism on a DeviceMesh.

- ``mesh``: the lesson (a rank grid, the groups along any axis, a 2-D and a 3-D step);
- ``planner``: the layout planner (memory, bytes per dimension, step time, MFU);
- ``crossing``: the dp reduction on a 2 x 2 grid beside the backward;
- ``checks``: the your-turn checks.

This package re-exports the lesson (the names the chapter defines).
"""
from labsupport.device_mesh.mesh import (grid_coords, grid_ranks, grid_groups,
                                         axis_groups, average_grads, hybrid_step,
                                         train_device_mesh, TPMLP, mlp_stack,
                                         cube_groups, step_3d, train_3d)
