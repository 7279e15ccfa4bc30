"""NCCL on GPUs: one GPU per rank, and ranks work after the kernel itself used CUDA.

Run: .venv/bin/python -m pytest tests/test_launcher_gpu.py  (skips, saying why, without CUDA GPUs)

These tests check what backend="auto" decides, so each sets LABSUPPORT_BACKEND=auto
(the suite runs on gloo otherwise, conftest.py) and, where ranks run NCCL, leaves
LABSUPPORT_P2P unset (strict mode is gloo's imitation of NCCL).
"""
import pytest
import torch

import labsupport as ls
from labsupport.launch import placement, session

GPUS = placement.visible_gpus()


@pytest.fixture(autouse=True)
def auto_backend(monkeypatch):
    monkeypatch.setenv(placement.ENV, "auto")


needs_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs, {GPUS} visible: the NCCL "
                                "path is checked only on GPU machines (CI has none)")


@pytest.mark.gpu
@needs_gpus
def test_auto_picks_nccl_with_one_gpu_per_rank_even_after_cuda_was_used_here(monkeypatch):
    monkeypatch.delenv("LABSUPPORT_P2P", raising=False)
    torch.ones(1, device="cuda")  # the kernel initialises CUDA first (fork-based launchers break)
    with ls.start(world_size=2) as cluster:
        assert cluster.backend == placement.GPU_BACKEND == "cpu:gloo,cuda:nccl"

        def where():
            import torch.distributed as dist
            t = torch.ones(4, device=ls.device()) * (dist.get_rank() + 1)
            dist.all_reduce(t)
            on_cpu = torch.ones(2)  # the graders' tensors: through gloo
            dist.all_reduce(on_cpu)
            assert on_cpu.tolist() == [2.0, 2.0] and ls.backend_of("cpu") == "gloo"
            assert ls.backend_of() == "nccl"
            return str(ls.device()), torch.cuda.current_device(), t

        results = cluster.run(where)
    assert [r[:2] for r in results] == [("cuda:0", 0), ("cuda:1", 1)]
    assert all(r[2].device.type == "cpu" and r[2].tolist() == [3.0] * 4 for r in results)


@pytest.mark.gpu
@needs_gpus
def test_more_ranks_than_gpus_falls_back_to_gloo_with_a_notice(capsys, monkeypatch):
    monkeypatch.setattr(session, "_notices_shown", set())
    with ls.start(world_size=GPUS + 1) as cluster:
        assert cluster.backend == "gloo"
    assert f"only {GPUS} GPU(s) visible" in capsys.readouterr().out


def test_auto_without_enough_gpus_is_gloo_on_cpu_with_a_one_line_notice_once(capsys, monkeypatch):
    monkeypatch.setattr(session, "_notices_shown", set())
    with ls.start(world_size=GPUS + 1) as cluster:
        assert cluster.backend == "gloo"
        assert cluster.run(lambda: str(ls.device())) == ["cpu"] * (GPUS + 1)
    notice = capsys.readouterr().out.strip().splitlines()
    assert len(notice) == 1 and notice[0].startswith("labsupport: ranks run on gloo (CPU)")
    with ls.start(world_size=GPUS + 2):
        pass
    assert capsys.readouterr().out == "", "the notice is shown once per kernel"


def test_placement_on_a_machine_with_four_gpus(monkeypatch):
    # The decision alone, on any machine: what a 4-GPU JupyterHub node would get.
    monkeypatch.setattr(placement, "visible_gpus", lambda: 4)
    on_gpus = placement.place(2)
    assert (on_gpus.backend, on_gpus.devices, on_gpus.notice) == (
        "cpu:gloo,cuda:nccl", ("cuda:0", "cuda:1"), None)
    too_many = placement.place(5)
    assert too_many.backend == "gloo" and too_many.devices == ("cpu",) * 5
    assert too_many.notice == "labsupport: ranks run on gloo (CPU): only 4 GPU(s) visible"
    with pytest.raises(ValueError, match=r"world_size=5 but 4 GPU\(s\) visible "
                                         r".*use world_size<=4, or use backend='gloo'"):
        placement.place(5, backend="nccl")
