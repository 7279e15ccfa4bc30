# Run: .venv/bin/python -m pytest tests/test_gloo_threads.py   (~15 s on 2 cores)
"""labsupport.launch.gloo_threads: gloo's event-loop threads run at nice NICE in
every gloo rank, those of groups made later (new_group, a DeviceMesh) too, and
nothing else in the rank changes priority. (What it buys is time, which no
test may judge; the measurement and its command are in the module's report.)
"""
import os

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import labsupport as ls
from labsupport.launch import gloo_threads


def _priorities():
    """{thread name: sorted nice values} of this rank's threads."""
    out = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                name = f.read().strip()
            out.setdefault(name, []).append(os.getpriority(os.PRIO_PROCESS, int(task)))
        except OSError:
            continue
    return {name: sorted(nices) for name, nices in out.items()}


def _loops_after_groups():
    base = os.getpriority(os.PRIO_PROCESS, 0)  # the rank's own (nice may run the suite)
    before = _priorities()
    group = dist.new_group(list(range(dist.get_world_size())))
    dist.barrier(group=group)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    dist.barrier(group=mesh.get_group("dp"))
    return base, before, _priorities()


def test_every_gloo_loop_runs_at_nice_ten_and_nothing_else_moves():
    runs = ls.run(_loops_after_groups, world_size=2, backend="gloo")
    for base, before, after in runs:
        loops = after[gloo_threads.LOOP]
        assert len(loops) > len(before[gloo_threads.LOOP]) >= 1  # new groups' loops
        assert set(loops) == {max(base, gloo_threads.NICE)}
        others = {n for name, nices in after.items() if name != gloo_threads.LOOP
                  for n in nices}
        assert others == {base}, after
