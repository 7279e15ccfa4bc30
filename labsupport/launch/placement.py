"""Where the ranks run: backend, one device per rank, CPU threads per rank.

``backend="auto"`` takes NCCL with one GPU per rank when there are enough
visible GPUs (``CUDA_VISIBLE_DEVICES`` is respected), else gloo on the CPU.
On GPUs the process group is ``"cpu:gloo,cuda:nccl"``: collectives on CUDA
tensors go through NCCL, and those on CPU tensors (the graders' checks, CPU
models, ``init_device_mesh("cpu")``) through gloo, where a plain ``"nccl"``
group would raise "No backend type associated with device type cpu".

``$LABSUPPORT_BACKEND`` (``auto``, ``gloo`` or ``nccl``) says what ``"auto"``
means, read here only: CI on a GPU node sets ``gloo`` to run the CPU suite,
``make test-gpu`` sets ``nccl``. A backend given explicitly wins.
CPU ranks split the cores between them, so 4 ranks on 2 cores do not fight
over 8 threads.
"""
import os
from dataclasses import dataclass

from labsupport.launch.limits import check_world_size, cpu_count

BACKENDS = ("auto", "gloo", "nccl")
ENV = "LABSUPPORT_BACKEND"
GPU_BACKEND = "cpu:gloo,cuda:nccl"  # what init_process_group gets when ranks have GPUs
# Every rank's environment, unless the user set them: NCCL says why it failed
# ("unhandled system error" alone otherwise), and torch's warning that unbatched
# point-to-point is serialised under eager initialisation (the course's code
# batches, LABSUPPORT_P2P=strict checks it) stays out of cell outputs; its text
# names this variable (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp).
NCCL_ENV = {"NCCL_DEBUG": "WARN",
            "TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING": "false"}


@dataclass(frozen=True)
class Placement:
    world_size: int
    backend: str            # for init_process_group: "gloo" or GPU_BACKEND
    devices: tuple          # one device string per rank: "cpu" or "cuda:i"
    threads: int            # torch intra-op threads per rank
    notice: str | None      # one line for the user, or None


def requested(backend="auto") -> str:
    """"auto", "gloo" or "nccl": ``backend``, or $LABSUPPORT_BACKEND for "auto"."""
    if not isinstance(backend, str) or backend.lower() not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of "
                         f"{', '.join(map(repr, BACKENDS))}")
    backend = backend.lower()
    if backend != "auto":
        return backend
    env = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if env not in BACKENDS:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: use auto, gloo or nccl (what "
                         "backend='auto' means), or unset it")
    return env


def init_backend(kind: str) -> str:
    """The string init_process_group gets for "gloo" or "nccl" ranks."""
    return GPU_BACKEND if kind == "nccl" else "gloo"


def visible_gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver counts as no GPU; gloo still works
        return 0


def place(world_size, backend="auto", threads=None) -> Placement:
    """Validate the request and decide backend, devices and threads."""
    world_size = check_world_size(world_size)
    kind, notice = requested(backend), None
    from_env = backend.lower() == "auto" and kind == "gloo"  # $LABSUPPORT_BACKEND=gloo
    # gloo asked for needs no torch in the kernel; from the environment, it says why
    gpus = 0 if kind == "gloo" and not from_env else visible_gpus()
    if kind == "nccl" and world_size > gpus:
        fix = f"use world_size<={gpus}, or " if gpus else ""
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: world_size={world_size} but {gpus} GPU(s) "
            f"visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): "
            f"{fix}use backend='gloo' to run the ranks on the CPU.")
    if kind == "auto" or from_env:
        kind = "nccl" if 0 < world_size <= gpus and not from_env else "gloo"
        if kind == "gloo":
            why = (f"{ENV}=gloo" if from_env and gpus else
                   f"only {gpus} GPU(s) visible" if gpus else "no CUDA GPU visible")
            notice = f"labsupport: ranks run on gloo (CPU): {why}"
    devices = tuple(f"cuda:{r}" if kind == "nccl" else "cpu" for r in range(world_size))
    if threads is None:
        threads = max(1, cpu_count() // world_size)
    elif isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError("threads must be a positive int (torch threads per rank), got "
                         f"{threads!r}")
    return Placement(world_size, init_backend(kind), devices, threads, notice)
