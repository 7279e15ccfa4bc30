"""Ring all-reduce from point-to-point messages, as chapter 2 writes it.

    from labsupport.ring import ring
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

    Both in one batch_isend_irecv, which lets them progress together: that
    is what keeps a ring from deadlocking, every rank sending right while it
    receives from the left. (On gloo an isend and an irecv posted one after
    the other would do; NCCL runs unbatched ones one at a time, in order.)
    """
    ops = [dist.P2POp(dist.isend, send_buf, dst),
           dist.P2POp(dist.irecv, recv_buf, src)]
    for work in dist.batch_isend_irecv(ops):
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
WINDOW = 8  # exchanges in flight, so the next segments are on their way


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


def landing(inbox, i, scratch):
    """Where arrival i lands: a scratch slot (reduce-scatter: to be added),
    or straight in the tensor (all-gather: where it belongs). Safe although
    sends of that chunk may be in flight: its finished sum can only arrive
    after our own part of it has left."""
    step, part = inbox[i]
    if step < dist.get_world_size() - 1:
        return scratch[i % WINDOW, :part.numel()]
    return part


def finish(inbox, i, works, scratch):
    """Wait for exchange i; in the reduce-scatter, add what arrived."""
    for work in works:
        work.wait()
    if i < len(inbox) and inbox[i][0] < dist.get_world_size() - 1:
        part = inbox[i][1]
        part += scratch[i % WINDOW, :part.numel()]


def pass_along(inbox, outbox, scratch, right, left, ahead):
    """Exchange i receives inbox[i] from the left and sends outbox[i] right,
    in one batch, the receive first: gloo sends a message's data only once
    its receiver has posted the receive, so ours goes out early and the left
    neighbour's data can start sooner (NCCL runs a batch's operations
    together, in any order). ``ahead`` exchanges are in flight at a time.
    Outbox entry i is the arrival of exchange i - ahead or earlier, finished
    by then."""
    in_flight = []  # (i, works), oldest first
    for i in range(max(len(inbox), len(outbox))):
        ops = []
        if i < len(inbox):
            ops.append(dist.P2POp(dist.irecv, landing(inbox, i, scratch), left))
        if i < len(outbox):
            ops.append(dist.P2POp(dist.isend, outbox[i], right))
        in_flight.append((i, dist.batch_isend_irecv(ops)))
        if len(in_flight) == ahead:
            finish(inbox, *in_flight.pop(0), scratch)
    for i, works in in_flight:
        finish(inbox, i, works, scratch)


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
    inbox = arrivals(chunks, rank, seg)
    own = chunks[(rank - 1) % world_size].split(seg)  # step 0 sends these
    # Every later step sends on what the step before received; both
    # neighbours go in the same order, so receives match sends.
    outbox = [*own, *(p for step, p in inbox if step < 2 * world_size - 3)]
    ahead = max(1, min(WINDOW, len(own)))  # sends wait for their arrival
    pass_along(inbox, outbox, scratch, right, left, ahead)
    return tensor


# --- end of lesson ---
