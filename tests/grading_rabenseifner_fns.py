"""Rabenseifner's all-reduce, right and wrong, for tests/test_grading_rabenseifner.py.

Imports only torch (the ranks import this module to unpickle each function).
The reference halves are the assignment's solution, kept identical by a test.
"""
import torch
import torch.distributed as dist


def chunk_range(tensor, world_size, first, last):
    """Chunks first..last-1 of tensor.tensor_split(world_size), as one view."""
    sizes = [c.numel() for c in tensor.tensor_split(world_size)]
    return tensor[sum(sizes[:first]):sum(sizes[:last])]


def halving_reduce_scatter(tensor):
    """In place: chunk `rank` of `tensor` becomes the sum over all ranks."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    lo, hi = 0, world_size  # the chunks this rank still reduces
    distance = world_size // 2
    while distance >= 1:
        mid = (lo + hi) // 2
        upper = rank & distance  # keep the half that holds chunk `rank`
        keep, give = ((mid, hi), (lo, mid)) if upper else ((lo, mid), (mid, hi))
        mine = chunk_range(tensor, world_size, *keep)
        received = torch.empty_like(mine)
        partner = rank ^ distance
        giving = chunk_range(tensor, world_size, *give)
        requests = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, giving, partner),
            dist.P2POp(dist.irecv, received, partner)])
        for request in requests:
            request.wait()
        mine.add_(received)
        (lo, hi), distance = keep, distance // 2


def doubling_all_gather(tensor):
    """In place: chunk `r` of every rank becomes chunk `r` of rank `r`."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    distance = 1
    while distance < world_size:
        partner = rank ^ distance
        mine, theirs = (r // distance * distance for r in (rank, partner))
        sending = chunk_range(tensor, world_size, mine, mine + distance)
        arriving = chunk_range(tensor, world_size, theirs, theirs + distance)
        requests = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, sending, partner),
            dist.P2POp(dist.irecv, arriving, partner)])
        for request in requests:
            request.wait()
        distance *= 2


def rabenseifner_all_reduce(tensor):
    halving_reduce_scatter(tensor)
    doubling_all_gather(tensor)


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
