# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_grading_reshard_to_tensor_parallel.py
# (add -m "not slow" for the checks alone)
"""Graded assignment 8 (a ZeRO-3 checkpoint loaded as TP shards): its checks, then nbgrader.

Layer 1 (unit): each check passes the reference and fails each plausible
wrong answer with the message that says what to fix (reading whole flat
tensors: the bytes; splitting row-parallel weights by rows: their shape; a
deadlock: at the deadline). Layer 4 (slow): `nbgrader generate_assignment`,
`autograde` and `export` on the assignment in a temporary course
directory, with five submissions whose scores are known.
"""
import inspect
import re
import time

import nbformat
import pytest

import grading_reshard_fns as fns
import labsupport.grading.reshard_to_tensor_parallel as gr
from nbgrader_run import assert_cell_scores, assert_exported_totals, autograde, source_path

ASSIGNMENT = "reshard_to_tensor_parallel"
SHORT = 3.0  # s, deadline of the unit test that deadlocks on purpose
CHECKS = (gr.check_column, gr.check_row, gr.check_replicated, gr.check_bytes)


def fails(check, *args, **kwargs) -> str:
    with pytest.raises(AssertionError) as info:
        check(*args, **kwargs)
    return str(info.value)


# -- layer 1: the checks ----------------------------------------------------------------

def test_the_reference_passes_every_check():
    for check in CHECKS:
        check(fns.load_tp_shard)


def test_reading_whole_tensors_loses_the_bytes_only():
    for check in CHECKS[:3]:
        check(fns.reads_whole)
    text = fails(gr.check_bytes, fns.reads_whole)
    assert re.match(r"checkpoint saved by 2 ranks: tp rank 0 read [\d,]+ bytes through "
                    r"reader.read; its shards \(3 kinds\) are [\d,]+ bytes", text), text
    assert "read only each shard's elements" in text


def test_row_parallel_weights_split_by_rows_lose_the_row_check_only():
    for check in (gr.check_column, gr.check_replicated, gr.check_bytes):
        check(fns.rows_only)
    text = fails(gr.check_row, fns.rows_only)
    assert text.startswith("checkpoint saved by 2 ranks, tp rank 0 of 4, param of "
                           "blocks.0.attn.o.weight: shape (4, 16), expected (16, 4): it is "
                           "row-parallel, split along dim 1"), text


def test_a_wrong_offset_names_the_element_file_and_byte():
    text = fails(gr.check_replicated, off_by_one_piece)
    assert "element (0,) of the shard is" in text and "which rank0.bin holds at byte" in text


def off_by_one_piece(reader, kind, tp_rank, tp_size):
    """Wrong: every piece's byte offset one float too far."""
    shifted = gr.Reader.__new__(gr.Reader)
    shifted.__dict__.update(reader.__dict__)
    shifted.read = lambda file, offset, nbytes: reader.read(
        file, min(offset + 4, reader.metadata["files"][file] - nbytes), nbytes)
    return fns.load_tp_shard(shifted, kind, tp_rank, tp_size)


def test_a_deadlock_ends_at_the_deadline_then_the_next_check_passes():
    t0 = time.monotonic()
    text = fails(gr.check_column, fns.waits_for_rank0, timeout=SHORT)
    assert time.monotonic() - t0 < SHORT + 15
    assert text.startswith("load_on_tp_ranks did not finish within 3 s on 4 ranks"), text
    assert "waits_for_rank0" in text                # where the stuck ranks were
    gr.check_column(fns.load_tp_shard)


def test_an_unwritten_solution_says_where_to_write():
    def load_tp_shard(reader, kind, tp_rank, tp_size):
        raise NotImplementedError()
    assert "in place of `raise NotImplementedError()`" in fails(gr.check_bytes, load_tp_shard)


def test_the_reference_here_is_the_assignments_solution():
    nb = nbformat.read(source_path(ASSIGNMENT), as_version=4)
    source = next(c.source for c in nb.cells
                  if c.metadata["nbgrader"]["grade_id"] == "load_tp_shard")
    assert re.sub(r"\n *### (BEGIN|END) SOLUTION", "", source) == \
        inspect.getsource(fns.load_tp_shard).strip()


# -- layer 4: nbgrader on assignment 8 ------------------------------------------------

def renamed(fn, name) -> str:
    source = inspect.getsource(fn)
    return source.replace(f"def {fn.__name__}(", f"def {name}(", 1) + "\n\n"


def calling_reference(fn) -> str:
    """fn's source as load_tp_shard, with the reference beside it as _reference."""
    return renamed(fns.load_tp_shard, "_reference") + renamed(fn, "load_tp_shard").replace(
        "return load_tp_shard(", "return _reference(")


SUBMISSIONS = {
    "reference": {},
    "untouched": None,
    "reads_whole": {"load_tp_shard": "import math\n\n\n" + inspect.getsource(fns._flat)
                    + "\n\n" + renamed(fns.reads_whole, "load_tp_shard")},
    "rows_only": {"load_tp_shard": calling_reference(fns.rows_only)},
    "deadlock": {"load_tp_shard": calling_reference(fns.waits_for_rank0)},
}
CELLS = {"test_column": 3, "test_row": 3, "test_replicated": 1, "test_bytes": 3}
FAILED = {  # submission -> the test cells that score zero, and what their message says
    "reference": {},
    "untouched": {name: "in place of `raise NotImplementedError()`" for name in CELLS},
    "reads_whole": {"test_bytes": "read only each shard's elements"},
    "rows_only": {"test_row": "row-parallel, split along dim 1"},
    "deadlock": {name: "did not finish within 4 s" for name in CELLS},
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    return autograde(ASSIGNMENT, SUBMISSIONS, tmp_path_factory.mktemp("course"))


@pytest.mark.slow
def test_the_student_version_has_a_stub_and_no_solution(graded):
    release = graded["release"].read_text()
    assert "### BEGIN SOLUTION" not in release and "def elements(" not in release
    assert release.count("raise NotImplementedError()") == 1


@pytest.mark.slow
def test_exported_grades_are_the_expected_totals(graded):
    assert_exported_totals(graded, CELLS, FAILED, {
        "reference": 10, "untouched": 0, "reads_whole": 7, "rows_only": 7, "deadlock": 0})


@pytest.mark.slow
@pytest.mark.parametrize("student", SUBMISSIONS)
def test_each_test_cell_scores_as_expected_with_a_helpful_message(graded, student):
    assert_cell_scores(graded, student, CELLS, FAILED)
