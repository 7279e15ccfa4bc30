"""Wrong halves of Rabenseifner's all-reduce, for tests/test_grading_rabenseifner_allreduce.py.

Imports only torch (the ranks import this module to unpickle each function).
``chunk_range`` is the assignment's given helper; the reference is the source
notebook's (tests/sources.py), never a copy here.
"""
import torch
import torch.distributed as dist


def chunk_range(tensor, world_size, first, last):
    """Chunks first..last-1 of tensor.tensor_split(world_size), as one view."""
    sizes = [c.numel() for c in tensor.tensor_split(world_size)]
    return tensor[sum(sizes[:first]):sum(sizes[:last])]


def alltoall_reduce_scatter(tensor):
    """Right sums: the whole tensor goes to every other rank, (N-1)*S bytes, N-1 rounds."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    received = [torch.empty_like(tensor) for _ in range(world_size)]
    others = [peer for peer in range(world_size) if peer != rank]
    requests = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, tensor.clone(), peer) for peer in others]
        + [dist.P2POp(dist.irecv, received[peer], peer) for peer in others])
    for request in requests:
        request.wait()
    for peer in range(world_size):
        if peer != rank:
            tensor.add_(received[peer])


def direct_reduce_scatter(tensor):
    """Each chunk straight to its owner: the right bytes, N-1 rounds instead of log2(N)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    chunks = tensor.tensor_split(world_size)
    received = [torch.empty_like(chunks[rank]) for _ in range(world_size)]
    others = [peer for peer in range(world_size) if peer != rank]
    requests = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, chunks[peer], peer) for peer in others]
        + [dist.P2POp(dist.irecv, received[peer], peer) for peer in others])
    for request in requests:
        request.wait()
    for peer in range(world_size):
        if peer != rank:
            chunks[rank].add_(received[peer])


def send_first_reduce_scatter(tensor):
    """Blocking send before recv on both partners: neither reaches its receive."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    lo, hi = 0, world_size
    distance = world_size // 2
    while distance >= 1:
        mid = (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if rank & distance else ((lo, mid), (mid, hi))
        mine = chunk_range(tensor, world_size, *keep)
        received = torch.empty_like(mine)
        dist.send(chunk_range(tensor, world_size, *give), rank ^ distance)
        dist.recv(received, rank ^ distance)
        mine.add_(received)
        (lo, hi), distance = keep, distance // 2
