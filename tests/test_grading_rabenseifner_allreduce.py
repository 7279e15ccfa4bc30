# Run: .venv/bin/python -m pytest \
#   tests/test_grading_rabenseifner_allreduce.py   (~2 min; -m "not slow": ~20 s)
"""Assignment 1 (Rabenseifner's all-reduce): its checks, then the real nbgrader pipeline.

Layer 1 (unit): ``labsupport.grading.rabenseifner_allreduce`` counts rounds and
bytes; the reference (the source notebook's, ``sources.reference``) passes every
check, chapter 2's ring passes all but the rounds, an all-to-all fails the bytes, a
deadlock ends at the deadline. Layer 4 (slow): `nbgrader generate_assignment`,
`autograde` and `export` on five submissions whose scores, per test cell and in the
exported CSV, are known.
"""
import inspect
import textwrap
import time

import pytest
import torch.distributed as dist

import grading_rabenseifner_allreduce_cases as fns
import labsupport as ls
import sources
from failing import fails, stopped_as_a_stall
from grading_rings import direct_all_gather, ring_all_reduce
from labsupport.grading import rabenseifner_allreduce as gr
from nbgrader_run import TimedRoundTrip

ASSIGNMENT = "rabenseifner_allreduce"
ref = sources.reference(ASSIGNMENT)
SHORT = 2.0  # s, deadline of the unit tests that deadlock on purpose



# -- layer 1: the checks ----------------------------------------------------------------

def test_count_rounds_counts_runs_of_sends_to_one_partner():
    assert gr.count_rounds([("isend", 2), ("irecv", 2), ("isend", 1), ("irecv", 1)]) == 2
    assert gr.count_rounds([("recv", 1), ("send", 1), ("recv", 2), ("send", 2)]) == 2
    assert gr.count_rounds([("isend", 1), ("isend", 1), ("irecv", 1)]) == 1  # one round, 2 parts
    assert gr.count_rounds([("isend", 1), ("isend", 2), ("isend", 3)]) == 3  # one link out
    assert gr.count_rounds([]) == 0


def test_the_reference_passes_every_check():
    ls.grading.check_reduce_scatter(ref.halving_reduce_scatter, world_sizes=(1, 2, 4, 8),
                                    sizes=(8, 10, 13, 17))
    ls.grading.check_all_gather(ref.doubling_all_gather, world_sizes=(1, 2, 4, 8),
                                sizes=(8, 13, 17))
    ls.grading.check_allreduce(ref.rabenseifner_all_reduce)
    gr.check_rounds(ref.rabenseifner_all_reduce, world_sizes=(1, 2, 4, 8))
    gr.check_traffic(ref.rabenseifner_all_reduce, world_sizes=(1, 2, 4, 8),
                     sizes=(8, 10, 13, 17))
    gr.check_rounds(ref.halving_reduce_scatter, "reduce_scatter")
    gr.check_traffic(ref.doubling_all_gather, "all_gather")


def test_the_ring_is_right_but_loses_the_rounds_saying_why():
    gr.check_traffic(ring_all_reduce)  # the ring's bytes are Rabenseifner's
    gr.check_rounds(ring_all_reduce, world_sizes=(2,))  # on 2 ranks they are the same
    text = fails(gr.check_rounds, ring_all_reduce)
    assert text.startswith("ring_all_reduce took 6 rounds on rank 0 of 4 (a tensor of 8 "
                           "elements; every rank: [6, 6, 6, 6]); it sent to ranks "
                           "[1, 1, 1, 1, 1, 1], in this order.")
    assert "takes 4 = 2log2(N) rounds" in text
    assert "is what a ring takes: its results are right, but every round costs a message " \
           "latency" in text


def test_an_all_to_all_fails_the_bytes_and_the_rounds():
    ls.grading.check_reduce_scatter(fns.alltoall_reduce_scatter)  # right sums
    text = fails(gr.check_traffic, fns.alltoall_reduce_scatter, "reduce_scatter")
    assert text.startswith("alltoall_reduce_scatter sent too many bytes: on 2 ranks with S = "
                           "32 bytes (8 float32), rank 0 sent 32 bytes = 1.00*S")
    assert "sending the whole tensor to every other rank sends (an all-to-all)" in text
    text = fails(gr.check_rounds, fns.alltoall_reduce_scatter, "reduce_scatter")
    assert "took 3 rounds on rank 0 of 4" in text and "one link out" in text


def test_chunks_sent_straight_to_their_owners_have_the_bytes_not_the_rounds():
    gr.check_traffic(fns.direct_reduce_scatter, "reduce_scatter")
    gr.check_traffic(direct_all_gather, "all_gather")
    text = fails(gr.check_rounds, direct_all_gather, "all_gather")
    assert "it sent to ranks [1, 2, 3]" in text and "takes 2 = log2(N) rounds" in text


def test_a_half_that_sends_nothing_fails_the_bytes():
    text = fails(gr.check_traffic, lambda tensor: None, "all_gather", world_sizes=(2,))
    assert "sent too few bytes" in text and "No bytes went through dist.send" in text


def test_a_collective_inside_fails_every_check():
    def all_reduce_inside(tensor):
        dist.all_reduce(tensor)
    for check in (gr.check_rounds, gr.check_traffic):
        assert "called a collective (rank 0: dist.all_reduce (1x)" in fails(
            check, all_reduce_inside, world_sizes=(2,))


def test_a_deadlock_ends_at_the_deadline_saying_who_waited():
    t0 = time.monotonic()
    text = fails(gr.check_rounds, fns.send_first_reduce_scatter, "reduce_scatter",
                 timeout=SHORT)
    assert stopped_as_a_stall(text, time.monotonic() - t0, SHORT)
    assert text.startswith("send_first_reduce_scatter did not finish within 2 s on 2 ranks")
    assert "Every stuck rank was sending" in text
    gr.check_rounds(ref.rabenseifner_all_reduce)  # the next check runs on fresh ranks


@pytest.mark.parametrize("kwargs, match", [
    (dict(kind="broadcast"), "kind must be one of"),
    (dict(world_sizes=(2, 3)), "world_sizes must be powers of two"),
])
def test_bad_arguments_say_what_to_pass(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gr.check_rounds(ref.rabenseifner_all_reduce, **kwargs)


# -- layer 4: nbgrader on assignment 1 ------------------------------------------------

def cell(source: str) -> str:
    return textwrap.dedent(source).strip("\n")


def renamed(fn, name) -> str:
    """A test-module function's source as the student's cell defining ``name``."""
    return cell(inspect.getsource(fn)).replace(f"def {fn.__name__}(", f"def {name}(", 1)


RING = {  # chapter 2's ring, under the names of this assignment
    "halving_reduce_scatter": cell("""
        def halving_reduce_scatter(tensor):
            rank, world_size = dist.get_rank(), dist.get_world_size()
            chunks = tensor.tensor_split(world_size)
            right, left = (rank + 1) % world_size, (rank - 1) % world_size
            for step in range(world_size - 1):
                send_i = (rank - step - 1) % world_size
                recv_i = (rank - step - 2) % world_size
                received = torch.empty_like(chunks[recv_i])
                requests = dist.batch_isend_irecv([
                    dist.P2POp(dist.isend, chunks[send_i], right),
                    dist.P2POp(dist.irecv, received, left)])
                for request in requests:
                    request.wait()
                chunks[recv_i].add_(received)"""),
    "doubling_all_gather": cell("""
        def doubling_all_gather(tensor):
            rank, world_size = dist.get_rank(), dist.get_world_size()
            chunks = tensor.tensor_split(world_size)
            right, left = (rank + 1) % world_size, (rank - 1) % world_size
            for step in range(world_size - 1):
                send_i = (rank - step) % world_size
                recv_i = (rank - step - 1) % world_size
                requests = dist.batch_isend_irecv([
                    dist.P2POp(dist.isend, chunks[send_i], right),
                    dist.P2POp(dist.irecv, chunks[recv_i], left)])
                for request in requests:
                    request.wait()"""),
}
SUBMISSIONS = {
    "reference": {},
    "untouched": None,
    "deadlock": {"halving_reduce_scatter": renamed(fns.send_first_reduce_scatter,
                                                   "halving_reduce_scatter")},
    "ring": RING,
    "all_to_all": {"halving_reduce_scatter": renamed(fns.alltoall_reduce_scatter,
                                                     "halving_reduce_scatter"),
                   "doubling_all_gather": renamed(direct_all_gather, "doubling_all_gather")},
}
CELLS = {"test_reduce_scatter": 2, "test_reduce_scatter_uneven": 1, "test_all_gather": 2,
         "test_all_gather_uneven": 1, "test_all_reduce": 1, "test_bytes_sent": 1,
         "test_rounds": 2}
STUCK = "Every stuck rank was sending"
FAILED = {  # submission -> the test cells that score zero, and what their message says
    "reference": {},
    "untouched": {name: "in place of `raise NotImplementedError()`" for name in CELLS},
    "deadlock": dict.fromkeys(("test_reduce_scatter", "test_reduce_scatter_uneven",
                               "test_all_reduce", "test_bytes_sent", "test_rounds"), STUCK),
    "ring": {"test_rounds": "is what a ring takes"},
    "all_to_all": {"test_bytes_sent": "(an all-to-all)", "test_rounds": "one link out"},
}


class TestNbgrader(TimedRoundTrip):
    assignment, submissions, cells, failed = ASSIGNMENT, SUBMISSIONS, CELLS, FAILED
    totals = {"reference": 10, "untouched": 0, "deadlock": 3, "ring": 8,
              "all_to_all": 7}
    stubs, hidden = 2, ("sizes=(10, 13)",)  # the hidden sizes
    # The ungraded try-out cell fails where the sum or the rounds are wrong.
    try_cell = "try-all-reduce"
    try_fails = tuple(s for s in SUBMISSIONS if s != "reference")
    deadlocked = ("try-all-reduce", "test-reduce-scatter", "test-reduce-scatter-uneven",
                  "test-all-reduce", "test-bytes-sent", "test-rounds")
    max_autograde_s = 240
    # The deadlock waits for its deadlines beside the others (autograde's `beside`):
    # these checks count rounds and bytes and compare sums;
    # none reads a clock or the allocator.
    beside = ("deadlock",)
