"""Am I a rank, and which one: set by ``rank_main`` when a rank joins its group.

The kernel side reads it (``ls.start`` refuses to run on a rank, ``ls.device``
answers for this rank) without importing the rank's main loop.
"""
import os

STATE: dict = {}  # on a rank: rank, world_size, device, backend; empty in the kernel


def on_rank() -> bool:
    """Whether this process is a labsupport rank."""
    return bool(STATE)


def device():
    """This rank's device: its GPU under NCCL, else the CPU (also in the kernel itself)."""
    import torch
    import torch.distributed as dist

    if STATE:
        return STATE["device"]
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")
