"""Ring all-reduce from point-to-point messages, as chapter 2 writes it.

    from labsupport import ring
    ring.ring_allreduce(t)          # in place, on every rank: t = sum over ranks
    ring.ring_allreduce_naive(t)    # the whole-buffer ring, for contrast
    ring.ring_allreduce_simple(t)   # the chunked ring, plainly (the lesson)

Chunk convention: after the reduce-scatter rank r holds the sum of chunk r of
``t.view(-1).tensor_split(world_size)``, as ``dist.reduce_scatter_tensor`` does.

The functions between the two marker lines below are the lesson: chapter 2
(notebooks/02_ring_allreduce.ipynb) shows them in full, and
tests/test_ring.py checks that its cell and this file hold the same code.
Later chapters and ``python -m labsupport.bench ring`` import them from here.
"""
import torch
import torch.distributed as dist

# --- lesson: ring all-reduce (the notebook's copy must match) ---


def exchange(send_buf, dst, recv_buf, src):
    """Send one buffer and receive another at the same time.

    Posting both before waiting on either is what keeps a ring from
    deadlocking: every rank sends right while it receives from the left.
    """
    works = [dist.isend(send_buf, dst), dist.irecv(recv_buf, src)]
    for work in works:
        work.wait()


def ring_allreduce_naive(tensor):
    """Whole-buffer ring all-reduce: the starting point, (N-1)·S bytes a rank.

    Each of the N-1 steps forwards a whole buffer to the right neighbour, so
    every rank's tensor travels once round the ring and each rank adds it on
    arrival. Correct, and N/2 times more traffic than the chunked ring.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    outgoing, incoming = tensor.clone(), torch.empty_like(tensor)
    for _ in range(world_size - 1):
        exchange(outgoing, right, incoming, left)
        tensor += incoming
        outgoing, incoming = incoming, outgoing  # forward what just came in
    return tensor


def ring_allreduce_simple(tensor):
    """Chunked ring all-reduce, plainly: ring reduce-scatter, then all-gather.

    Patarasuk & Yuan (2009). Reduce-scatter step k: send chunk rank-k-1 right,
    add chunk rank-k-2 from the left; after N-1 steps rank r holds the sum of
    chunk r. All-gather step k: pass chunk rank-k on, receive chunk rank-k-1.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    chunks = tensor.view(-1).tensor_split(world_size)  # sizes differ by <= 1
    for step in range(world_size - 1):  # reduce-scatter
        mine = chunks[(rank - step - 2) % world_size]
        incoming = torch.empty_like(mine)
        exchange(chunks[(rank - step - 1) % world_size], right, incoming, left)
        mine += incoming
    for step in range(world_size - 1):  # all-gather
        exchange(chunks[(rank - step) % world_size], right,
                 chunks[(rank - step - 1) % world_size], left)
    return tensor


SEGMENT_BYTES = 2**20  # 1 MiB: big enough to amortise a message's cost


def send_and_reduce(send_chunk, dst, recv_chunk, src, scratch):
    """Send one chunk; add the incoming one into recv_chunk, segment by segment.

    Two scratch segments take turns, so adding segment i overlaps the
    arrival of segment i+1 (gloo's own ring does the same).
    """
    sends = [dist.isend(p, dst) for p in send_chunk.split(scratch.shape[1])]
    parts = recv_chunk.split(scratch.shape[1])

    def receive(i):
        return dist.irecv(scratch[i % 2, :parts[i].numel()], src)

    work = receive(0)
    for i, part in enumerate(parts):
        following = receive(i + 1) if i + 1 < len(parts) else None
        work.wait()
        part += scratch[i % 2, :part.numel()]
        work = following
    for send in sends:
        send.wait()


def reduce_scatter_step(chunks, step, scratch):
    """Step k: send chunk rank-k-1 right; add chunk rank-k-2 from the left."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    send_and_reduce(chunks[(rank - step - 1) % world_size], right,
                    chunks[(rank - step - 2) % world_size], left, scratch)


def all_gather_step(chunks, step):
    """Step k: pass the finished chunk rank-k on; receive chunk rank-k-1."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    exchange(chunks[(rank - step) % world_size], right,
             chunks[(rank - step - 1) % world_size], left)


def ring_allreduce(tensor, segment_bytes=SEGMENT_BYTES):
    """The chunked ring, optimised: segments, double buffer, overlap.

    ring_allreduce_simple's algorithm, with each chunk sent in segments and
    the addition of one segment overlapping the arrival of the next.
    Patarasuk & Yuan (2009), JPDC 69(2); Baidu's ring allreduce (Gibiansky,
    2017). Each rank sends 2(N-1) chunks of S/N bytes: 2(N-1)/N·S in all.
    """
    if not tensor.is_contiguous():
        raise ValueError("ring_allreduce works in place on a contiguous "
                         "tensor: pass t.contiguous() and copy it back")
    world_size = dist.get_world_size()
    chunks = tensor.view(-1).tensor_split(world_size)  # sizes differ by <= 1
    seg = max(1, segment_bytes // tensor.element_size())
    scratch = tensor.new_empty(2, seg)  # once per call, reused by each step
    for step in range(world_size - 1):
        reduce_scatter_step(chunks, step, scratch)
    for step in range(world_size - 1):
        all_gather_step(chunks, step)
    return tensor


# --- end of lesson ---
