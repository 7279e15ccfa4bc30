# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_grading_zero2_overlap.py
# (add -m "not slow" for the checks alone, ~30 s)
"""Assignment 5 (ZeRO-2, bucketed reduce-scatter during backward): its checks, then nbgrader.

Layer 1 (unit): labsupport.grading.zero2_overlap's checks pass the reference
solution (the source notebook's, ``sources.reference``) and fail each
plausible wrong one, written as an edit of it, with the message that says
what to fix; a deadlock ends at the deadline. Layer 4 (slow): `nbgrader
generate_assignment`, `autograde` and `export` on six submissions
(reference, untouched, all-reduce instead of reduce-scatter, gradients freed
only after backward, every bucket's buffer kept until finish(), a
deadlock), scores checked per cell.
"""
import time

import labsupport.grading.zero2_overlap as gz
import sources
from failing import fails, stopped_as_a_stall
from labsupport import grading
from nbgrader_run import RoundTrip

ASSIGNMENT = "zero2_overlap"
SHORT = 3.0   # s, deadline of the unit test that deadlocks on purpose

HOOK_FREE = "        param.grad = None                        # the bucket holds it now\n"
HOOK_DRAIN = "            self._drain()                        # at most one bucket in flight\n"
COMPLETE = "        if self.arrived[id(bucket)] == len(bucket.params):"
# Each wrong answer as edits of the reference solution's cell.
VARIANTS = {
    "reference": (),
    "all_reduce": ((  # the whole bucket all-reduced; my shard taken from it
        "            shard = torch.empty_like(bucket.param_shard)\n"
        "            work = dist.reduce_scatter_single(shard, bucket.grad, async_op=True)",
        "            n, r = bucket.shard_numel, self.rank\n"
        "            shard = bucket.grad[r * n:(r + 1) * n]\n"
        "            work = dist.all_reduce(bucket.grad, async_op=True)"),),
    "free_late": ((HOOK_FREE, ""), (  # gradients freed only once backward is over
        "        self._drain()\n\n    def step",
        "        self._drain()\n        for bucket in self.buckets:\n"
        "            for p in bucket.params:\n                p.grad = None\n\n    def step")),
    "keep_buffers": ((HOOK_DRAIN, ""),),  # every bucket in flight until finish()
    "work_keeps_buffers": ((HOOK_DRAIN, ""), (  # as above, each buffer named by its work only
        "            self.works.append((bucket, shard, work))",
        "            self.works.append((bucket, shard, work))\n"
        "            bucket.grad = None                   # the work still reads it")),
    "deadlock": ((  # rank 0 waits for one gradient too many: it never sends its last bucket
        COMPLETE, "        last = self.rank == 0 and bucket is self.buckets[-1]\n"
        "        if self.arrived[id(bucket)] == len(bucket.params) + last:"),),
}


def edit(name):
    return sources.replaced(*VARIANTS[name]) if VARIANTS[name] else None


CLASSES = {name: sources.reference(ASSIGNMENT, {"zero2_overlap": edit(name)}, name).Zero2Overlap
           for name in VARIANTS}



# -- layer 1: the checks ----------------------------------------------------------------

def test_the_reference_passes_every_check():
    ref = CLASSES["reference"]
    gz.check_parity(ref, world_sizes=(2, 4), bucket_numel=1000)
    gz.check_parity(ref, world_sizes=(4,), bucket_numel=1)   # one parameter per bucket
    gz.check_reduce_scatter(ref, world_sizes=(2, 4))
    gz.check_overlap(ref)
    gz.check_memory(ref)
    gz.check_memory(ref, world_sizes=(4,), bucket_numel=1)


def test_an_all_reduce_is_right_but_fails_the_reduce_scatter_check():
    """... and passes the memory check: its buffers, which gloo's worker thread lets go
    of a moment after wait() returned, are not reached by the code once drained (the
    live-storage tally this replaced took its points in two CI runs)."""
    cls = CLASSES["all_reduce"]
    gz.check_parity(cls, world_sizes=(2,))
    assert "used all_reduce for the gradients" in fails(gz.check_reduce_scatter, cls)
    gz.check_memory(cls)


def test_gradients_freed_only_after_backward_fail_the_memory_check():
    cls = CLASSES["free_late"]
    gz.check_parity(cls, world_sizes=(2,))
    text = fails(gz.check_memory, cls)
    assert "during backward, gradient data took up to" in text
    assert "free each .grad in the hook" in text


def test_bucket_buffers_kept_until_finish_fail_the_memory_check():
    """The reference as it was: every bucket's buffer freed in finish(). Right, overlapped,
    and after finish() nothing is left: only the count during backward sees the buffers."""
    cls = CLASSES["keep_buffers"]
    gz.check_parity(cls, world_sizes=(2,))
    gz.check_overlap(cls)
    gz.check_reduce_scatter(cls, world_sizes=(2,))
    text = fails(gz.check_memory, cls)
    assert "during backward, gradient data took up to" in text
    assert "Each bucket's full buffer must go once its reduce-scatter is done" in text


def test_buffers_only_a_work_in_flight_holds_still_count():
    """A buffer the code no longer names but whose reduce-scatter it has not waited for is
    in use: counted as in flight until wait() returns, in the rank's own order."""
    cls = CLASSES["work_keeps_buffers"]
    gz.check_parity(cls, world_sizes=(2,))
    text = fails(gz.check_memory, cls)
    assert "Each bucket's full buffer must go once its reduce-scatter is done" in text


def test_the_memory_counts_are_exact_and_the_same_every_step():
    """The numbers instructors.md gives, on both ranks and in each of the 3 steps: a count
    by reference has no noise to take the least of."""
    runs = [c["value"] for c in grading.run(gz._train, CLASSES["reference"], 1000, gz.STEPS,
                                            world_size=2)]
    for run in runs:
        assert (run["peak_grad_bytes"], run["after"]["held"]) == (41_112, 25_992)
        assert run["steps"] == [(41_112, 25_992)] * gz.STEPS


def test_a_deadlock_ends_at_the_deadline():
    t0 = time.monotonic()
    text = fails(gz.check_parity, CLASSES["deadlock"], world_sizes=(2,), timeout=SHORT)
    assert f"did not finish within {SHORT:g} s on 2 ranks" in text
    assert stopped_as_a_stall(text, time.monotonic() - t0, SHORT)


def test_a_wrong_mean_names_the_parameter_and_the_fix():
    no_mean = sources.replaced(*VARIANTS["reference"], ("shard / self.world_size", "shard"))
    cls = sources.reference(ASSIGNMENT, {"zero2_overlap": no_mean}, "sum").Zero2Overlap
    text = fails(gz.check_parity, cls, world_sizes=(2,))
    assert "rank 0's tok.weight differs" in text and "divide by world_size" in text


# -- layer 4: nbgrader on the real assignment -------------------------------------------

CELLS = {"test_parity": 3, "test_parity_buckets": 1, "test_reduce_scatter": 2,
         "test_overlap": 2, "test_memory": 2}
BUFFERS = "Each bucket's full buffer must go once its reduce-scatter is done"
FAILED = {  # submission -> the test cells that score zero, and what their message says
    "reference": {},
    "untouched": {name: "in place of `raise NotImplementedError()`" for name in CELLS},
    "all_reduce": {"test_reduce_scatter": "used all_reduce for the gradients"},
    "free_late": {"test_memory": "free each .grad in the hook"},
    "keep_buffers": {"test_memory": BUFFERS},
    "deadlock": {name: "did not finish within" for name in CELLS},
}


class TestNbgrader(RoundTrip):
    assignment, cells, failed = ASSIGNMENT, CELLS, FAILED
    submissions = {s: None if s == "untouched" else {"zero2_overlap": edit(s)} for s in FAILED}
    totals = {"reference": 10, "untouched": 0, "all_reduce": 8, "free_late": 8,
              "keep_buffers": 8, "deadlock": 0}
    stubs, hidden = 3, ("bucket_numel=1)",)  # the hidden bucket sizes
    timeout = 500
    # The deadlock waits for its deadlines beside the others (autograde's `beside`):
    # its memory check counts what the student's code holds by
    # reference (checking.held), not the allocator; no check reads a clock.
    beside = ("deadlock",)
