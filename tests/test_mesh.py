# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_mesh.py
"""labsupport.mesh, chapter 8's (dp, tp) grid, through the launcher at 4 ranks.

The hand-made grid and the DeviceMesh + FSDP2 version against one process
training on the full batch (parameters after K SGD steps, fp32); the groups
each rank's collectives use; the bytes per group against the formula; the
your-turn checks with right and wrong answers; the notebook's copy of the
lesson being the package's, character for character.
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import labsupport as ls
from labsupport import memory, mesh, models
from nbtools import assert_lesson_copy

CFG = models.GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2)
BATCH, STEPS, LR, DP, TP = 4, 3, 0.05, 2, 2
BATCHES = [models.toy_tokens(BATCH, CFG.seq_len, CFG.vocab_size, seed=1 + k)
           for k in range(STEPS)]
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32: the same sums in another order
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def cluster():
    c = ls.start(world_size=DP * TP, backend="gloo")
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def grid_run(cluster):
    return cluster.run(_grid)


def _grid():
    params, log = mesh.train_grid(CFG, BATCHES, LR, DP, TP, log=True)
    local = sum(p.numel() * p.element_size() for p in params.values())  # tied: once
    return params, log, local


def test_grid_coords_and_ranks():
    assert [mesh.grid_coords(r, 2) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert mesh.grid_ranks(2, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert mesh.grid_ranks(2, 4)[1] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_hand_made_grid_equals_one_process(grid_run):
    ref = mesh.reference_params(CFG, BATCHES, LR)
    for rank, (params, _, _) in enumerate(grid_run):
        shapes = {n: p.shape for n, p in params.items()}
        _, tp_rank = mesh.grid_coords(rank, TP)
        for name, got in params.items():
            want = _slice(ref[name], shapes[name], tp_rank)
            torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{name}: {m}")


def _slice(full, shape, tp_rank):
    for dim, (a, b) in enumerate(zip(full.shape, shape)):
        if a != b:
            return full.chunk(a // b, dim)[tp_rank]
    return full


def test_device_mesh_and_fsdp2_equal_one_process(cluster):
    ref = mesh.reference_params(CFG, BATCHES, LR)
    for params in cluster.run(mesh.train_device_mesh, CFG, BATCHES, LR, DP, TP):
        assert set(params) == set(ref)
        for name, got in params.items():
            torch.testing.assert_close(got, ref[name], **TOL, msg=lambda m: f"{name}: {m}")


def test_each_rank_talks_only_to_its_row_and_column(grid_run):
    rows, columns = mesh.grid_ranks(DP, TP)
    for rank, (_, log, _) in enumerate(grid_run):
        dp_rank, tp_rank = mesh.grid_coords(rank, TP)
        assert {c["ranks"] for c in log.calls} == {tuple(rows[dp_rank]),
                                                  tuple(columns[tp_rank])}


def test_bytes_per_group_match_the_formula(grid_run):
    b, s, h, v = BATCH // DP, CFG.seq_len, CFG.hidden, CFG.vocab_size
    tp_bytes = ((4 * CFG.layers + 2) * b * s * h + b * s * v) * 4   # fp32
    for rank, (params, log, local) in enumerate(grid_run):
        dp_rank, tp_rank = mesh.grid_coords(rank, TP)
        by_group = log.bytes_by_group()
        row, column = mesh.grid_ranks(DP, TP)[0][dp_rank], mesh.grid_ranks(DP, TP)[1][tp_rank]
        assert by_group[tuple(row)] == STEPS * tp_bytes
        assert by_group[tuple(column)] == STEPS * local


def test_cube_ranks_one_group_per_axis_through_each_rank():
    groups = mesh.cube_ranks(2, 2, 2)
    assert groups == {"dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
                      "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                      "tp": [[0, 1], [2, 3], [4, 5], [6, 7]]}
    assert mesh.cube_ranks(2, 1, 2) == {"dp": [[0, 2], [1, 3]], "pp": [[0], [1], [2], [3]],
                                        "tp": [[0, 1], [2, 3]]}


def test_a_wrong_grid_size_says_how_many_ranks(cluster):
    with pytest.raises(ls.RankError, match="a 3 x 2 grid needs 6 ranks"):
        cluster.run(mesh.grid_groups, 3, 2)


def test_memory_module_counts_the_same_local_bytes(cluster):
    def local_bytes():
        tp_group, _ = mesh.grid_groups(DP, TP)
        from labsupport.tp_gpt import TensorParallelGPT
        return memory.storage_bytes(TensorParallelGPT(models.GPT(CFG, seed=0),
                                                      tp_group).parameters())
    for got, (_, _, local) in zip(cluster.run(local_bytes), cluster.run(_grid)):
        assert got == local


# -- the your-turn checks, right and wrong ---------------------------------------------

def test_coords_check_passes_the_solution_and_names_a_swapped_answer():
    mesh.check_grid_coords(mesh.grid_coords)
    with pytest.raises(AssertionError, match=r"rank 1 -> \(1, 0\), expected .* \(0, 1\)"):
        mesh.check_grid_coords(lambda rank, tp: (rank % tp, rank // tp))


def _world_average(model, dp_group):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def _sum_only(model, dp_group):
    for p in model.parameters():
        dist.all_reduce(p.grad, group=dp_group)


def test_average_check_passes_the_solution(cluster):
    cluster.run(mesh.check_average_grads, mesh.average_grads)


@pytest.mark.parametrize("wrong, message", [
    (_world_average, "averaged over the whole world"),
    (_sum_only, "summed but not divided")])
def test_average_check_names_the_mistake(cluster, wrong, message):
    with pytest.raises(ls.RankError, match=message):
        cluster.run(mesh.check_average_grads, wrong)


# -- the notebook's copy of the lesson is the package's ---------------------------

def test_the_notebook_copy_is_the_package_code():
    assert_lesson_copy(mesh)


# -- last: 8 ranks, a new group of processes (the 4-rank cluster above ends) ----------

def _mlp_data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 3, 8, generator=g), torch.randn(4, 3, 8, generator=g))
            for _ in range(STEPS)]


@pytest.mark.parametrize("dp, pp, tp", [(1, 2, 2), (2, 2, 2)])
def test_the_3d_step_equals_one_process(dp, pp, tp):
    batches = _mlp_data()
    ref = mesh.reference_3d(pp, 8, batches, LR)
    split = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}
    runs = ls.run(mesh.train_3d, dp, pp, tp, 8, batches, LR, world_size=dp * pp * tp)
    for rank, params in enumerate(runs):
        stage, tp_rank = rank // tp % pp, rank % tp
        for name, got in params.items():
            want = ref[stage][name]
            want = want.chunk(tp, split[name])[tp_rank] if name in split else want
            torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")
