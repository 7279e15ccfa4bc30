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

# --- lesson: notebooks/02_ring_allreduce.ipynb (the notebook's copy must match) ---


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


SEGMENT_BYTES = 2**21  # 2 MiB: fewer, larger messages pay alpha less often
WINDOW = 4  # receives posted ahead, so the next segments are on their way


def arrivals(chunks, rank, seg):
    """What rank receives, in the order it is sent: [(step, segment view)].

    At every one of the 2(N-1) steps the chunk arriving from the left is
    chunks[rank-s-2]: reduce-scatter step s adds chunk rank-s-2 (as in
    ring_allreduce_simple), all-gather step k = s-(N-1) receives chunk
    rank-k-1, the same chunk modulo N. The last reduce-scatter step
    (s = N-2) completes chunk rank.
    """
    world_size = len(chunks)
    return [(step, part) for step in range(2 * (world_size - 1))
            for part in chunks[(rank - step - 2) % world_size].split(seg)]


def post_receive(inbox, i, scratch, src):
    """Post arrival i: reduce-scatter segments land in a scratch slot, to be
    added; all-gather segments straight in the tensor, where they belong."""
    step, part = inbox[i]
    if step < dist.get_world_size() - 1:  # reduce-scatter
        return dist.irecv(scratch[i % WINDOW, :part.numel()], src)
    # Safe although sends of this chunk may be in flight: its finished sum
    # can only arrive after our own part of it has left.
    return dist.irecv(part, src)


def pass_along(inbox, sends, scratch, right, left):
    """Take each arrival in turn: add it (reduce-scatter), send it on at once
    (every step but the last), and post the receive WINDOW arrivals ahead."""
    world_size = dist.get_world_size()
    pending = [post_receive(inbox, i, scratch, left)
               for i in range(min(WINDOW, len(inbox)))]
    for i, (step, part) in enumerate(inbox):
        pending.pop(0).wait()
        if step < world_size - 1:  # reduce-scatter: add what arrived
            part += scratch[i % WINDOW, :part.numel()]
        if step < 2 * world_size - 3:  # step+1 sends it on, right away
            sends.append(dist.isend(part, right))
        if i + WINDOW < len(inbox):  # scratch slot i % WINDOW is free again
            pending.append(post_receive(inbox, i + WINDOW, scratch, left))
    for work in sends:
        work.wait()


def ring_allreduce(tensor, segment_bytes=SEGMENT_BYTES):
    """The chunked ring, pipelined: each segment is passed on once it is ready.

    ring_allreduce_simple's algorithm and bytes, in segments: what step s
    receives (and adds, in the reduce-scatter) is what step s+1 sends, so a
    segment goes on to the right as soon as it is ready, not at the end of
    its step, and the steps overlap. The pipelined ring of Patarasuk & Yuan
    (2009), JPDC 69(2); Baidu's ring allreduce (Gibiansky, 2017).
    Each rank sends 2(N-1) chunks of S/N bytes: 2(N-1)/N·S in all.
    """
    if not tensor.is_contiguous():
        raise ValueError("ring_allreduce works in place on a contiguous "
                         "tensor: pass t.contiguous() and copy it back")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size == 1:
        return tensor  # nothing to add, no one to send to
    chunks = tensor.view(-1).tensor_split(world_size)  # sizes differ by <= 1
    seg = max(1, min(segment_bytes // tensor.element_size(), len(chunks[0])))
    scratch = tensor.new_empty(WINDOW, seg)  # (WINDOW, seg), once per call
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    # Both neighbours post in the same order, so receives match sends.
    sends = [dist.isend(p, right)  # step 0: our own chunk rank-1
             for p in chunks[(rank - 1) % world_size].split(seg)]
    pass_along(arrivals(chunks, rank, seg), sends, scratch, right, left)
    return tensor


# --- end of lesson ---
