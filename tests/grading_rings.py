"""Ring collectives, right and wrong, for tests/test_grading.py.

In their own module, which imports only torch: the ranks import it to unpickle
each function, and the test module's own imports (nbformat, pytest) would cost
seconds in every fresh group of ranks.
"""
import torch
import torch.distributed as dist


def exchange(chunks, send_i, recv_into, rank, world_size):
    requests = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, chunks[send_i], (rank + 1) % world_size),
        dist.P2POp(dist.irecv, recv_into, (rank - 1) % world_size)])
    for request in requests:
        request.wait()


def ring_reduce_scatter(tensor, split=torch.tensor_split):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = split(tensor, n)
    for step in range(n - 1):
        recv_i = (rank - step - 2) % n
        received = torch.empty_like(chunks[recv_i])
        exchange(chunks, (rank - step - 1) % n, received, rank, n)
        chunks[recv_i].add_(received)


def ring_all_gather(tensor, split=torch.tensor_split, silent_rank=None):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = split(tensor, n)
    for step in range(n - 1):
        send_i, recv_i = (rank - step) % n, (rank - step - 1) % n
        if rank == silent_rank:  # this rank forgets to send: its neighbour waits forever
            dist.recv(chunks[recv_i], (rank - 1) % n)
        else:
            exchange(chunks, send_i, chunks[recv_i], rank, n)


def ring_all_reduce(tensor):
    ring_reduce_scatter(tensor)
    ring_all_gather(tensor)


def batched_reduce_scatter(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = tensor.tensor_split(n)
    for step in range(n - 1):
        recv_i = (rank - step - 2) % n
        received = torch.empty_like(chunks[recv_i])
        ops = [dist.P2POp(dist.isend, chunks[(rank - step - 1) % n], (rank + 1) % n),
               dist.P2POp(dist.irecv, received, (rank - 1) % n)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        chunks[recv_i].add_(received)


def whole_buffer_all_reduce(tensor):
    """Correct sums, but every step sends the whole tensor: (N-1)*S per rank."""
    rank, n = dist.get_rank(), dist.get_world_size()
    passing = tensor.clone()
    for _ in range(n - 1):
        received = torch.empty_like(tensor)
        exchange([passing], 0, received, rank, n)
        tensor.add_(received)
        passing = received


def direct_all_gather(tensor):
    """Each rank sends its chunk straight to every other rank: a ring's bytes, not a ring."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = tensor.tensor_split(n)
    others = [peer for peer in range(n) if peer != rank]
    requests = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, chunks[rank], peer) for peer in others]
        + [dist.P2POp(dist.irecv, chunks[peer], peer) for peer in others])
    for request in requests:
        request.wait()


def all_reduce_inside(tensor):
    dist.all_reduce(tensor)


def chunk_reduce_scatter(tensor):
    ring_reduce_scatter(tensor, split=torch.chunk)


def send_first_reduce_scatter(tensor):
    """Blocking send before recv on every rank: nobody ever receives."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = tensor.tensor_split(n)
    for step in range(n - 1):
        recv_i = (rank - step - 2) % n
        received = torch.empty_like(chunks[recv_i])
        dist.send(chunks[(rank - step - 1) % n], (rank + 1) % n)
        dist.recv(received, (rank - 1) % n)
        chunks[recv_i].add_(received)


def rank0_silent_all_gather(tensor):
    ring_all_gather(tensor, silent_rank=0)


def unwaited_recv_reduce_scatter(tensor):
    """Waits for the send but not for the receive: reads a buffer still being filled."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = tensor.tensor_split(n)
    for step in range(n - 1):
        recv_i = (rank - step - 2) % n
        received = torch.zeros_like(chunks[recv_i])
        sending, _ = dist.batch_isend_irecv([  # the receive's request dropped
            dist.P2POp(dist.isend, chunks[(rank - step - 1) % n], (rank + 1) % n),
            dist.P2POp(dist.irecv, received, (rank - 1) % n)])
        sending.wait()
        chunks[recv_i].add_(received)


def endless(tensor):
    while True:
        pass


def raises_on_rank_1(tensor):
    if dist.get_rank() == 1:
        raise ValueError("rank 1 is broken")
    ring_reduce_scatter(tensor)


def not_written_yet(tensor):
    raise NotImplementedError()
