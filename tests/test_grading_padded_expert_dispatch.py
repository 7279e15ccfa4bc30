# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest \
#   tests/test_grading_padded_expert_dispatch.py   (add -m "not slow": the checks alone)
"""Assignment 7 (the capacity-padded expert-parallel dispatch): its checks, then nbgrader.

Layer 1 (unit): labsupport.grading.padded_expert_dispatch's checks pass the
reference (the source notebook's, ``sources.reference``) and fail each
plausible wrong answer with the message that tells the student what to fix:
chapter 9's variable splits and an all-gather (in
grading_padded_expert_dispatch_cases.py) are right but send the wrong bytes;
a dropping rule by gate, detached gates, a dropped choice's gradient let
through to x, a partly dropped token's kept choice frozen and a deadlock are
edits of the reference; the untouched stub says where to write. Layer 4 (slow): `nbgrader
generate_assignment`, `autograde` and `export` on the assignment with five
submissions whose scores per test cell are known.
"""
import inspect
import re
import time

import pytest

import grading_padded_expert_dispatch_cases as cases
import labsupport.grading.padded_expert_dispatch as gp
import sources
from failing import fails, stopped_as_a_stall
from nbgrader_run import RoundTrip

ASSIGNMENT = "padded_expert_dispatch"
SOLUTION = "padded_moe"  # grade_id of the solution cell
SHORT = 3.0   # s, deadline of the unit test that deadlocks on purpose

# Wrong answers that differ from the reference in one thing, as edits of its cell.
SLOTS = ("    before = F.one_hot(wanted, num_experts).cumsum(dim=0) - 1   # rows before\n"
         "    slot = before.gather(1, wanted.unsqueeze(1)).squeeze(1)     # j of e\n")
COMBINE = ("    return x.new_zeros(num_tokens, hidden).index_add(0, owner, contrib)\n")
OWNERS = ("    owner = owner.repeat_interleave(top_k)[fits]\n",
          "    owner_all = owner.repeat_interleave(top_k)\n"
          "    owner = owner_all[fits]\n")
WRONG = {
    "drop_by_prob": ((SLOTS, (  # each expert keeps its rows of largest gate
        "    order = torch.argsort(-gates.flatten().detach(), stable=True)\n"
        "    before = F.one_hot(wanted[order], num_experts).cumsum(dim=0) - 1\n"
        "    slot = torch.empty_like(order).scatter_(\n"
        "        0, order, before.gather(1, wanted[order].unsqueeze(1)).squeeze(1))\n")),),
    "detached_gates": (("moe.route(router(x), top_k)",  # the router gets no gradient
                        "moe.route(router(x).detach(), top_k)"),),
    # Right forward, wrong backward only where choices are dropped:
    "leaky_drops": (OWNERS, (COMBINE, COMBINE.replace(  # a dropped choice's dy reaches x
        "    return ", "    lost = owner_all[~fits]\n    return ").replace(
        "contrib)", "contrib).index_add(\n"
        "        0, lost, x[lost] - x[lost].detach())")),),
    "frozen_kept": (OWNERS, (COMBINE, COMBINE.replace(  # partly dropped tokens: no gradient
        "    return ", "    partly = torch.isin(owner, owner_all[~fits])\n"
        "    contrib = torch.where(partly.unsqueeze(1), contrib.detach(), contrib)\n"
        "    return ")),),
    "deadlock": (("    ### BEGIN SOLUTION\n",  # only rank 0 dispatches: it waits forever
                  "    ### BEGIN SOLUTION\n    if dist.get_rank() != 0:\n"
                  "        return torch.zeros_like(x)\n"),),
}


def edit(name):
    return sources.replaced(*WRONG[name])


def untouched(source):
    """The solution cell as the release gives it."""
    return re.sub(r"### BEGIN SOLUTION.*### END SOLUTION", "raise NotImplementedError()",
                  source, flags=re.S)


ref = sources.reference(ASSIGNMENT).padded_moe
ANSWERS = {name: sources.reference(ASSIGNMENT, {SOLUTION: edit(name)}, name).padded_moe
           for name in WRONG}
STUB = sources.reference(ASSIGNMENT, {SOLUTION: untouched}, "untouched").padded_moe



# -- layer 1: the checks ----------------------------------------------------------------

def test_the_reference_passes_every_check():
    for check in (gp.check_forward, gp.check_drops, gp.check_backward, gp.check_padded_traffic):
        check(ref)


def test_chapter_9s_variable_splits_are_right_but_not_padded():
    gp.check_drops(cases.variable_splits, world_sizes=(2,))
    text = fails(gp.check_padded_traffic, cases.variable_splits)
    assert text.startswith("variable_splits on 2 ranks, rank 0: forward and backward sent ")
    assert "the padded dispatch sends 65,536" in text
    assert "you sent only the routed rows (variable split sizes" in text


def test_gathering_every_token_is_right_but_sends_too_much():
    gp.check_backward(cases.gather_all, world_sizes=(2,))
    text = fails(gp.check_padded_traffic, cases.gather_all)
    assert "x too many: sending every token to every rank" in text


def test_a_dropping_rule_by_gate_fails_the_drops_only():
    gp.check_forward(ANSWERS["drop_by_prob"], world_sizes=(2,))
    text = fails(gp.check_drops, ANSWERS["drop_by_prob"], world_sizes=(2,))
    assert "the first in token order" not in text and "whatever their gates" in text


def test_detached_gates_leave_the_router_without_a_gradient():
    gp.check_forward(ANSWERS["detached_gates"], world_sizes=(2,))
    text = fails(gp.check_backward, ANSWERS["detached_gates"], world_sizes=(2,))
    assert "router.weight.grad is None after backward" in text
    assert "without detaching it" in text


def test_the_backward_is_checked_with_drops_too():
    """Both answers are the reference with nothing dropped, and their y is its y."""
    for name in ("leaky_drops", "frozen_kept"):
        gp.check_drops(ANSWERS[name], world_sizes=(2,))
        text = fails(gp.check_backward, ANSWERS[name], world_sizes=(2,))
        assert text.startswith("padded_moe on 2 ranks, rank 0 (capacity factor 1, "), text
        assert " choices dropped): " in text
        assert "Right with nothing dropped, wrong with drops: a dropped choice" in text
    text = fails(gp.check_backward, ANSWERS["leaky_drops"], world_sizes=(2,))
    assert "x.grad differs" in text and "of which the layer keeps [" in text
    assert "False" in text.split("of which the layer keeps")[1].split("]")[0]


def test_a_deadlock_ends_at_the_deadline_then_the_next_check_passes():
    t0 = time.monotonic()
    text = fails(gp.check_forward, ANSWERS["deadlock"], world_sizes=(2,), timeout=SHORT)
    assert stopped_as_a_stall(text, time.monotonic() - t0, SHORT)
    assert "padded_moe did not finish within 3 s on 2 ranks" in text
    gp.check_forward(ref, world_sizes=(2,))


def test_an_unwritten_solution_says_where_to_write():
    text = fails(gp.check_forward, STUB, world_sizes=(2,))
    assert text.startswith("padded_moe failed on 2 ranks")
    assert text.endswith("Write your solution in place of `raise NotImplementedError()`.")


def test_something_else_than_a_function_is_refused():
    with pytest.raises(TypeError, match="pass your function"):
        gp.check_forward("padded_moe")


# -- layer 4: nbgrader on assignment 7 ------------------------------------------------

def pasted(fn) -> str:
    """The case's source under the assignment's function name."""
    source = inspect.getsource(fn)
    return source.replace(f"def {fn.__name__}(", f"def {SOLUTION}(", 1)


SUBMISSIONS = {"reference": {}, "untouched": None,
               "variable_splits": {SOLUTION: pasted(cases.variable_splits)},
               **{name: {SOLUTION: edit(name)} for name in ("drop_by_prob", "deadlock")}}
CELLS = {"test_forward": 3, "test_drops": 2, "test_backward": 3, "test_padded_traffic": 2}
FAILED = {  # submission -> the test cells that score zero, and what their message says
    "reference": {},
    "untouched": dict.fromkeys(CELLS, "in place of `raise NotImplementedError()`"),
    "variable_splits": {"test_padded_traffic": "you sent only the routed rows"},
    "drop_by_prob": dict.fromkeys(("test_drops", "test_backward"), "whatever their gates"),
    "deadlock": dict.fromkeys(CELLS, "did not finish within 4 s"),
}


class TestNbgrader(RoundTrip):
    assignment, submissions, cells, failed = ASSIGNMENT, SUBMISSIONS, CELLS, FAILED
    totals = {"reference": 10, "untouched": 0, "variable_splits": 8, "drop_by_prob": 5,
              "deadlock": 0}
    stubs, hidden = 1, ("index_copy",)
    try_cell, try_fails = "try-padded", ("untouched", "deadlock")
    timeout = 500
    # The deadlock waits for its deadlines beside the others (autograde's `beside`):
    # these checks count rows and bytes and compare values;
    # none reads a clock or the allocator.
    beside = ("deadlock",)
