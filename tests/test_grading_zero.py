# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_grading_zero.py   (add -m "not slow": ~1 min)
"""Assignment 5 (ZeRO-2, bucketed reduce-scatter during backward): its checks, then nbgrader.

Layer 1 (unit): labsupport.grading.zero's checks pass the reference solution
(taken from the assignment's source notebook) and fail each plausible wrong
one with the message that says what to fix; a deadlock ends at the deadline.
Layer 4 (slow): `nbgrader generate_assignment`, `autograde` and `export` on
five submissions (reference, untouched, all-reduce instead of reduce-scatter,
gradients freed only after backward, a deadlock), scores checked per cell.
"""
import sys
import time
import types

import cloudpickle
import nbformat
import pytest

import labsupport.grading.zero as gz
from nbgrader_run import assert_cell_scores, assert_exported_totals, autograde, source_path

ASSIGNMENT = "zero2_overlap"
SOURCE = source_path(ASSIGNMENT)
SHORT = 3.0   # s, deadline of the unit test that deadlocks on purpose

HOOK_FREE = "        param.grad = None                        # the bucket holds it now\n"
COMPLETE = "        if self.arrived[id(bucket)] == len(bucket.params):"
# Each wrong answer as edits of the reference solution's cell.
VARIANTS = {
    "reference": [],
    "all_reduce": [(  # the whole bucket all-reduced; my shard taken from it
        "            shard = torch.empty_like(bucket.param_shard)\n"
        "            work = dist.reduce_scatter_single(shard, bucket.grad, async_op=True)",
        "            n, r = bucket.shard_numel, self.rank\n"
        "            shard = bucket.grad[r * n:(r + 1) * n]\n"
        "            work = dist.all_reduce(bucket.grad, async_op=True)")],
    "free_late": [(HOOK_FREE, ""), (  # gradients freed only once backward is over
        "        self.works = []\n        ### END SOLUTION\n\n    def step",
        "        self.works = []\n        for bucket in self.buckets:\n"
        "            for p in bucket.params:\n                p.grad = None\n"
        "        ### END SOLUTION\n\n    def step")],
    "deadlock": [(  # rank 0 waits for one gradient too many: it never sends its last bucket
        COMPLETE, "        last = self.rank == 0 and bucket is self.buckets[-1]\n"
        "        if self.arrived[id(bucket)] == len(bucket.params) + last:")],
}


def _cell(nb, grade_id):
    return next(c for c in nb.cells if c.metadata["nbgrader"]["grade_id"] == grade_id)


def variant_source(name, source=None) -> str:
    source = source or _cell(nbformat.read(SOURCE, 4), "zero2_overlap").source
    for old, new in VARIANTS[name]:
        assert old in source, (name, old)
        source = source.replace(old, new)
    return source


def _classes() -> dict:
    """Each variant's Zero2Overlap, in a module the ranks unpickle by value."""
    nb = nbformat.read(SOURCE, 4)
    out = {}
    for name in VARIANTS:
        module = types.ModuleType(f"zero2_{name}")
        sys.modules[module.__name__] = module
        code = "import torch\nimport torch.distributed as dist\n" + _cell(
            nb, "given_code").source + "\n" + variant_source(name)
        exec(compile(code, f"<{name}>", "exec"), module.__dict__)
        cloudpickle.register_pickle_by_value(module)
        out[name] = module.Zero2Overlap
    return out


CLASSES = _classes()


def fails(check, cls, **kwargs) -> str:
    with pytest.raises(AssertionError) as info:
        check(cls, **kwargs)
    return str(info.value)


# -- layer 1: the checks ----------------------------------------------------------------

def test_the_reference_passes_every_check():
    ref = CLASSES["reference"]
    gz.check_parity(ref, world_sizes=(2, 4), bucket_numel=1000)
    gz.check_parity(ref, world_sizes=(4,), bucket_numel=1)   # one parameter per bucket
    gz.check_reduce_scatter(ref, world_sizes=(2, 4))
    gz.check_overlap(ref)
    gz.check_memory(ref)


def test_an_all_reduce_is_right_but_fails_the_reduce_scatter_check():
    cls = CLASSES["all_reduce"]
    gz.check_parity(cls, world_sizes=(2,))
    assert "used all_reduce for the gradients" in fails(gz.check_reduce_scatter, cls)


def test_gradients_freed_only_after_backward_fail_the_memory_check():
    cls = CLASSES["free_late"]
    gz.check_parity(cls, world_sizes=(2,))
    text = fails(gz.check_memory, cls)
    assert "during backward the parameters' .grad held up to" in text
    assert "free each .grad in the hook" in text


def test_a_deadlock_ends_at_the_deadline():
    t0 = time.monotonic()
    text = fails(gz.check_parity, CLASSES["deadlock"], world_sizes=(2,), timeout=SHORT)
    assert f"did not finish within {SHORT:g} s on 2 ranks" in text
    assert time.monotonic() - t0 < SHORT + 30


def test_a_wrong_mean_names_the_parameter_and_the_fix():
    source = variant_source("reference").replace("shard / self.world_size", "shard")
    module = types.ModuleType("zero2_sum")
    sys.modules[module.__name__] = module
    exec("import torch\nimport torch.distributed as dist\n" + _cell(
        nbformat.read(SOURCE, 4), "given_code").source + "\n" + source, module.__dict__)
    cloudpickle.register_pickle_by_value(module)
    text = fails(gz.check_parity, module.Zero2Overlap, world_sizes=(2,))
    assert "rank 0's tok.weight differs" in text and "divide by world_size" in text


# -- layer 4: nbgrader on the real assignment -------------------------------------------

CELLS = {"test_parity": 3, "test_parity_buckets": 1, "test_reduce_scatter": 2,
         "test_overlap": 2, "test_memory": 2}
FAILED = {  # submission -> the test cells that score zero, and what their message says
    "reference": {},
    "untouched": {name: "in place of `raise NotImplementedError()`" for name in CELLS},
    "all_reduce": {"test_reduce_scatter": "used all_reduce for the gradients"},
    "free_late": {"test_memory": "free each .grad in the hook"},
    "deadlock": {name: "did not finish within" for name in CELLS},
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    submissions = {s: None if s == "untouched" else {"zero2_overlap": variant_source(s)}
                   for s in FAILED}
    return autograde(ASSIGNMENT, submissions, tmp_path_factory.mktemp("course"), timeout=500)


@pytest.mark.slow
def test_the_student_version_has_stubs_and_no_hidden_tests(graded):
    release = graded["release"].read_text()
    assert "### BEGIN SOLUTION" not in release and "HIDDEN TESTS" not in release
    assert "bucket_numel=1)" not in release  # the hidden bucket sizes
    assert release.count("raise NotImplementedError()") == 3


@pytest.mark.slow
def test_exported_grades_are_the_expected_totals(graded):
    assert_exported_totals(graded, CELLS, FAILED, {
        "reference": 10, "untouched": 0, "all_reduce": 8, "free_late": 8, "deadlock": 0})


@pytest.mark.slow
@pytest.mark.parametrize("student", FAILED)
def test_each_test_cell_scores_as_expected_with_a_helpful_message(graded, student):
    assert_cell_scores(graded, student, CELLS, FAILED)
