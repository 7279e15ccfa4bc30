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
    if dist.is_initialized() and backend_of("cuda") == "nccl":  # under torchrun
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def backend_of(device=None, group=None) -> str | None:
    """Which backend carries ``group``'s collectives on tensors of ``device``.

    "gloo" (over TCP sockets: what ``labsupport.traffic`` counts on the wire),
    "nccl", or None when the group has none for that device, where such a
    collective raises "No backend type associated with device type". The
    device defaults to this rank's, the group to the default group. Ask this,
    not ``dist.get_backend()``: on GPUs that is "cpu:gloo,cuda:nccl".
    """
    import torch
    import torch.distributed as dist

    where = torch.device(device) if device is not None else globals()["device"]()
    try:
        return (group or dist.group.WORLD)._get_backend(where).name()
    except RuntimeError:  # no backend for this device type
        return None
