"""The checks of graded assignments: a student's collective on several ranks, failed helpfully.

    import labsupport as ls                         # ls.grading: imported on first use
    ls.grading.check_allreduce(ring_all_reduce)                 # result == dist.all_reduce's
    ls.grading.check_allreduce(ring_all_reduce, traffic=True)   # and 2(N-1)/N*S bytes sent
    ls.grading.check_reduce_scatter(fn), ls.grading.check_all_gather(fn)
    calls = ls.grading.run(fn, x, world_size=4)     # any function: results, rules, deadline

Each check runs the function on every rank through the launcher, with a
deadline (``timeout``, default ``TIMEOUT``: $LABSUPPORT_GRADING_TIMEOUT or 20 s,
sized from the work: ``checking.diagnosis``), and raises AssertionError with a
message a student can act on: a wrong chunk, a collective used where the
ring must be written by hand, a request never waited for, too many bytes
sent, or, for a deadlock, which message each stuck rank waited for
(``checking.diagnosis`` and ``checking.deadlock``).
A deadlock therefore fails its nbgrader test cell once its ranks have waited
the deadline and never hangs ``nbgrader autograde``; a slow answer is not
stopped for being slow.
"""
import torch
import torch.distributed as dist

from labsupport import p2p_log, traffic
from labsupport.checking.diagnosis import log_path, name_of, run_on_ranks
from labsupport.launch import session
from labsupport.launch.limits import check_timeout

WORLD_SIZES = (2, 4)  # the world sizes every grader and chapter check runs, one home
SIZES = (8, 10, 13)  # 10 and 13 are not divisible by 4: chunks of unequal size
# What each collective leaves where; ``factor`` k: a ring sends k(N-1)/N*S bytes per rank.
_KINDS = {
    "all_reduce": dict(factor=2, title="an all-reduce", contract=(
        "After an all-reduce every element holds the sum over all ranks")),
    "reduce_scatter": dict(factor=1, title="a reduce-scatter", contract=(
        "After a reduce-scatter, chunk `rank` of tensor.tensor_split(world_size) holds the "
        "sum of that chunk over all ranks")),
    "all_gather": dict(factor=1, title="an all-gather", contract=(
        "An all-gather starts with only chunk `rank` valid on rank `rank` (here the others "
        "hold NaN) and ends with every chunk on every rank")),
}


def check_allreduce(fn, world_sizes=WORLD_SIZES, sizes=SIZES, *, timeout=None, traffic=False):
    """``fn(tensor)`` all-reduces a 1-D float32 tensor in place: checked against dist.all_reduce.

    ``traffic=True`` also checks that each rank sends only to its right neighbour
    and receives only from its left one, and the payload it sends with
    send/isend: 2(N-1)/N*S bytes, the bandwidth-optimal ring (Patarasuk & Yuan
    2009, eq. 1).
    """
    problem = _check("all_reduce", fn, world_sizes, sizes, timeout, traffic)
    if problem:  # raised here, so that the student's traceback is one short frame
        raise AssertionError(problem)


def check_reduce_scatter(fn, world_sizes=WORLD_SIZES, sizes=SIZES, *, timeout=None,
                         traffic=False):
    """``fn(tensor)`` in place: rank r's chunk r becomes its sum over ranks; (N-1)/N*S sent."""
    problem = _check("reduce_scatter", fn, world_sizes, sizes, timeout, traffic)
    if problem:
        raise AssertionError(problem)


def check_all_gather(fn, world_sizes=WORLD_SIZES, sizes=SIZES, *, timeout=None, traffic=False):
    """``fn(tensor)`` in place: chunk r of rank r goes to every rank; (N-1)/N*S sent."""
    problem = _check("all_gather", fn, world_sizes, sizes, timeout, traffic)
    if problem:
        raise AssertionError(problem)


def run(fn, *args, world_size: int, timeout=None, **kwargs) -> list[dict]:
    """``fn(*args, **kwargs)`` on every rank, recorded; a deadlock or crash -> AssertionError.

    Returns one dict per rank: ``value`` (what fn returned), ``sent`` (payload
    bytes of send/isend), ``collectives`` ({name: calls}), ``unwaited``
    (requests never waited for). ``assert_rules`` checks the last two.
    """
    _validate(fn, (world_size,), (1,), timeout)
    try:
        return run_on_ranks(_recorded_call, (fn, args, kwargs), world_size, timeout, name_of(fn))
    except AssertionError as failure:
        problem = str(failure)
    raise AssertionError(problem)


def assert_rules(calls: list[dict], name: str, allowed=()):
    """No collective (except ``allowed``) and no request left without wait(), on any rank."""
    used = {rank: ops for rank, c in enumerate(calls)
            if (ops := {op: n for op, n in c["collectives"].items() if op not in allowed})}
    if used:
        where = "; ".join(f"rank {r}: " + ", ".join(f"dist.{op} ({n}x)" for op, n in ops.items())
                          for r, ops in used.items())
        raise AssertionError(
            f"{name} called a collective ({where}). Write it with point-to-point messages "
            "only (dist.send/dist.recv or dist.isend/dist.irecv): building the collective "
            "from them is the point of the exercise.")
    unwaited = [f"rank {r}: {what}" for r, c in enumerate(calls) for what in c["unwaited"]]
    if unwaited:
        raise AssertionError(
            f"{name} returned without waiting for {len(unwaited)} request(s): "
            + "; ".join(unwaited[:4]) + ". Call .wait() on every request dist.isend/"
            "dist.irecv return: before reading an irecv's tensor (its data may not have "
            "arrived) or changing an isend's (it may not have left), and before returning.")


# -- the checks ----------------------------------------------------------------------

def _check(kind, fn, world_sizes, sizes, timeout, check_traffic) -> str | None:
    """What is wrong at the first (world size, size) that fails, or None."""
    _validate(fn, world_sizes, sizes, timeout)
    name = name_of(fn)
    for world_size in world_sizes:
        for size in sizes:  # one run each: a failed size leaves nothing for the next
            try:
                case = run_on_ranks(_trial, (fn, kind, size), world_size, timeout, name)
                assert_rules(case, name)
                _assert_result(kind, name, world_size, case)
                if check_traffic:
                    _assert_traffic(kind, name, world_size, case)
            except AssertionError as failure:
                session.current().restart()  # nothing left in flight for the next check
                return str(failure)
    return None


def _assert_result(kind, name, world_size, case):
    size = case[0]["size"]
    shapes = [f"rank {rank}: {tuple(r['shape'])}" for rank, r in enumerate(case)
              if r["shape"] != (size,)]
    if shapes:
        raise AssertionError(f"{name} must change the tensor it is given in place (or return "
                             f"one of the same shape, ({size},)); it returned "
                             + ", ".join(shapes))
    bounds = p2p_log.chunk_bounds(size, world_size)
    wrong = [f"rank {rank}, chunk {i} (elements {a}:{b}): got {_show(r['got'][a:b])}, "
             f"expected {_show(r['expected'][a:b])}"
             for rank, r in enumerate(case) for i, (a, b) in enumerate(bounds)
             if r["compared"][0] <= a and b <= r["compared"][1]
             and not torch.equal(r["got"][a:b], r["expected"][a:b])]
    if not wrong:
        return
    uneven = "" if size % world_size == 0 else (
        f" {size} is not divisible by {world_size}: chunk i must be tensor.tensor_split("
        "world_size)[i] (torch.chunk splits differently and can return fewer chunks).")
    raise AssertionError(
        f"{name} is not {_KINDS[kind]['title']} on {world_size} ranks for a tensor of {size} "
        f"elements (chunks of {', '.join(str(b - a) for a, b in bounds)} elements):\n  "
        + "\n  ".join(wrong[:4]) + f"\n{_KINDS[kind]['contract']}; the expected values "
        "are dist.all_reduce's." + uneven)


def _assert_traffic(kind, name, world_size, case):
    n = world_size
    off_ring = [f"rank {r} {verb} {sorted(peers)}" for r, c in enumerate(case)
                for verb, peers in (("sent to ranks", c["peers"]["send"] - {(r + 1) % n}),
                                    ("received from ranks", c["peers"]["recv"] - {(r - 1) % n}))
                if peers]
    if off_ring:
        raise AssertionError(
            f"{name} is not a ring on {n} ranks: " + "; ".join(off_ring[:4]) + ". In a ring "
            "each rank sends only to its right neighbour, (rank + 1) % world_size, and receives "
            "only from its left one, (rank - 1) % world_size: one link per rank, each "
            "carrying one chunk per step, whatever the number of ranks.")
    size, factor = case[0]["size"], _KINDS[kind]["factor"]
    nbytes = size * 4  # S, float32
    low, high = (factor * (n - 1) * (size // n) * 4, factor * (n - 1) * -(-size // n) * 4)
    sent = [r["sent"] for r in case]
    if sum(sent) == factor * (n - 1) * nbytes and all(low <= s <= high for s in sent):
        return
    rank = max(range(n), key=lambda r: abs(sent[r] - factor * (n - 1) * nbytes / n))
    ratio = sent[rank] / nbytes
    formula = f"{factor if factor > 1 else ''}(N-1)/N*S"
    raise AssertionError(
        f"{name} sent too {'many' if ratio > factor * (n - 1) / n else 'few'} bytes: on "
        f"{n} ranks with S = {nbytes} bytes ({size} float32), rank {rank} sent {sent[rank]} "
        f"bytes = {ratio:.2f}*S with send/isend (all ranks: {sent}). A ring sends "
        f"{formula} = {factor * (n - 1) / n:.2f}*S per rank: {'2 * ' if factor > 1 else ''}"
        f"(N-1) steps of one chunk (S/N) each." + _traffic_hint(ratio, factor, n))


def _traffic_hint(ratio, factor, n) -> str:
    if ratio == 0:
        return " No bytes went through dist.send/dist.isend: the data moved some other way."
    if abs(ratio - factor * (n - 1)) < 0.5 or abs(ratio - (n - 1)) < 0.5:
        return " That is what a ring passing the whole tensor at each step sends."
    return ""


def _show(t) -> str:
    return "[" + ", ".join(f"{v:g}" for v in t.tolist()) + "]"


def _validate(fn, world_sizes, sizes, timeout):
    if not callable(fn):
        raise TypeError(f"pass the function to check, e.g. check_allreduce(ring_all_reduce); "
                        f"got {type(fn).__name__}")
    for label, values in (("world_sizes", world_sizes), ("sizes", sizes)):
        if not values or not all(isinstance(v, int) and v >= 1 for v in values):
            raise ValueError(f"{label} must be a non-empty sequence of positive integers, "
                             f"got {values!r}")
    if timeout is not None:
        check_timeout(timeout)


# -- on each rank ---------------------------------------------------------------------

def _recorded_call(log_dir, fn, args, kwargs) -> dict:
    with p2p_log.record(log_path(log_dir, dist.get_rank())) as rec, \
            traffic.count(settle=0) as counted:
        value = fn(*args, **kwargs)
    return dict(value=value, sent=counted.sent, collectives=rec.collectives,
                unwaited=rec.unwaited())


def _trial(log_dir, fn, kind, size) -> dict:
    tensor, expected, compared = _case(kind, size)
    with p2p_log.record(log_path(log_dir, dist.get_rank()), buffer=tensor) as rec, \
            traffic.count(settle=0) as counted:
        rec.note(f"a tensor of {size} elements")
        out = fn(tensor)
    got = out if isinstance(out, torch.Tensor) else tensor
    shape = tuple(got.shape)
    got = got.detach().float().reshape(-1) if shape == (size,) else expected * float("nan")
    return dict(size=size, got=got, expected=expected, compared=compared, shape=shape,
                sent=counted.sent, collectives=rec.collectives, unwaited=rec.unwaited(),
                peers=rec.peers)


def _case(kind, size):
    """(input, expected result, compared [start, end)) for this rank; integer values,
    so every order of summation gives the same floats."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1000 * size + rank)
    tensor = torch.randint(-9, 10, (size,), generator=g).float()
    expected = tensor.clone()
    dist.all_reduce(expected)  # the production API is the reference
    a, b = p2p_log.chunk_bounds(size, world_size)[rank]
    if kind == "reduce_scatter":
        return tensor, expected, (a, b)
    if kind == "all_gather":
        tensor = torch.full_like(expected, float("nan"))
        tensor[a:b] = expected[a:b]
    return tensor, expected, (0, size)
