"""Chapter 2's your-turn checks: a reduce-scatter on both directions of the ring, and a
broadcast pipelined down a chain of ranks.

    from labsupport.ring import checks
    ls.your_turn.check(lambda: checks.bidirectional_reduce_scatter(fn), "fn", "...")
    ls.your_turn.check(lambda: checks.chain_broadcast(fn), "fn", "...")

Each runs the reader's function on 2 and 4 ranks through the graders' core
(``checking.collective_checks``: a deadline, a deadlock explained rank by rank, no
library collective, every request waited for) and then reads the
point-to-point calls each rank made (``labsupport.calls``): to which rank,
how many bytes, in which batch, in what order. The message names the first
thing that differs from the algorithm the chapter asks for. An untouched
stub comes back as ``NotWritten`` (``checking.diagnosis``), which
``ls.your_turn.check`` reports as "not written yet".
"""
import math

import torch
import torch.distributed as dist

from labsupport import calls
from labsupport.checking import collective_checks
from labsupport.checking.collective_checks import WORLD_SIZES  # (2, 4): one home
from labsupport.checking.diagnosis import name_of as _name

LOOKAHEAD = 4  # receives a chain rank may post before it passes the first segment on


def _messages(log) -> list[tuple]:
    """[(position, "send" or "recv", peer, nbytes)] of a rank's point-to-point calls in
    issue order; the operations of one batch_isend_irecv share a position."""
    out, position, batch = [], -1, object()
    for c in log.calls:
        if c["kind"] != "p2p":
            continue
        if c["batch"] is None or c["batch"] != batch:
            position += 1
        batch = c["batch"]
        out.append((position, "send" if "send" in c["op"] else "recv", c["peer"], c["nbytes"]))
    return out


def _run(fn, on_rank, *args, world_size):
    """``on_rank(fn, *args)`` on every rank through the graders' core, rules checked."""
    ranks = collective_checks.run(on_rank, fn, *args, world_size=world_size)
    collective_checks.assert_rules(ranks, _name(fn))
    return [r["value"] for r in ranks]


# -- a reduce-scatter on both directions of the ring ------------------------------------

def bidirectional_reduce_scatter(fn, world_sizes=WORLD_SIZES, numel: int = 1200):
    """``fn(tensor)``: chunk r summed on rank r (the graders' check), the first half of
    each chunk going right and the second left, one batch of four per step."""
    collective_checks.check_reduce_scatter(fn, world_sizes=tuple(world_sizes))
    for n in world_sizes:
        messages = _run(fn, _recorded, numel, world_size=n)
        for rank, mine in enumerate(messages):
            problem = (_off_ring(rank, n, mine) or _directions(rank, n, numel, mine)
                       or _batches(rank, n, mine))
            if problem:
                raise AssertionError(f"{_name(fn)} on rank {rank} of {n}, S = {numel * 4} "
                                     f"bytes: {problem}")


def _recorded(fn, numel):
    tensor = torch.ones(numel)
    with calls.record() as log:
        fn(tensor)
    return _messages(log)


def _off_ring(rank, n, mine):
    neighbours = {(rank + 1) % n, (rank - 1) % n}
    strangers = sorted({peer for _, _, peer, _ in mine} - neighbours)
    if strangers:
        return (f"it exchanged messages with ranks {strangers}. Both rings run between "
                f"neighbours only: rank r sends to r+1 and r-1 and receives from both.")
    return None


def _directions(rank, n, numel, mine):
    if n < 3:  # both neighbours are the same rank: nothing to tell apart
        return None
    half = (n - 1) * numel * 4 // (2 * n)  # (N-1)/N·S/2
    right = sum(b for _, op, peer, b in mine if op == "send" and peer == (rank + 1) % n)
    left = sum(b for _, op, peer, b in mine if op == "send" and peer == (rank - 1) % n)
    if (right, left) == (half, half):
        return None
    text = (f"it sent {right} bytes to its right neighbour and {left} to its left one; "
            f"each direction carries half of the reduce-scatter, (N-1)/N·S/2 = {half} "
            "bytes: the first half of every chunk goes right, the second half left.")
    if left == 0 or right == 0:
        text += " One direction only is the ring of ring_allreduce_simple."
    return text


def _batches(rank, n, mine):
    positions = sorted({p for p, *_ in mine})
    shapes = [sorted((op, peer) for p, op, peer, _ in mine if p == q) for q in positions]
    right, left = (rank + 1) % n, (rank - 1) % n
    step = sorted([("recv", left), ("recv", right), ("send", left), ("send", right)])
    if len(shapes) == n - 1 and all(s == step for s in shapes):
        return None
    sizes = [len(s) for s in shapes]
    return (f"it posted its messages in {len(shapes)} batches or calls of {sizes} "
            f"operations; each of the N-1 = {n - 1} steps is one dist.batch_isend_irecv of "
            "four: a send to each neighbour and a receive from each, so that both "
            "directions of every link carry data at the same time.")


# -- a broadcast pipelined down a chain --------------------------------------------------

def chain_broadcast(fn, world_sizes=WORLD_SIZES, numels=(1000, 1030),
                    segment_bytes: int = 400):
    """``fn(tensor, segment_bytes)``: rank 0's tensor on every rank, down the chain
    0 -> 1 -> ... -> N-1, in segments, each passed on as soon as it has arrived."""
    for n in world_sizes:
        for numel in numels:
            ranks = _run(fn, _chain_on_rank, numel, segment_bytes, world_size=n)
            for rank, r in enumerate(ranks):
                problem = (_chain_result(rank, r) or _chain_links(rank, n, r["messages"])
                           or _chain_segments(rank, n, numel, segment_bytes, r["messages"])
                           or _chain_pipelined(rank, n, r["messages"]))
                if problem:
                    raise AssertionError(
                        f"{_name(fn)} on rank {rank} of {n}, S = {numel * 4} bytes, "
                        f"segment_bytes = {segment_bytes}: {problem}")


def _chain_on_rank(fn, numel, segment_bytes):
    want = torch.arange(numel, dtype=torch.float32) + 100  # rank 0's tensor
    tensor = want.clone() if dist.get_rank() == 0 else torch.full_like(want, float("nan"))
    with calls.record() as log:
        out = fn(tensor, segment_bytes)
    got = tensor if out is None else out
    return dict(got=got.detach().cpu(), want=want, messages=_messages(log))


def _chain_result(rank, r):
    got, want = r["got"], r["want"]
    if got.shape == want.shape and torch.equal(got, want):
        return None
    if got.shape != want.shape:
        return f"it returned a tensor of shape {tuple(got.shape)}; fill the one given, in place."
    bad = (got != want).nonzero().reshape(-1)
    first, last = bad[0].item(), bad[-1].item()
    return (f"elements {first}..{last} differ from rank 0's tensor (e.g. element {first} "
            f"is {got[first].item():g}, rank 0 holds {want[first].item():g}; NaN: never "
            "received). Every segment must reach every rank.")


def _chain_links(rank, n, mine):
    allowed = {("send", rank + 1)} if rank < n - 1 else set()
    if rank > 0:
        allowed.add(("recv", rank - 1))
    wrong = sorted({(op, peer) for _, op, peer, _ in mine} - allowed)
    if wrong:
        said = ", ".join(f"{op} {'to' if op == 'send' else 'from'} rank {peer}"
                         for op, peer in wrong)
        return (f"it made a {said}. In the chain rank r receives from r-1 only and sends "
                "to r+1 only: rank 0 only sends, the last rank only receives.")
    return None


def _chain_segments(rank, n, numel, segment_bytes, mine):
    nbytes, k = numel * 4, math.ceil(numel * 4 / segment_bytes)
    for op, due, did, does, who in (
            ("send", nbytes if rank < n - 1 else 0, "sent", "sends", "the last"),
            ("recv", nbytes if rank else 0, "received", "receives", "rank 0")):
        sizes = [b for _, o, _, b in mine if o == op]
        if sum(sizes) != due:
            return (f"it {did} {sum(sizes)} bytes in all; each rank but {who} {does} "
                    f"the whole tensor once, S = {nbytes} bytes, and no more.")
        if due and (len(sizes) != k or max(sizes) > segment_bytes):
            return (f"the messages it {did} carried {sizes} bytes; cut the tensor into k = {k} "
                    f"segments of at most segment_bytes (tensor.view(-1).split("
                    "segment_bytes // 4) for float32), one message each.")
    return None


def _chain_pipelined(rank, n, mine):
    """Middle ranks: segment i leaves after it has arrived, at most LOOKAHEAD receives
    after it was received."""
    if rank in (0, n - 1):
        return None
    recvs = [p for p, op, *_ in mine if op == "recv"]
    for i, position in enumerate(p for p, op, *_ in mine if op == "send"):
        if position <= recvs[i]:
            return (f"it sends segment {i} in the same batch as its receive, or before "
                    "it: it would leave before it has arrived. Pass segment i on in the "
                    "batch that receives segment i+1.")
        ahead = sum(1 for p in recvs if p < position) - (i + 1)
        if ahead > LOOKAHEAD:
            return (f"it received {ahead + i + 1} segments before passing segment {i} "
                    "on: store and forward, every rank waits for the whole tensor, "
                    "(N-1)(α + S/β). Pass each segment on as soon as it has arrived, in "
                    "the batch that receives the next one, so that all the links of the "
                    "chain carry data at once: (N+k-2)(α + S/(kβ)).")
    return None
