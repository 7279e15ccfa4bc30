"""The doctor's last check: what the chapters do, run from a fresh Jupyter kernel.

    doctor_kernel.kernel_probe(2, timeout=60)   # [(cpu_sum, from_left), ...] by rank

A kernel, as the chapters run (its environment, its ``sys.path``), starts ranks
with the default backend (``ls.run``) and each rank all-reduces CPU tensors,
as the graders and the CPU models do, and passes a tensor of its device
round the ring with one ``dist.batch_isend_irecv``, as the lessons do. A
plain ``"nccl"`` process group would fail the first on GPUs; a broken
point-to-point setup, the second. ``labsupport.doctor.check_chapters`` turns
the result into a verdict.
"""
import os


def chapter_ops():
    """On a rank, what the chapters need: (sum of a CPU all-reduce, what a
    batched isend/irecv round the ring brought from the left)."""
    import torch
    import torch.distributed as dist

    from labsupport.launch.identity import device
    rank, world_size = dist.get_rank(), dist.get_world_size()
    on_cpu = torch.full((4,), rank + 1.0)  # the graders' tensors are on the CPU
    dist.all_reduce(on_cpu)
    mine, left = torch.full((4,), float(rank), device=device()), torch.empty(4, device=device())
    for work in dist.batch_isend_irecv([
            dist.P2POp(dist.isend, mine, (rank + 1) % world_size),
            dist.P2POp(dist.irecv, left, (rank - 1) % world_size)]):
        work.wait()
    return on_cpu[0].item(), left[0].item()


def chapter_ops_on_ranks(world_size):
    """``chapter_ops`` on every rank of a group with the default backend."""
    from labsupport.launch.session import run
    return run(chapter_ops, world_size=world_size)


_MARK = "labsupport-doctor:"


def kernel_probe(world_size, timeout):
    """``chapter_ops_on_ranks`` from a fresh Jupyter kernel; the results by rank."""
    import json
    import tempfile

    from jupyter_client import KernelManager
    # Unix sockets in a private directory: no TCP port open to other users.
    manager = KernelManager(transport="ipc", ip=os.path.join(tempfile.mkdtemp(), "k"))
    manager.start_kernel()
    client = manager.client()
    client.start_channels()
    out, errors = [], []

    def hook(msg):
        kind, content = msg["header"]["msg_type"], msg["content"]
        if kind == "stream":
            out.append(content["text"])
        elif kind == "error":
            errors.append(f"{content['ename']}: {content['evalue']}")
    try:
        client.wait_for_ready(timeout=timeout)
        client.execute_interactive(
            "import json, labsupport.doctor_kernel as d\n"
            f"print({_MARK!r} + json.dumps(d.chapter_ops_on_ranks({world_size})))",
            timeout=timeout, output_hook=hook)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    if errors:
        raise RuntimeError(errors[0])
    text = "".join(out)
    return [tuple(r) for r in json.loads(text.split(_MARK, 1)[1].splitlines()[0])]
