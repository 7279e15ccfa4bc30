# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest \
#   tests/test_grading_zigzag_ring_attention.py   (add -m "not slow": the checks alone)
"""Assignment 6 (zig-zag ring attention): its checks, then the real nbgrader pipeline.

Layer 1 (unit): labsupport.grading.zigzag_ring_attention's checks pass the
reference (the source notebook's, ``sources.reference``) and fail each plausible
wrong one with the message that tells the student what to fix (a contiguous layout
is right but unbalanced; a wrong merge; q sent too; a collective; a deadlock ends at the deadline).
Layer 4 (slow): `nbgrader generate_assignment`, `autograde` and `export` on
the assignment with five submissions whose scores per test cell are known.
"""


import labsupport as ls
import sources
from failing import fails
from grading_zigzag_ring_attention_cases import (
    all_gather_attention,
    blocking_attention,
    contiguous_positions,
    contiguous_ring_attention,
    overlapping_positions,
    sends_q_too_attention,
    wrong_merge_attention,
    zigzag_positions,
)
from nbgrader_run import RoundTrip

ASSIGNMENT = "zigzag_ring_attention"
SHORT = 2.0  # s, deadline of the unit test that deadlocks on purpose
g = ls.grading.zigzag_ring_attention
ref = sources.reference(ASSIGNMENT)



# -- layer 1: the checks ----------------------------------------------------------------

def test_the_reference_passes_every_check():
    g.check_positions(ref.zigzag_positions)
    g.check_output(ref.zigzag_positions, ref.zigzag_ring_attention, lengths=(8, 16, 24, 40))
    g.check_traffic(ref.zigzag_positions, ref.zigzag_ring_attention)
    g.check_balance(ref.zigzag_positions, ref.zigzag_ring_attention)


def test_contiguous_blocks_are_right_but_lose_the_balance_check():
    g.check_output(contiguous_positions, contiguous_ring_attention)
    g.check_traffic(contiguous_positions, contiguous_ring_attention)
    text = fails(g.check_balance, contiguous_positions, contiguous_ring_attention)
    assert "unbalanced on 2 ranks" in text and "[4.0, 8.0]" in text  # 1 and 2 blocks of 4 units
    assert "chunks r and 2N-1-r" in text
    text = fails(g.check_balance, contiguous_positions, contiguous_ring_attention,
                 world_sizes=(4,))
    assert "[4.0, 8.0, 12.0, 16.0]" in text and "rank 3 does 16" in text


def test_a_wrong_merge_fails_the_output_check_and_names_the_position():
    text = fails(g.check_output, zigzag_positions, wrong_merge_attention, world_sizes=(2,))
    assert "is not causal attention on 2 ranks, s=8" in text
    assert "sequence position" in text and "log-sum-exp merge" in text


def test_positions_held_twice_fail_with_the_positions():
    text = fails(g.check_positions, overlapping_positions)
    assert "positions [0, 1, 2, 3] are held by more than one rank" in text
    text = fails(g.check_positions, lambda s, r, n: list(range(s // n)))
    assert "give a 1-D integer tensor of 4 positions" in text


def test_sending_q_too_fails_the_traffic_check():
    g.check_output(zigzag_positions, sends_q_too_attention, world_sizes=(2,), lengths=(8,))
    text = fails(g.check_traffic, zigzag_positions, sends_q_too_attention)
    assert "rank 0: 1.5" in text and "expected 1 each" in text and "Sending more" in text


def test_a_collective_is_refused():
    text = fails(g.check_output, zigzag_positions, all_gather_attention, world_sizes=(2,))
    assert "called a collective (rank 0: dist.all_gather (2x)" in text


def test_a_deadlock_ends_at_the_deadline_with_an_explanation():
    text = fails(g.check_output, zigzag_positions, blocking_attention, world_sizes=(2,),
                 timeout=SHORT)
    assert "did not finish within 2 s on 2 ranks" in text and "dist.send" in text


# -- layer 4: nbgrader on assignment 6 ----------------------------------------------------

CONTIGUOUS_POSITIONS = '''
def zigzag_positions(seq_len, rank, world_size):
    c = seq_len // world_size  # contiguous, not zig-zag
    return torch.arange(rank * c, (rank + 1) * c)
'''.strip()
CONTIGUOUS_ATTENTION = '''
def zigzag_ring_attention(q, k, v):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    c = q.shape[-2]
    q_pos = torch.arange(rank * c, (rank + 1) * c)
    kv, out, lse = torch.stack([k, v]), None, None
    for step in range(world_size):
        src = (rank - step) % world_size
        incoming, requests = torch.empty_like(kv), []
        if step < world_size - 1:
            requests = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, kv, (rank + 1) % world_size),
                dist.P2POp(dist.irecv, incoming, (rank - 1) % world_size)])
        if src <= rank:
            k_pos = torch.arange(src * c, (src + 1) * c)
            o, l = block_attention(q, kv[0], kv[1], k_pos[None, :] <= q_pos[:, None])
            out, lse = (o, l) if out is None else lse_merge(out, lse, o, l)
        for request in requests:
            request.wait()
        kv = incoming
    return out
'''.strip()
AVERAGE = ("def average_merge(out, lse, o, l):\n"
           "    return (out + o) / 2, torch.logaddexp(lse, l)\n\n\n")
SENDS = ("requests = dist.batch_isend_irecv([\n"
         "                dist.P2POp(dist.isend, kv, (rank + 1) % world_size),\n"
         "                dist.P2POp(dist.irecv, incoming, (rank - 1) % world_size)])")
BLOCKING = ("dist.send(kv, (rank + 1) % world_size)\n"
            "            dist.recv(incoming, (rank - 1) % world_size)")
# name -> {grade_id: that cell's source, or a function applied to the reference's};
# a cell not named keeps the reference's; None: the untouched student version.
SUBMISSIONS = {
    "reference": {},
    "untouched": None,
    "contiguous": {"zigzag_positions": CONTIGUOUS_POSITIONS,
                   "zigzag_ring_attention": CONTIGUOUS_ATTENTION},
    "wrong_merge": {"zigzag_ring_attention":
                    lambda src: AVERAGE + src.replace("lse_merge(", "average_merge(")},
    "deadlock": {"zigzag_ring_attention": lambda src: src.replace(SENDS, BLOCKING)},
}
CELLS = {"test_positions": 1, "test_output_2": 2, "test_output_4": 3, "test_traffic": 2,
         "test_balance": 2}
FAILED = {  # submission -> the test cells that score zero, and what their message says
    "reference": {},
    "untouched": dict.fromkeys(CELLS, "NotImplementedError"),
    "contiguous": {"test_balance": "is unbalanced on 2 ranks"},
    "wrong_merge": dict.fromkeys(("test_output_2", "test_output_4"), "log-sum-exp merge"),
    "deadlock": dict.fromkeys(("test_output_2", "test_output_4", "test_traffic",
                               "test_balance"), "did not finish within 4 s"),
}


class TestNbgrader(RoundTrip):
    assignment, submissions, cells, failed = ASSIGNMENT, SUBMISSIONS, CELLS, FAILED
    totals = {"reference": 10, "untouched": 0, "contiguous": 8, "wrong_merge": 5,
              "deadlock": 1}
    stubs, hidden = 2, ("lengths=(40,)",)
    try_cell, try_fails = "try-zigzag", ("untouched", "deadlock")
    timeout = 500
    # The deadlock waits for its deadlines beside the others (autograde's `beside`):
    # these checks count bytes and score blocks and compare values;
    # none reads a clock or the allocator.
    beside = ("deadlock",)
