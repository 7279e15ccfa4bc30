"""The same worker functions outside the notebook: under torchrun, on one node or many.

    # train.py
    import labsupport as ls
    def train(steps):
        model = ...to(ls.device())
        ...
    if __name__ == "__main__":
        ls.main(train, steps=100)

    torchrun --standalone --nproc-per-node=4 train.py                    # one machine
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d \\
             --rdzv-endpoint=$HEAD_NODE:29500 train.py                   # two (e.g. under srun)

In the notebook, ``ls.run(train, 100, world_size=4)`` runs the very same function,
and ``ls.device()`` (``identity.device``) answers the same way in both.
"""
import os

from labsupport.launch.placement import NCCL_ENV, init_backend, requested


def main(fn, *args, backend: str = "auto", **kwargs):
    """Call ``fn(*args, **kwargs)`` as this process's rank, as launched by torchrun.

    The process group comes from torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT); an existing one (in a labsupport rank) is used as is.
    It is made as ``ls.start`` makes one: on GPUs ``"cpu:gloo,cuda:nccl"`` with
    this rank's GPU as ``device_id`` (so point-to-point follows the same rules),
    ``$LABSUPPORT_BACKEND`` for "auto", and ``LABSUPPORT_P2P=strict`` honoured.
    """
    import torch
    import torch.distributed as dist

    from labsupport.launch import strict_p2p
    created = not dist.is_initialized()
    if created:
        _init(torch, dist, requested(backend))
        strict_p2p.install()
    try:
        return fn(*args, **kwargs)
    finally:
        if created:
            dist.destroy_process_group()


def _init(torch, dist, kind):
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        raise RuntimeError("ls.main() expects to be started by torchrun, e.g. "
                           "`torchrun --standalone --nproc-per-node=2 script.py`")
    if kind == "auto":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        kind = "nccl" if gpus >= int(os.environ["LOCAL_WORLD_SIZE"]) else "gloo"
    for name, value in NCCL_ENV.items():  # as in a notebook's ranks
        os.environ.setdefault(name, value)
    device = None
    if kind == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group(init_backend(kind), device_id=device)
