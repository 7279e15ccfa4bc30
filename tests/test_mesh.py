# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_mesh.py
"""labsupport.device_mesh.mesh, chapter 8's lesson, through the launcher at 4 and 8 ranks.

The hand-made grid and the DeviceMesh + FSDP2 version against one process
training on the full batch (parameters after K SGD steps, fp32); the groups
each rank's collectives use; the bytes per group against the formula; the
groups of any mesh axis against Megatron Core's documented example and
DeviceMesh's own groups; the planner's context-parallel bytes against ring
attention's sends; the notebook's copy of the lesson being the package's,
character for character, and its solution cells collapsed.
"""
import sys

import cloudpickle
import nbformat
import pytest
import torch
import torch.distributed as dist

import labsupport as ls
from labsupport import calls, models, traffic
from labsupport.context_parallel import ring_attention
from labsupport.device_mesh import checks, mesh, planner
from labsupport.memory import calc as memory_calc
from labsupport.memory import tally
from labsupport.tensor_parallel.gpt import TensorParallelGPT
from nbtools import NOTEBOOK_DIR, assert_lesson_copy

CFG = models.GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2)
BATCH, STEPS, LR, DP, TP = 4, 3, 0.05, 2, 2
BATCHES = [models.toy_tokens(BATCH, CFG.seq_len, CFG.vocab_size, seed=1 + k)
           for k in range(STEPS)]
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32: the same sums in another order
NOTEBOOK = NOTEBOOK_DIR / "08_device_mesh.ipynb"
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
    """K hybrid steps on the hand-made grid: this rank's parameters, its recorded
    calls and its parameter bytes (tied weights once)."""
    tp_group, dp_group = mesh.grid_groups(DP, TP)
    model = TensorParallelGPT(models.GPT(CFG, seed=0), tp_group)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with calls.record() as log:
        for ids, targets in BATCHES:
            mesh.hybrid_step(model, opt, ids, targets, dp_group)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, log, sum(p.numel() * p.element_size() for p in params.values())


def test_grid_coords_and_ranks():
    assert [mesh.grid_coords(r, 2) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert mesh.grid_ranks(2, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert mesh.grid_ranks(2, 4)[1] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_axis_groups_are_megatrons_documented_groups_and_devicemeshs_rule():
    # initialize_model_parallel's docstring (megatron/core/parallel_state.py):
    # 16 GPUs, tp 2, pp 4, order tp-dp-pp -> shape (pp, dp, tp) = (4, 2, 2).
    assert mesh.axis_groups((4, 2, 2), 0) == [[0, 4, 8, 12], [1, 5, 9, 13],
                                               [2, 6, 10, 14], [3, 7, 11, 15]]
    assert mesh.axis_groups((4, 2, 2), 1)[:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.axis_groups((4, 2, 2), 2)[:3] == [[0, 1], [2, 3], [4, 5]]
    for shape in checks.SHAPES + [(3, 2, 1, 2), (5,)]:
        for axis in range(len(shape)):
            assert mesh.axis_groups(shape, axis) == checks.mesh_groups(shape, axis)
    assert mesh.axis_groups((2, 2), 0) == mesh.grid_ranks(2, 2)[1]


def test_hand_made_grid_equals_one_process(grid_run):
    ref = checks.reference_params(CFG, BATCHES, LR)
    for rank, (params, _, _) in enumerate(grid_run):
        _, tp_rank = mesh.grid_coords(rank, TP)
        for name, got in params.items():
            want = _slice(ref[name], got.shape, tp_rank)
            torch.testing.assert_close(got, want, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _slice(full, shape, tp_rank):
    for dim, (a, b) in enumerate(zip(full.shape, shape)):
        if a != b:
            return full.chunk(a // b, dim)[tp_rank]
    return full


def test_device_mesh_and_fsdp2_equal_one_process(cluster):
    ref = checks.reference_params(CFG, BATCHES, LR)
    for params in cluster.run(mesh.train_device_mesh, CFG, BATCHES, LR, DP, TP):
        assert set(params) == set(ref)
        for name, got in params.items():
            torch.testing.assert_close(got, ref[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_each_rank_talks_only_to_its_row_and_column(grid_run):
    rows, columns = mesh.grid_ranks(DP, TP)
    for rank, (_, log, _) in enumerate(grid_run):
        dp_rank, tp_rank = mesh.grid_coords(rank, TP)
        assert {c["ranks"] for c in log.calls} == {tuple(rows[dp_rank]),
                                                  tuple(columns[tp_rank])}


def test_bytes_per_group_match_the_formula(grid_run):
    b, s, h, v = BATCH // DP, CFG.seq_len, CFG.hidden, CFG.vocab_size
    tp_bytes = ((4 * CFG.layers + 2) * b * s * h + b * s * v) * 4   # fp32
    rows, columns = mesh.grid_ranks(DP, TP)
    for rank, (_, log, local) in enumerate(grid_run):
        dp_rank, tp_rank = mesh.grid_coords(rank, TP)
        by_group = log.bytes_by_group()
        assert by_group[tuple(rows[dp_rank])] == STEPS * tp_bytes
        assert by_group[tuple(columns[tp_rank])] == STEPS * local


def test_a_wrong_grid_size_says_how_many_ranks(cluster):
    with pytest.raises(ls.RankError, match="a 3 x 2 grid needs 6 ranks"):
        cluster.run(mesh.grid_groups, 3, 2)


def test_memory_module_counts_the_same_local_bytes(cluster, grid_run):
    def local_bytes():
        tp_group, _ = mesh.grid_groups(DP, TP)
        return tally.storage_bytes(TensorParallelGPT(models.GPT(CFG, seed=0),
                                                      tp_group).parameters())
    for got, (_, _, local) in zip(cluster.run(local_bytes), grid_run):
        assert got == local


def _ring_attention_sends(chunk, hidden, heads):
    g = torch.Generator().manual_seed(dist.get_rank())
    q, k, v = (torch.randn(1, heads, chunk, hidden // heads, generator=g, requires_grad=True)
               for _ in range(3))
    with traffic.count() as sent:
        ring_attention.ring_attention(q, k, v, causal=True).sum().backward()
    return sent.sent


def test_the_planners_context_parallel_bytes_are_ring_attentions(cluster):
    # chapter 6: K, V forward cp-1 times, K, V, dK, dV backward cp-1 times, dK, dV home
    cp, seq, hidden = DP * TP, 32, 16
    job = planner.Job(memory_calc.Model(0, 1, hidden, 4, 64), seq, 1, precision="fp32")
    want = planner.traffic(job, planner.Layout(1, 1, 1, cp=cp))["cp"]
    assert want == (6 * (cp - 1) + 2) * seq // cp * hidden * 4
    assert cluster.run(_ring_attention_sends, seq // cp, hidden, 4) == [want] * cp


# -- the notebook ------------------------------------------------------------------

def test_the_notebook_copy_is_the_package_code():
    assert_lesson_copy(mesh)


def test_solutions_and_answers_are_collapsed_in_jupyterlab():
    # that the stubs are stubs and no visible cell shows a solution: test_your_turn_cells.py
    cells = nbformat.read(NOTEBOOK, as_version=4).cells
    hidden = [c for c in cells if {"solution", "hide-cell"} & set(c.metadata.get("tags", []))]
    assert len(hidden) == 4
    for cell in hidden:
        assert cell.metadata.get("jupyter", {}).get("source_hidden") is True, cell.source[:60]
    stubs = [c for c in cells if "your-turn" in c.metadata.get("tags", [])]
    assert [c.source.split("(")[0] for c in stubs] == ["def axis_groups", "def grad_sync_plan"]


# -- last: 8 ranks, a new group of processes (the 4-rank cluster above ends) ----------

def _mlp_data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 3, 8, generator=g), torch.randn(4, 3, 8, generator=g))
            for _ in range(STEPS)]


def _device_mesh_groups(shape):
    from torch.distributed.device_mesh import init_device_mesh
    grid = init_device_mesh("cpu", shape)
    return [dist.get_process_group_ranks(grid.get_group(d)) for d in range(len(shape))]


@pytest.mark.parametrize("dp, pp, tp", [(1, 2, 2), (2, 2, 2)])
def test_the_3d_step_equals_one_process(dp, pp, tp):
    batches = _mlp_data()
    ref = checks.reference_3d(pp, 8, batches, LR)
    split = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}
    runs = ls.run(mesh.train_3d, dp, pp, tp, 8, batches, LR, world_size=dp * pp * tp)
    for rank, params in enumerate(runs):
        stage, tp_rank = rank // tp % pp, rank % tp
        for name, got in params.items():
            want = ref[stage][name]
            want = want.chunk(tp, split[name])[tp_rank] if name in split else want
            torch.testing.assert_close(got, want, **TOL,
                                       msg=lambda m, r=rank, n=name: f"rank {r} {n}: {m}")
    # DeviceMesh's groups of the same shape are axis_groups' (every rank in one per axis)
    for rank, groups in enumerate(ls.run(_device_mesh_groups, (dp, pp, tp),
                                         world_size=dp * pp * tp)):
        for axis, ranks in enumerate(groups):
            assert ranks in mesh.axis_groups((dp, pp, tp), axis) and rank in ranks
