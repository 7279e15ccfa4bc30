"""Where the ranks run: backend, one device per rank, CPU threads per rank.

``backend="auto"`` takes NCCL with one GPU per rank when there are enough
visible GPUs (``CUDA_VISIBLE_DEVICES`` is respected), else gloo on the CPU.
CPU ranks split the cores between them, so 4 ranks on 2 cores do not fight
over 8 threads.
"""
import os
from dataclasses import dataclass

from labsupport.launch.limits import check_world_size, cpu_count

BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class Placement:
    world_size: int
    backend: str            # "gloo" or "nccl"
    devices: tuple          # one device string per rank: "cpu" or "cuda:i"
    threads: int            # torch intra-op threads per rank
    notice: str | None      # one line for the user, or None


def visible_gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver counts as no GPU; gloo still works
        return 0


def place(world_size, backend="auto", threads=None) -> Placement:
    """Validate the request and decide backend, devices and threads."""
    world_size = check_world_size(world_size)
    if not isinstance(backend, str) or backend.lower() not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {', '.join(map(repr, BACKENDS))}")
    backend, notice = backend.lower(), None
    gpus = 0 if backend == "gloo" else visible_gpus()  # gloo needs no torch in the kernel
    if backend == "nccl" and world_size > gpus:
        fix = f"use world_size<={gpus}, or " if gpus else ""
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: world_size={world_size} but {gpus} GPU(s) "
            f"visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): "
            f"{fix}use backend='gloo' to run the ranks on the CPU.")
    if backend == "auto":
        backend = "nccl" if 0 < world_size <= gpus else "gloo"
        if backend == "gloo":
            why = f"only {gpus} GPU(s) visible" if gpus else "no CUDA GPU visible"
            notice = f"labsupport: ranks run on gloo (CPU): {why}"
    devices = tuple(f"cuda:{r}" if backend == "nccl" else "cpu" for r in range(world_size))
    if threads is None:
        threads = max(1, cpu_count() // world_size)
    elif isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive int (torch threads per rank), got {threads!r}")
    return Placement(world_size, backend, devices, threads, notice)
