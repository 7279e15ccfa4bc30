# Run: .venv/bin/python -m pytest tests/test_grading.py   (2-3 min; add -m "not slow": ~30 s)
"""Graders: labsupport.grading's checks on right and wrong rings, then the real nbgrader pipeline.

Layer 1 (unit): each check passes a correct ring and fails each plausible
wrong one with the message that tells the student what to fix; deadlocks end
at the deadline. Layer 4 (slow): `nbgrader generate_assignment`, `autograde`
and `export` on assignment 1 in a temporary course directory, with six
submissions whose scores, per test cell and in the exported CSV, are known.
"""
import csv
import os
import shutil
import subprocess
import sys
import textwrap
import time
from datetime import datetime
from pathlib import Path

import nbformat
import pytest
import torch
import torch.distributed as dist

import labsupport as ls
from labsupport import p2p_log
from labsupport.launch import limits
from grading_rings import (
    all_reduce_inside, batched_reduce_scatter, chunk_reduce_scatter, direct_all_gather,
    endless, exchange, not_written_yet, raises_on_rank_1, rank0_silent_all_gather,
    ring_all_gather, ring_all_reduce, ring_reduce_scatter, send_first_reduce_scatter,
    unwaited_recv_reduce_scatter, whole_buffer_all_reduce)

ROOT = Path(__file__).resolve().parent.parent
ASSIGNMENT = "ring_allreduce"
SOURCE = ROOT / "notebooks" / "assignments" / "source" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb"
DEADLINE = 4  # s, LABSUPPORT_GRADING_TIMEOUT of the autograde run below
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


def fails(check, fn, **kwargs) -> str:
    with pytest.raises(AssertionError) as info:
        check(fn, **kwargs)
    return str(info.value)


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
    assert time.monotonic() - t0 < SHORT + 5
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
    assert "while True:" in text


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


# -- layer 4: nbgrader on assignment 1 ------------------------------------------------

def cell(source: str) -> str:
    return textwrap.dedent(source).strip("\n")


SEND_FIRST_RS = cell("""
    def ring_reduce_scatter(tensor):
        rank, world_size = dist.get_rank(), dist.get_world_size()
        chunks = tensor.tensor_split(world_size)
        for step in range(world_size - 1):
            send_i = (rank - step - 1) % world_size
            recv_i = (rank - step - 2) % world_size
            received = torch.empty_like(chunks[recv_i])
            dist.send(chunks[send_i], dst=(rank + 1) % world_size)
            dist.recv(received, src=(rank - 1) % world_size)
            chunks[recv_i].add_(received)
""")
WHOLE_RS = cell("""
    def ring_reduce_scatter(tensor):
        rank, world_size = dist.get_rank(), dist.get_world_size()
        passing = tensor.clone()
        for step in range(world_size - 1):
            received = torch.empty_like(tensor)
            requests = [dist.isend(passing, dst=(rank + 1) % world_size),
                        dist.irecv(received, src=(rank - 1) % world_size)]
            for request in requests:
                request.wait()
            tensor.add_(received)
            passing = received
""")
WHOLE_AG = cell("""
    def ring_all_gather(tensor):
        rank, world_size = dist.get_rank(), dist.get_world_size()
        for step in range(world_size - 1):
            received = torch.empty_like(tensor)
            requests = [dist.isend(tensor.clone(), dst=(rank + 1) % world_size),
                        dist.irecv(received, src=(rank - 1) % world_size)]
            for request in requests:
                request.wait()
            recv_i = (rank - step - 1) % world_size
            tensor.tensor_split(world_size)[recv_i].copy_(
                received.tensor_split(world_size)[recv_i])
""")
DIRECT_AG = cell("""
    def ring_all_gather(tensor):
        rank, world_size = dist.get_rank(), dist.get_world_size()
        chunks = tensor.tensor_split(world_size)
        requests = [dist.isend(chunks[rank], dst=peer)
                    for peer in range(world_size) if peer != rank]
        requests += [dist.irecv(chunks[peer], src=peer)
                     for peer in range(world_size) if peer != rank]
        for request in requests:
            request.wait()
""")
ALL_REDUCE_AG = cell("""
    def ring_all_gather(tensor):
        rank, world_size = dist.get_rank(), dist.get_world_size()
        for i, chunk in enumerate(tensor.tensor_split(world_size)):
            if i != rank:
                chunk.zero_()
        dist.all_reduce(tensor)  # each chunk is non-zero on its owner only
""")
# name -> (ring_reduce_scatter cell, ring_all_gather cell); None: the reference's,
# "stub": the untouched student version's.
SUBMISSIONS = {
    "reference": (None, None),
    "untouched": ("stub", "stub"),
    "deadlock": (SEND_FIRST_RS, None),
    "whole_buffer": (WHOLE_RS, WHOLE_AG),
    "all_reduce_inside": (None, ALL_REDUCE_AG),
    "direct_all_gather": (None, DIRECT_AG),
    "torch_chunk": ("chunk", "chunk"),
}
CELLS = {"test_reduce_scatter": 2, "test_reduce_scatter_uneven": 1, "test_all_gather": 2,
         "test_all_gather_uneven": 1, "test_all_reduce": 2, "test_bytes_sent": 2}
FAILED = {  # submission -> the test cells that score zero, and what their message says
    "reference": {},
    "untouched": {name: "in place of `raise NotImplementedError()`" for name in CELLS},
    "deadlock": dict.fromkeys(("test_reduce_scatter", "test_reduce_scatter_uneven",
                               "test_all_reduce", "test_bytes_sent"),
                              "Every stuck rank was sending"),
    "whole_buffer": {"test_bytes_sent": "a ring passing the whole tensor at each step"},
    "all_reduce_inside": dict.fromkeys(("test_all_gather", "test_all_gather_uneven",
                                        "test_all_reduce", "test_bytes_sent"),
                                       "called a collective (rank 0: dist.all_reduce"),
    "direct_all_gather": {"test_bytes_sent": "is not a ring on 4 ranks: rank 0 sent to ranks "
                                             "[2, 3]"},
    "torch_chunk": dict.fromkeys(("test_reduce_scatter_uneven", "test_all_gather_uneven"),
                                 "(torch.chunk splits differently"),
}


def nbgrader(*args, course: Path, timeout=300, env=None):
    """One nbgrader command, run from the repository root so that it reads nbgrader_config.py."""
    cmd = [sys.executable, "-m", "nbgrader", *args, f"--CourseDirectory.root={course}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, \
        f"nbgrader {' '.join(args)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-5000:]}"
    return proc


def submission(release: Path, source_nb, rs, ag):
    nb = nbformat.read(release, as_version=4)
    reference = {c.metadata["nbgrader"]["grade_id"]: c.source for c in source_nb.cells}
    for c in nb.cells:
        gid = c.metadata.get("nbgrader", {}).get("grade_id")
        choice = {"ring_reduce_scatter": rs, "ring_all_gather": ag}.get(gid, "stub")
        if choice is None:
            c.source = reference[gid]
        elif choice == "chunk":
            c.source = reference[gid].replace("tensor.tensor_split(", "tensor.chunk(")
        elif choice != "stub":
            c.source = choice
    return nb


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    course = tmp_path_factory.mktemp("course")
    shutil.copytree(SOURCE.parent, course / "source" / ASSIGNMENT)
    # nbgrader runs `alembic` from PATH; the graded runs get a short deadline.
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               LABSUPPORT_GRADING_TIMEOUT=str(DEADLINE))
    nbgrader("generate_assignment", ASSIGNMENT, "--force", course=course, env=env)
    release = course / "release" / ASSIGNMENT / SOURCE.name
    source_nb = nbformat.read(SOURCE, as_version=4)
    for student, (rs, ag) in SUBMISSIONS.items():
        folder = course / "submitted" / student / ASSIGNMENT
        folder.mkdir(parents=True)
        nbformat.write(submission(release, source_nb, rs, ag), folder / SOURCE.name)
    t0 = time.monotonic()
    nbgrader("autograde", ASSIGNMENT, "--force", course=course, env=env, timeout=400)
    autograde_s = time.monotonic() - t0
    print(f"nbgrader autograde of {len(SUBMISSIONS)} submissions took {autograde_s:.1f} s")
    nbgrader("export", f"--to={course / 'grades.csv'}", course=course, env=env)
    return dict(course=course, env=env, release=release, autograde_s=autograde_s)


@pytest.mark.slow
def test_the_student_version_has_stubs_and_no_hidden_tests(graded):
    release = graded["release"].read_text()
    assert "### BEGIN SOLUTION" not in release and "HIDDEN TESTS" not in release
    assert "sizes=(10, 13)" not in release  # the hidden sizes
    assert release.count("raise NotImplementedError()") == 2
    assert "check_reduce_scatter(ring_reduce_scatter, sizes=(8, 12))" in release


@pytest.mark.slow
def test_exported_grades_are_the_expected_totals(graded):
    with open(graded["course"] / "grades.csv", newline="") as f:
        rows = {row["student_id"]: row for row in csv.DictReader(f)}
    expected = {s: sum(p for c, p in CELLS.items() if c not in FAILED[s]) for s in SUBMISSIONS}
    assert {s: float(rows[s]["score"]) for s in SUBMISSIONS} == expected
    assert expected == {"reference": 10, "untouched": 0, "deadlock": 3, "whole_buffer": 8,
                        "all_reduce_inside": 3, "direct_all_gather": 8, "torch_chunk": 8}
    assert {float(row["max_score"]) for row in rows.values()} == {10.0}


@pytest.mark.slow
@pytest.mark.parametrize("student", SUBMISSIONS)
def test_each_test_cell_scores_as_expected_with_a_helpful_message(graded, student):
    from nbgrader.api import Gradebook
    os.environ["PATH"] = graded["env"]["PATH"]  # Gradebook runs `alembic` too
    with Gradebook(f"sqlite:///{graded['course'] / 'gradebook.db'}") as gb:
        scores = {name: gb.find_grade(name, ASSIGNMENT, ASSIGNMENT, student).score
                  for name in CELLS}
    assert scores == {name: 0 if name in FAILED[student] else points
                      for name, points in CELLS.items()}
    nb = nbformat.read(graded["course"] / "autograded" / student / ASSIGNMENT / SOURCE.name, 4)
    errors = {c.id: "\n".join("\n".join(o.traceback) for o in c.outputs
                              if o.output_type == "error")
              for c in nb.cells if c.cell_type == "code"}  # by cell id: "test-all-gather"
    for name, message in FAILED[student].items():
        cell_id = name.replace("_", "-")
        assert message in errors[cell_id], f"{name}:\n{errors[cell_id]}"
    # The ungraded try-out cell fails where the sum is wrong, and is never graded.
    assert (errors["try-ring"] != "") == (student in ("untouched", "deadlock"))


def cell_seconds(nb) -> dict:
    """{cell id: seconds it ran}, from the timestamps nbclient records in cell metadata."""
    seconds = {}
    for c in nb.cells:
        stamps = c.metadata.get("execution", {})
        if "iopub.execute_input" in stamps and "shell.execute_reply" in stamps:
            start, end = (datetime.fromisoformat(stamps[key].replace("Z", "+00:00"))
                          for key in ("iopub.execute_input", "shell.execute_reply"))
            seconds[c.id] = (end - start).total_seconds()
    return seconds


@pytest.mark.slow
def test_a_deadlock_ends_each_cell_at_the_deadline_not_at_nbgraders_limit(graded):
    nb = nbformat.read(graded["course"] / "autograded" / "deadlock" / ASSIGNMENT / SOURCE.name, 4)
    seconds = cell_seconds(nb)
    hung = ["try-ring", "test-reduce-scatter", "test-reduce-scatter-uneven", "test-all-reduce",
            "test-bytes-sent"]
    for cell_id in hung:  # nbgrader itself would wait 120 s (nbgrader_config.py)
        assert DEADLINE <= seconds[cell_id] < DEADLINE + 20, (cell_id, seconds[cell_id])
    assert sum(seconds.values()) < len(hung) * (DEADLINE + 20)
    assert graded["autograde_s"] < 300  # all seven submissions
