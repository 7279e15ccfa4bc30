# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest \
#   tests/test_grading_reshard_to_tensor_parallel.py
# (add -m "not slow" for the checks alone)
"""Graded assignment 8 (a ZeRO-3 checkpoint loaded as TP shards): its checks, then nbgrader.

Layer 1 (unit): each check passes the reference (the source notebook's,
``sources.reference``) and fails each plausible wrong answer with the
message that says what to fix (reading whole flat tensors, in
grading_reshard_to_tensor_parallel_cases.py: the bytes; copying the
grader's expected values with reads that only add up, there too: the
values read; splitting row-parallel weights by rows, an edit of the
reference: their shape; a wrong offset: the element, file and byte; a
deadlock, an edit too: at the deadline). Layer 4 (slow): `nbgrader
generate_assignment`, `autograde` and `export` on the assignment in a
temporary course directory, with five submissions whose scores are known.
"""
import functools
import inspect
import re
import time

import grading_reshard_to_tensor_parallel_cases as cases
import labsupport.grading.reshard_to_tensor_parallel as gr
import sources
from failing import fails, stopped_as_a_stall
from nbgrader_run import RoundTrip

ASSIGNMENT = "reshard_to_tensor_parallel"
SOLUTION = "load_tp_shard"  # grade_id of the solution cell
SHORT = 3.0  # s, deadline of the unit test that deadlocks on purpose
CHECKS = (gr.check_column, gr.check_row, gr.check_replicated, gr.check_bytes)
# Wrong answers that differ from the reference in one thing, as edits of its cell.
WRONG = {
    "rows_only": (("        if dim == 0:                                     # whole rows",
                   "        if dim in (0, 1):  # whole rows, row-parallel o and fc2 too"),),
    "deadlock": (("    ### BEGIN SOLUTION\n",  # ranks 1.. wait for a broadcast never sent
                  "    ### BEGIN SOLUTION\n    if tp_rank != 0:\n"
                  "        dist.broadcast(torch.zeros(1), src=0)\n"),),
}


def edit(name):
    return sources.replaced(*WRONG[name])


@functools.cache
def answer(name=""):
    """The reference's load_tp_shard (name "") or a wrong answer's, read from the source
    notebook on first use: its definitions include `saved = gr.checkpoints()`, which
    trains the checkpoints (once per process), so not at collection."""
    return sources.reference(ASSIGNMENT, {SOLUTION: edit(name)} if name else None,
                             name).load_tp_shard



# -- layer 1: the checks ----------------------------------------------------------------

def test_the_reference_passes_every_check():
    for check in CHECKS:
        check(answer())


def test_reading_whole_tensors_loses_the_bytes_only():
    for check in CHECKS[:3]:
        check(cases.reads_whole)
    text = fails(gr.check_bytes, cases.reads_whole)
    assert re.match(r"checkpoint saved by 2 ranks: tp rank 0 read [\d,]+ bytes through "
                    r"reader.read; its shards \(3 kinds\) are [\d,]+ bytes", text), text
    assert "read only each shard's elements" in text


def test_copied_values_with_reads_that_only_add_up_lose_the_bytes():
    # labsupport.grading is importable by students: gr.expected gives the right values;
    # the bytes check must see that the values returned are the ones read
    for check in CHECKS[:3]:
        check(cases.copies_the_answer)
    text = fails(gr.check_bytes, cases.copies_the_answer)
    assert re.match(r"checkpoint saved by 2 ranks: tp rank 0 read as many bytes as its "
                    r"shards hold, but returned other values than it read \(e.g. \S+, which "
                    r"it never read\): every element returned must come from its own read",
                    text), text


def test_row_parallel_weights_split_by_rows_lose_the_row_check_only():
    for check in (gr.check_column, gr.check_replicated, gr.check_bytes):
        check(answer("rows_only"))
    text = fails(gr.check_row, answer("rows_only"))
    assert text.startswith("checkpoint saved by 2 ranks, tp rank 0 of 4, param of "
                           "blocks.0.attn.o.weight: shape (4, 16), expected (16, 4): it is "
                           "row-parallel, split along dim 1"), text


def test_a_wrong_offset_names_the_element_file_and_byte():
    reference = answer()

    def off_by_one_piece(reader, kind, tp_rank, tp_size):
        """Wrong: every piece's byte offset one float too far."""
        shifted = gr.Reader.__new__(gr.Reader)
        shifted.__dict__.update(reader.__dict__)
        shifted.read = lambda file, offset, nbytes: reader.read(
            file, min(offset + 4, reader.metadata["files"][file] - nbytes), nbytes)
        return reference(shifted, kind, tp_rank, tp_size)

    text = fails(gr.check_replicated, off_by_one_piece)
    assert "element (0,) of the shard is" in text and "which rank0.bin holds at byte" in text


def test_a_deadlock_ends_at_the_deadline_then_the_next_check_passes():
    t0 = time.monotonic()
    text = fails(gr.check_column, answer("deadlock"), timeout=SHORT)
    assert stopped_as_a_stall(text, time.monotonic() - t0, SHORT)
    assert text.startswith("load_on_tp_ranks did not finish within 3 s on 4 ranks"), text
    assert "rank 1 waited 3 s in dist.broadcast, which every rank of its group" in text
    assert "line 5, in load_tp_shard" in text   # where they were: the cell's broadcast
    gr.check_column(answer())


def test_an_unwritten_solution_says_where_to_write():
    def load_tp_shard(reader, kind, tp_rank, tp_size):
        raise NotImplementedError()
    assert "in place of `raise NotImplementedError()`" in fails(gr.check_bytes, load_tp_shard)


# -- layer 4: nbgrader on assignment 8 ------------------------------------------------

def pasted(*fns) -> str:
    """The functions' sources, the last one under the assignment's function name."""
    *helpers, main = fns
    source = inspect.getsource(main).replace(f"def {main.__name__}(", f"def {SOLUTION}(", 1)
    return "\n\n".join(inspect.getsource(fn) for fn in helpers) + "\n\n" + source


SUBMISSIONS = {
    "reference": {},
    "untouched": None,
    "reads_whole": {SOLUTION: pasted(cases._flat, cases.reads_whole)},
    **{name: {SOLUTION: edit(name)} for name in ("rows_only", "deadlock")},
}
CELLS = {"test_column": 3, "test_row": 3, "test_replicated": 1, "test_bytes": 3}
FAILED = {  # submission -> the test cells that score zero, and what their message says
    "reference": {},
    "untouched": {name: "in place of `raise NotImplementedError()`" for name in CELLS},
    "reads_whole": {"test_bytes": "read only each shard's elements"},
    "rows_only": {"test_row": "row-parallel, split along dim 1"},
    "deadlock": {name: "did not finish within 4 s" for name in CELLS},
}


class TestNbgrader(RoundTrip):
    assignment, submissions, cells, failed = ASSIGNMENT, SUBMISSIONS, CELLS, FAILED
    totals = {"reference": 10, "untouched": 0, "reads_whole": 7, "rows_only": 7,
              "deadlock": 0}
    stubs, hidden = 1, ("def elements(",)
    # The deadlock waits for its deadlines beside the others (autograde's `beside`):
    # these checks count elements and bytes and compare values;
    # none reads a clock or the allocator.
    beside = ("deadlock",)
