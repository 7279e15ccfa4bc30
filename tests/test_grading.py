# Run: .venv/bin/python -m pytest tests/test_grading.py   (~30 s)
"""Graders: labsupport.grading's checks on right and wrong rings.

Layer 1 (unit): each check passes a correct ring and fails each plausible
wrong one with the message that tells the student what to fix; deadlocks end
at the deadline. The nbgrader pipeline on the assignments that use these
checks is in tests/test_grading_rabenseifner.py (assignment 1).
"""
import time

import pytest
import torch
import torch.distributed as dist

import labsupport as ls
from failing import fails, stopped_as_a_stall
from grading_rings import (
    all_reduce_inside,
    batched_reduce_scatter,
    chunk_reduce_scatter,
    direct_all_gather,
    endless,
    exchange,
    not_written_yet,
    raises_on_rank_1,
    rank0_silent_all_gather,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    send_first_reduce_scatter,
    unwaited_recv_reduce_scatter,
    whole_buffer_all_reduce,
)
from labsupport import p2p_log
from labsupport.launch import limits

SHORT = 2.0  # s, deadline of the unit tests that deadlock on purpose

# -- layer 1: the checks ----------------------------------------------------------------

@pytest.mark.parametrize("check, fn", [
    (ls.grading.check_reduce_scatter, ring_reduce_scatter),
    (ls.grading.check_reduce_scatter, batched_reduce_scatter),
    (ls.grading.check_all_gather, ring_all_gather),
    (ls.grading.check_allreduce, ring_all_reduce),
], ids=["reduce_scatter", "batched", "all_gather", "all_reduce"])
def test_a_correct_ring_passes_every_check_with_traffic(check, fn):
    check(fn, world_sizes=(1, 2, 3, 4), sizes=(4, 8, 10, 13), traffic=True)



def test_whole_buffer_ring_is_right_but_fails_the_bytes_check():
    ls.grading.check_allreduce(whole_buffer_all_reduce)  # the sums are right
    text = fails(ls.grading.check_allreduce, whole_buffer_all_reduce, world_sizes=(4,),
                 sizes=(8,), traffic=True)
    assert text.startswith("whole_buffer_all_reduce sent too many bytes: on 4 ranks with "
                           "S = 32 bytes (8 float32), rank 0 sent 96 bytes = 3.00*S")
    assert "A ring sends 2(N-1)/N*S = 1.50*S per rank" in text
    assert "a ring passing the whole tensor at each step" in text


def test_sending_past_the_neighbours_fails_the_traffic_check_only():
    ls.grading.check_all_gather(direct_all_gather)  # the result is right
    text = fails(ls.grading.check_all_gather, direct_all_gather, world_sizes=(4,),
                 sizes=(8,), traffic=True)
    assert text.startswith("direct_all_gather is not a ring on 4 ranks: rank 0 sent to "
                           "ranks [2, 3]; rank 0 received from ranks [1, 2]")
    assert "only to its right neighbour, (rank + 1) % world_size" in text
    ls.grading.check_all_gather(direct_all_gather, world_sizes=(2,), traffic=True)  # a ring of 2


def test_a_collective_inside_fails_naming_it():
    text = fails(ls.grading.check_reduce_scatter, all_reduce_inside)
    assert text.startswith("all_reduce_inside called a collective (rank 0: dist.all_reduce "
                           "(1x); rank 1: dist.all_reduce (1x))")
    assert "dist.send/dist.recv or dist.isend/dist.irecv" in text


def test_torch_chunk_fails_on_uneven_sizes_only():
    ls.grading.check_reduce_scatter(chunk_reduce_scatter, sizes=(8, 12))
    text = fails(ls.grading.check_reduce_scatter, chunk_reduce_scatter, sizes=(10,))
    assert text.startswith("chunk_reduce_scatter is not a reduce-scatter on 4 ranks for a "
                           "tensor of 10 elements (chunks of 3, 3, 2, 2 elements):\n"
                           "  rank 3, chunk 3 (elements 8:10): got ")
    assert "chunk i must be tensor.tensor_split(world_size)[i] (torch.chunk" in text


def test_a_send_first_deadlock_ends_at_the_deadline_saying_who_waited_for_what():
    t0 = time.monotonic()
    text = fails(ls.grading.check_reduce_scatter, send_first_reduce_scatter, timeout=SHORT)
    assert stopped_as_a_stall(text, time.monotonic() - t0, SHORT)
    assert text.startswith("send_first_reduce_scatter did not finish within 2 s on 2 ranks "
                           "(on a tensor of 8 elements); the stuck ranks were stopped:\n"
                           "  rank 0 waited 2 s in dist.send of its chunk 1 to rank 1, which "
                           "had not posted the matching receive; rank 1 was itself blocked "
                           "in dist.send to rank 0.")
    assert "Every stuck rank was sending" in text
    assert "dist.send(chunks[(rank - step - 1) % n], (rank + 1) % n)" in text  # where
    assert 'File "labsupport/' not in text and 'File "torch/' not in text


def test_a_rank_that_never_sends_names_the_missing_chunk():
    text = fails(ls.grading.check_all_gather, rank0_silent_all_gather, world_sizes=(4,),
                 sizes=(8,), timeout=SHORT)
    # Rank 0 receives its 3 chunks and returns; rank 1 waits for rank 0's first.
    assert "  rank 1 waited 2 s for rank 0's chunk 0 (dist.irecv); rank 0 had already " \
           "returned without sending it.\n" in text
    assert "  rank 2 waited 2 s for rank 1's chunk 0 (dist.irecv); rank 1 was itself " \
           "blocked in dist.irecv from rank 0.\n" in text


def test_a_receive_never_waited_for_is_named():
    # Whether gloo then also hangs depends on timing: both endings name the irecv.
    text = fails(ls.grading.check_reduce_scatter, unwaited_recv_reduce_scatter,
                 timeout=SHORT)
    assert "without waiting for" in text and "dist.irecv of a separate 4-element tensor" in text
    assert ".wait()" in text


def test_an_endless_loop_is_stopped_and_shown():
    text = fails(ls.grading.check_allreduce, endless, world_sizes=(2,), timeout=SHORT)
    assert "rank 0 was not waiting for any message: it was still running Python code" in text
    # where the loop was stopped: its header or its body, whichever line the signal met
    assert 'in endless\n    while True:' in text or 'in endless\n    pass' in text, text


def test_an_exception_on_one_rank_is_reported_with_its_traceback():
    text = fails(ls.grading.check_reduce_scatter, raises_on_rank_1, timeout=SHORT)
    assert text.startswith("raises_on_rank_1 failed on 2 ranks (on a tensor of 8 elements): "
                           "rank 1 raised ValueError: rank 1 is broken")
    assert 'raise ValueError("rank 1 is broken")' in text


def test_an_unwritten_solution_says_where_to_write():
    text = fails(ls.grading.check_all_gather, not_written_yet)
    assert text.endswith("Write your solution in place of `raise NotImplementedError()`.")


def test_after_every_failure_the_next_check_passes():
    for wrong in (all_reduce_inside, send_first_reduce_scatter, unwaited_recv_reduce_scatter):
        fails(ls.grading.check_reduce_scatter, wrong, timeout=SHORT)
        ls.grading.check_reduce_scatter(ring_reduce_scatter, traffic=True)


def test_run_returns_values_and_records_for_any_function():
    def pass_right(x):
        out = torch.empty(1)
        rank, n = dist.get_rank(), dist.get_world_size()
        exchange([torch.full((1,), x + rank)], 0, out, rank, n)
        return out.item()

    calls = ls.grading.run(pass_right, 10.0, world_size=4)
    assert [c["value"] for c in calls] == [13.0, 10.0, 11.0, 12.0]
    assert [c["sent"] for c in calls] == [4] * 4
    ls.grading.assert_rules(calls, "pass_right")
    calls = ls.grading.run(lambda: dist.all_reduce(torch.ones(1)), world_size=2)
    ls.grading.assert_rules(calls, "f", allowed=("all_reduce",))
    with pytest.raises(AssertionError, match="called a collective"):
        ls.grading.assert_rules(calls, "f")


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(fn=None), TypeError, "pass the function to check"),
    (dict(world_sizes=()), ValueError, "world_sizes must be a non-empty sequence"),
    (dict(sizes=(8, 0)), ValueError, "sizes must be a non-empty sequence of positive"),
    (dict(timeout=-1), ValueError, "timeout must be a positive number of seconds"),
])
def test_bad_arguments_say_what_to_pass(kwargs, error, match):
    kwargs = {"fn": ring_all_reduce, **kwargs}
    with pytest.raises(error, match=match):
        ls.grading.check_allreduce(**kwargs)


def test_the_deadline_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("LABSUPPORT_GRADING_TIMEOUT", "7.5")
    assert limits.grading_timeout() == 7.5
    monkeypatch.setenv("LABSUPPORT_GRADING_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="LABSUPPORT_GRADING_TIMEOUT='soon'"):
        limits.grading_timeout()


def test_chunk_bounds_and_names_follow_tensor_split():
    assert p2p_log.chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    t = torch.zeros(10)
    assert [p2p_log.describe_tensor(c, t, 4) for c in t.tensor_split(4)] == \
        ["chunk 0", "chunk 1", "chunk 2", "chunk 3"]
    assert p2p_log.describe_tensor(t[1:4], t, 4) == "elements 1:4 of the tensor"
    assert p2p_log.describe_tensor(torch.zeros(3), t, 4) == "a separate 3-element tensor"
    assert p2p_log.describe_tensor(torch.zeros(3), None, 4) == "a 3-element tensor"

