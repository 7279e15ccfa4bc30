"""Checks of assignment 9: the gradient synchronisation of a 4-D layout, embedding tied.

    import labsupport as ls
    g = ls.grading.grad_sync_4d
    g.check_embedding_group(embedding_group, [(2, 1, 2, 1)])   # part 1: the groups
    g.check_parity(sync_gradients, [(2, 1, 2, 1)])   # part 2: gradients = one process's
    g.check_traffic(sync_gradients, [(2, 1, 2, 1)])  #   no byte more than needed
    g.check_clipped(sync_gradients, grad_norm, [(1, 2, 3, 1)])   # part 3: the clip

The student writes three functions for chapter 11's composed step
(``capstone.trainer.step``: 1F1B over the pipeline stages, tensor, sequence
and context parallelism inside) on a layout ``(dp, tp, pp, cp)``. Unlike the
chapter's decoder, this one is TIED: the LM head is the token embedding
(``models.GPTConfig(tie_weights=True)``, GPT-2's choice). With the embedding
on the first pipeline stage and the head on the last, the one weight lives on
two stages (``TiedStage``, the rank's piece of it); Megatron-LM keeps the two
copies equal by summing their gradients over its *embedding group*, the first
and last stage's ranks that hold the same shard (``_allreduce_word_embedding_grads``
in ``megatron/core/distributed/finalize_model_grads.py``; Shoeybi et al.
2019, arXiv 1909.08053, Sec. 3, tie the embedding to the output layer). On
one stage (pp = 1) the weight is one Parameter and autograd has already
summed its two uses.

1. ``embedding_group(layout)``, on every rank: every embedding group made
   with ``dist.new_group`` (in one order on every rank), this rank's returned
   (None on a middle stage, this rank alone when pp = 1);
2. ``sync_gradients(stage, groups, layout)`` after backward: which gradient
   goes over which group with which divisor, the partial ones of sequence
   parallelism found by the student (the stage has no ``sp_params``);
   ``groups["embedding"]`` is the grader's own, so that the parts are graded
   apart;
3. ``grad_norm(stage, groups, layout)`` after the sync: the whole model's
   gradient norm, the same on every rank, with which the grader clips the
   gradients as one process's ``clip_grad_norm_`` does (``MAX_NORM``).

This package holds the plumbing only (``config``: the decoder, batches and
one-process reference; ``tied``: the tied stage and the grader's groups;
``runs``: the functions on the ranks; ``diagnose``, ``norms``, ``traffic``:
what is wrong): the answers live in the instructors' source notebook, and a
student's function that calls the chapters' own answer is told so
(``runs.REFUSED``).

Each check of parts 2 and 3 trains ``STEPS`` steps on the ranks through
``diagnosis.run_on_ranks`` (a deadline, so a deadlock ends in an explanation,
never a hung grader), with the same global batches as one process training
the tied ``models.GPT`` (``reference``), and compares every parameter's
gradient at step 0, after the student's sync (relative to the parameter's
largest entry, ``capstone.compare``'s measure and tolerances), the loss of
every step, and for part 3 every step's norm against ``clip_grad_norm_``'s.
"""
from labsupport.capstone import compare
from labsupport.capstone.layout import Layout
from labsupport.checking.diagnosis import name_of
from labsupport.grading.grad_sync_4d import diagnose, norms, runs, traffic
from labsupport.grading.grad_sync_4d.config import (  # noqa: F401 - the tests' and notebook's
    MAX_NORM,
    STEPS,
    TIED,
    describe,
    layers_for,
    reference,
    tied_config,
    train_config,
)
from labsupport.grading.grad_sync_4d.tied import (  # noqa: F401 - chapter 11's tests'
    TiedStage,
    embedding_groups,
    tied_groups,
)
from labsupport.grading.grad_sync_4d.traffic import needed, needed_bytes  # noqa: F401

VISIBLE = {"two_stages": ((2, 1, 2, 1),), "one_stage": ((2, 2, 1, 1),),
           "all_dims": ((1, 2, 2, 2),)}
TRAFFIC = tuple(layout for layouts in VISIBLE.values() for layout in layouts)
GROUPS = ((2, 1, 2, 1), (2, 2, 1, 1))      # part 1's visible layouts
CLIPPED = ((1, 2, 3, 1),)                  # part 3's: tp, three stages, the tie


# -- part 1: the embedding groups ----------------------------------------------------

def check_embedding_group(build, layouts=GROUPS, timeout=None):
    """On every rank, ``build(layout)`` returns the process group of this rank's
    embedding group (its ranks: the first and last stage's with this rank's dp,
    cp and tp), None on a middle stage; the group works (an all-reduce over it)."""
    for layout in layouts:
        try:
            outs = runs.outcome(runs.groups_on_rank, (build,), layout, timeout,
                                name_of(build))
        except AssertionError as failure:
            if "did not finish within" not in str(failure):
                raise
            raise AssertionError(f"{failure}\n{_NEW_GROUP}") from None
        problem = diagnose.groups_problem(outs, embedding_groups(layout), layout)
        if problem:
            raise AssertionError(f"{name_of(build)} on {describe(layout)}: {problem}")


_NEW_GROUP = ("A rank that stops inside embedding_group most often waits in "
              f"{runs.NEW_GROUP}.")


# -- part 2: the sync ----------------------------------------------------------------

def _trained(sync, layout, timeout, norm=None):
    return runs.outcome(runs.train_on_rank, (sync, norm), layout, timeout, name_of(sync))


def check_parity(sync, layouts=VISIBLE["two_stages"], timeout=None):
    """After ``sync``, every parameter's gradient at step 0 is one process's (each
    rank's shard of it), and the loss of each of ``STEPS`` steps is too."""
    for layout in layouts:
        outs = _trained(sync, layout, timeout)
        problem = diagnose.parity_problem(outs, reference(layers_for(layout)), layout)
        if problem:
            raise AssertionError(f"{name_of(sync)} on {describe(layout)}: {problem}")


def check_traffic(sync, layouts=TRAFFIC, timeout=None):
    """Right on each layout first; then no rank sends more bytes than the
    reductions the layout needs: the partial gradients under SP summed over tp,
    every gradient averaged over dp x cp, the tied weight summed over the
    embedding group (ring bytes: 2(n-1)/n of each all-reduce's payload)."""
    name = name_of(sync)
    for layout in layouts:
        outs = _trained(sync, layout, timeout)
        problem = diagnose.parity_problem(outs, reference(layers_for(layout)), layout)
        if problem:
            raise AssertionError(f"{name} is not right yet on {describe(layout)}, so "
                                 f"its bytes are not graded: {problem}")
        unseen = [o["rank"] for o in outs if needed_bytes(o) and not o["calls"]]
        if unseen:
            raise AssertionError(
                f"{name} on {describe(layout)}: no call of ranks {unseen} went "
                "through torch.distributed's collectives (dist.all_reduce and the "
                "like), so their bytes cannot be counted: synchronise with them.")
        over = [o for o in outs if traffic.sent(o["calls"]) > needed_bytes(o) * (1 + 1e-9)]
        if over:
            raise AssertionError(f"{name} on {describe(layout)}: "
                                 + traffic.message(over, layout))


# -- part 3: the clipped step ----------------------------------------------------------

def check_clipped(sync, norm, layouts=CLIPPED, timeout=None):
    """With ``sync`` right on each layout (else not graded), ``norm`` returns on
    every rank, at every step, the norm one process's ``clip_grad_norm_``
    computes, and the run clipped by it follows the clipped reference's losses."""
    for layout in layouts:
        outs = _trained(sync, layout, timeout, norm)
        plain = reference(layers_for(layout))   # step 0's gradients: before any clip
        problem = diagnose.parity_problem(outs, dict(plain, losses=[]), layout)
        if problem:
            raise AssertionError(f"{name_of(sync)} is not right yet on "
                                 f"{describe(layout)}, so the clipped step is not "
                                 f"graded: {problem}")
        clipped = reference(layers_for(layout), clip_norm=MAX_NORM)
        problem = norms.norm_problem(outs, dict(clipped, grads=plain["grads"]), layout)
        if problem:
            raise AssertionError(f"{name_of(norm)} on {describe(layout)}: {problem}")


# -- a try-out -------------------------------------------------------------------------

def parity(sync, layout, norm=None, timeout=None) -> dict:
    """For a try-out: the largest difference of any gradient at step 0 (relative
    to its parameter's largest entry) and of the losses (relative), against one
    process; with ``norm``, the largest relative difference of the norms (the run
    clipped by it); raises like the checks if the run fails (a deadlock, an error)."""
    layout = Layout(*layout)
    outs = _trained(sync, layout, timeout, norm)
    ref = reference(layers_for(layout), clip_norm=None if norm is None else MAX_NORM)
    diffs = compare.grad_differences([dict(o, grads={0: o["grads"]}) for o in outs],
                                     reference(layers_for(layout))["grads"], 0)
    out = dict(layout=str(layout), grad_rel=max(d for d, _ in diffs.values()),
               loss_rel=max(abs(a - b) / abs(b)
                            for a, b in zip(outs[0]["losses"], ref["losses"])))
    if norm is not None:
        out["norm_rel"] = max(abs(v - w) / w for o in outs
                              for v, w in zip(o["norms"], ref["norms"]))
    return out

