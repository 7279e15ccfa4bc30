# Run: PYTHONPATH=$PWD flock /tmp/heavy.lock .venv/bin/python -m pytest \
#   tests/test_grading_grad_sync_4d.py   (~2 min; -m "not slow": the checks alone)
"""Graded assignment 9 (the gradient synchronisation of a 4-D layout, embedding tied):
labsupport.grading.grad_sync_4d, then the real nbgrader pipeline.

Layer 1 (unit): the tied stage and the grader's embedding groups; the one-process
reference is the tied GPT; the reference (the source notebook's, ``sources.reference``)
passes every check on the visible and hidden layouts; each plausible wrong answer
of each part, written as an edit of it, fails with the message that says what to
fix. Part 1 (the embedding groups): the whole pipeline as the group, [first, last]
at pp = 1 (a duplicate rank), each group made by its members only (a hang, ended
at the deadline), the grader's own groups called. Part 2 (the sync):
the tied weight not summed across the stages, averaged instead of summed (half its
value), reduced onto the first stage only (the last keeps its own part), the
average over dp x cp divided by dp only, the SP gradients averaged over tp, not
reduced, or only the LayerNorms' reduced, the tied weight counted twice on one
stage, a gradient left None, the chapter's sp_params asked for, a right answer
over the whole world, over every stage or through functional collectives
(traffic), a deadlock (only the first stage calls the embedding group's
all-reduce) ended at the deadline. Part 3 (the clipped step): the norm summed
over dp x cp too, the tied weight counted twice, the replicated parameters
counted tp times, the squared norm, each rank's own norm, chapter 11's
capstone.clip called, and a wrong sync not graded. Layer 4 (slow): `nbgrader
generate_assignment`, `autograde` and `export` on the assignment with nine
submissions whose scores are known.
"""
import time

import torch
import torch.distributed as dist

import labsupport as ls
import sources
from failing import fails, stopped_as_a_stall
from labsupport.capstone.layout import Layout
from labsupport.grading import grad_sync_4d as gs
from nbgrader_run import RoundTrip

ASSIGNMENT = "grad_sync_4d"
SHORT = 3.0  # s, deadline of the unit test that deadlocks on purpose
HIDDEN = ((3, 1, 2, 1), (1, 2, 3, 1), (2, 1, 2, 2))
HIDDEN_GROUPS = ((1, 2, 3, 1), (3, 1, 1, 2))
HIDDEN_CLIPPED = ((3, 1, 2, 1),)
ref = sources.reference(ASSIGNMENT)

EMBEDDING_AR = 'dist.all_reduce(tied.grad, group=groups["embedding"])'
TP_AR = 'dist.all_reduce(p.grad, group=groups["tp"])'
DIVIDE = "flat /= layout.dp * layout.cp"
WORLD = '''
def sync_gradients(stage, groups, layout):
    """Every gradient into one buffer of the whole decoder, summed over the world."""
    import math
    from labsupport import models
    offsets, n = {}, 0
    for name, p in models.GPT(stage.cfg).named_parameters():  # the shapes
        offsets[name] = (n, p.shape)
        n += p.numel()
    flat, shards, mine = torch.zeros(n), stage.shards(), []
    for name, p in stage.named_parameters():
        start, shape = offsets["tok.weight" if name == "lm_head.weight" else name]
        view = flat[start:start + math.prod(shape)].view(shape)
        if shards[name] is not None:
            dim, rank, tp = shards[name]
            view = view.chunk(tp, dim)[rank]
        view += p.grad
        mine.append((p, view))
    dist.all_reduce(flat)
    for p, view in mine:
        p.grad.copy_(view / (layout.dp * layout.cp))
'''.strip()
# The tied weight over the whole pipeline group, middle stages adding zeros: right,
# and the middle stages move bytes for nothing.
PP_ZEROS = (
    "    if tied is not None and layout.pp > 1:\n"
    "        " + EMBEDDING_AR + "\n",
    "    if layout.pp > 1:\n"
    "        v, h = stage.cfg.vocab_size // layout.tp, stage.cfg.hidden\n"
    "        buf = tied.grad if tied is not None else torch.zeros(v, h)\n"
    "        dist.all_reduce(buf, group=groups[\"pp\"])\n")
REDUCE_FIRST = ('dist.reduce(tied.grad, dst=groups["ranks"]["embedding"][0], '
                'group=groups["embedding"])')
SEND_TO_FIRST = """if stage.first:
            part = torch.empty_like(tied.grad)
            dist.recv(part, src=groups["ranks"]["embedding"][-1])
            tied.grad += part
        else:
            dist.send(tied.grad, dst=groups["ranks"]["embedding"][0])"""
FUNCTIONAL = """


def _functional_all_reduce(t, group):
    import torch.distributed._functional_collectives as funcol
    t.copy_(funcol.all_reduce(t, "sum", group))
"""
EDITS = {  # name -> the reference's sync_gradients cell, edited
    "untied": sources.replaced((EMBEDDING_AR, "pass  # the tied weight left as it is")),
    "dp_not_cp": sources.replaced((DIVIDE, "flat /= layout.dp")),
    "tp_mean": sources.replaced((TP_AR,
                                 TP_AR + "\n                p.grad /= layout.tp")),
    "no_tp": sources.replaced((TP_AR, "pass  # the SP gradients left partial")),
    "world": WORLD,
    "deadlock": sources.replaced(("if tied is not None and layout.pp > 1:",
                                  "if stage.first and layout.pp > 1:")),
    "twice": lambda src: src + (
        "\n    if stage.first and stage.last:  # the head's part too"
        "\n        stage.tok.weight.grad += stage.lm_head.weight.grad"),
    "pp_zeros": sources.replaced(PP_ZEROS),
    "grad_dropped": lambda src: src + (
        "\n    for name, p in stage.named_parameters():  # freed, as if done"
        "\n        if name.startswith(\"pos\"):"
        "\n            p.grad = None"),
    "tied_mean": sources.replaced((EMBEDDING_AR, EMBEDDING_AR + "\n        tied.grad /= 2")),
    "reduce_first": sources.replaced((EMBEDDING_AR, REDUCE_FIRST)),
    "send_to_first": sources.replaced((EMBEDDING_AR, SEND_TO_FIRST)),
    "only_layernorms": sources.replaced(("if shards[name] is None:",
                                         'if shards[name] is None and "ln" in name:')),
    "chapter_sp_params": sources.replaced((
        "for name, p in stage.named_parameters():\n            if shards[name] is None:",
        "for p in stage.sp_params:\n            if True:")),
    # right, through functional collectives, which torch.distributed's hooks do not see
    "functional": lambda src: src.replace(
        "dist.all_reduce(", "_functional_all_reduce(") + FUNCTIONAL,
}


GROUP_EDITS = {  # name -> the reference's embedding_group cell, edited
    "whole_pipeline": sources.replaced((
        "ranks = sorted({r, layout.rank(head._replace(pp=layout.pp - 1))})",
        "ranks = [layout.rank(head._replace(pp=s)) for s in range(layout.pp)]")),
    "duplicate": sources.replaced((
        "ranks = sorted({r, layout.rank(head._replace(pp=layout.pp - 1))})",
        "ranks = [r, layout.rank(head._replace(pp=layout.pp - 1))]")),
    "own_only": sources.replaced((
        "        group = dist.new_group(ranks)  # pp = 1: the first stage is the last, "
        "one rank\n        if dist.get_rank() in ranks:\n            mine = group",
        "        if dist.get_rank() in ranks:  # each rank makes its own group only\n"
        "            mine = dist.new_group(ranks)")),
    "graders": sources.replaced(("    mine = None\n",
                                 "    mine = None\n    gs.embedding_groups(layout)\n")),
}
COUNTED = ("(shards[name] is None and not tp_lead) or (\n"
           "            p is tied and not stage.first)")
NORM_EDITS = {  # name -> the reference's grad_norm cell, edited
    "norm_over_dp_cp": sources.replaced((
        'dist.all_reduce(squares, group=groups["pp"])',
        'dist.all_reduce(squares, group=groups["pp"])\n'
        '    dist.all_reduce(squares, group=groups["dp_cp"])')),
    "norm_tied_twice": sources.replaced((COUNTED, "shards[name] is None and not tp_lead")),
    "norm_replicas_tp": sources.replaced((
        "(shards[name] is None and not tp_lead) or (", "False or (")),
    "norm_squared": sources.replaced(("return squares.sqrt()", "return squares")),
    "norm_local": sources.replaced(('    dist.all_reduce(squares, group=groups["tp"])\n'
                                    '    dist.all_reduce(squares, group=groups["pp"])\n',
                                    "")),
    "norm_chapter": sources.replaced(("    shards = stage.shards()\n",
                                      "    from labsupport.capstone import clip\n"
                                      "    return clip.grad_norm(stage, groups)\n"
                                      "    shards = stage.shards()\n")),
}


def wrong(name):
    if name in GROUP_EDITS:
        return sources.reference(ASSIGNMENT, {"embedding_group": GROUP_EDITS[name]},
                                 name).embedding_group
    if name in NORM_EDITS:
        return sources.reference(ASSIGNMENT, {"grad_norm": NORM_EDITS[name]},
                                 name).grad_norm
    module = sources.reference(ASSIGNMENT, {"sync_gradients": EDITS[name]}, name)
    return module.sync_gradients


# -- layer 1: the plumbing ------------------------------------------------------------

def test_embedding_groups_pair_the_first_and_last_stage_of_each_shard():
    # ranks on the mesh (dp, pp, cp, tp), tp fastest (capstone.layout)
    assert gs.embedding_groups((2, 1, 2, 1)) == [[0, 1], [2, 3]]
    assert gs.embedding_groups((1, 2, 3, 1)) == [[0, 4], [1, 5]]
    assert gs.embedding_groups((2, 2, 1, 1)) == [[0], [1], [2], [3]]  # pp = 1: itself


def _stage_facts(layout):
    groups = gs.tied_groups(layout)
    layout = Layout(*layout)
    coords = layout.coords(dist.get_rank())
    gpt = ls.models.GPT(gs.tied_config(gs.layers_for(layout)), seed=0)
    stage = gs.TiedStage(gpt, layout, coords, groups)
    tied = stage.shared_embedding_or_output_weight()
    names = [n for n, _ in stage.named_parameters()]
    return dict(first=stage.first, last=stage.last, names=names,
                tied=None if tied is None else tied.detach().clone(),
                same=stage.first and stage.last
                and stage.tok.weight is stage.lm_head.weight,
                embedding=groups["ranks"]["embedding"])


def test_the_tied_stage_holds_the_embedding_shard_on_both_ends():
    gpt = ls.models.GPT(gs.tied_config(3), seed=0)
    outs = ls.run(_stage_facts, (1, 2, 3, 1), world_size=6, backend="gloo")
    for rank in (0, 1, 4, 5):           # first and last stage: tp rank's V/tp rows
        o, tp_rank = outs[rank], rank % 2
        assert torch.equal(o["tied"], gpt.tok.weight.detach().chunk(2)[tp_rank])
    embedding = [o["embedding"] for o in outs]
    assert embedding == [[0, 4], [1, 5], None, None, [0, 4], [1, 5]]
    assert "lm_head.weight" in outs[4]["names"] and "tok.weight" in outs[0]["names"]
    assert outs[2]["tied"] is None
    one = ls.run(_stage_facts, (2, 2, 1, 1), world_size=4, backend="gloo")
    assert all(o["same"] and "lm_head.weight" not in o["names"] for o in one)


def test_the_one_process_reference_is_the_tied_decoder():
    out = gs.reference()
    assert "lm_head.weight" not in out["grads"] and "tok.weight" in out["grads"]
    assert gs.tied_config().tie_weights and len(out["losses"]) == gs.STEPS


# -- layer 1: the checks ---------------------------------------------------------

def test_the_reference_passes_every_check_on_every_layout():
    gs.check_embedding_group(ref.embedding_group, gs.GROUPS + HIDDEN_GROUPS)
    for layouts in gs.VISIBLE.values():
        gs.check_parity(ref.sync_gradients, layouts)
    gs.check_parity(ref.sync_gradients, HIDDEN)
    gs.check_traffic(ref.sync_gradients, gs.TRAFFIC + HIDDEN)
    gs.check_clipped(ref.sync_gradients, ref.grad_norm, gs.CLIPPED + HIDDEN_CLIPPED)
    out = gs.parity(ref.sync_gradients, (1, 2, 2, 2))
    assert out["grad_rel"] < 1e-4 and out["loss_rel"] < 1e-5
    out = gs.parity(ref.sync_gradients, (1, 2, 3, 1), norm=ref.grad_norm)
    assert out["norm_rel"] < 1e-5 and out["loss_rel"] < 1e-5


# -- part 1: the embedding groups -------------------------------------------------

def test_the_whole_pipeline_as_the_embedding_group_is_named():
    whole = wrong("whole_pipeline")
    gs.check_embedding_group(whole)          # pp = 1 and 2: the same ranks
    text = fails(gs.check_embedding_group, whole, [(1, 2, 3, 1)])
    assert "rank 0's group holds ranks [0, 2, 4], where its embedding group is [0, 4]" \
        in text and "the first and the last stage's ranks" in text


def test_a_duplicate_rank_at_one_stage_is_named():
    text = fails(gs.check_embedding_group, wrong("duplicate"), [(2, 2, 1, 1)])
    assert "ranks list must not contain duplicate entries, got [0, 0]" in text


def test_groups_made_by_their_members_only_are_named_at_the_first_call():
    # Each rank makes its own group only: ranks 0 and 1 ask for [0, 1] while 2 and 3
    # ask for [2, 3] at the same call (gloo alone would hang or cross-wire them).
    text = fails(gs.check_embedding_group, wrong("own_only"), [(2, 1, 2, 1)],
                 timeout=SHORT)
    assert ("at call 1 of dist.new_group the ranks asked for different groups "
            "(rank 0 [0, 1], rank 1 [0, 1], rank 2 [2, 3], rank 3 [2, 3])") in text
    assert "dist.new_group, which is collective over the whole world" in text


def test_a_rank_that_skips_a_group_ends_at_the_deadline_explained():
    # Only the members call new_group, and the groups differ in number per rank:
    # at (1, 1, 3, 1) rank 1 (a middle stage) makes none and the others wait for it.
    t0 = time.monotonic()
    text = fails(gs.check_embedding_group, wrong("own_only"), [(1, 1, 3, 1)],
                 timeout=SHORT)
    assert stopped_as_a_stall(text, time.monotonic() - t0, SHORT)
    assert "embedding_group did not finish within 3 s on 3 ranks" in text
    assert "dist.new_group, which is collective over the whole world" in text


def test_the_graders_own_groups_are_refused():
    text = fails(gs.check_embedding_group, wrong("graders"), [(2, 1, 2, 1)])
    assert "embedding_group called the grader's embedding_groups" in text
    assert "decide it yourself" in text


# -- part 2: the sync, the tied weight ---------------------------------------------


def test_the_tied_weight_not_summed_across_stages_is_named():
    text = fails(gs.check_parity, wrong("untied"), [(2, 1, 2, 1)])
    assert "the gradient of tok.weight (the token embedding, tied to the LM" in text
    assert "summed over the embedding group" in text
    gs.check_parity(wrong("untied"), [(2, 2, 1, 1)])      # one stage: nothing to sum


def test_the_tied_weight_averaged_over_its_group_is_named_half():
    text = fails(gs.check_parity, wrong("tied_mean"), [(1, 2, 2, 2)])
    assert "the gradient of tok.weight (the token embedding" in text
    assert ("It is half the one-process gradient on the first stage (ranks [0, 1, 2, "
            "3]) and the last stage (ranks [4, 5, 6, 7]): the embedding group's two "
            "copies were averaged, not summed") in text


def test_a_last_stage_that_kept_its_own_part_is_named():
    # the last stage's part sent to the first, added there: the last keeps its own
    text = fails(gs.check_parity, wrong("send_to_first"), [(2, 1, 2, 1)])
    assert "differs from one process's on ranks [1, 3]" in text
    assert ("On the last stage (ranks [1, 3]) it is that stage's own part alone (what "
            "backward left there, averaged over dp x cp), while the first stage (ranks "
            "[0, 2]) holds the sum: the sum reached one end of the embedding group "
            "only.") in text
    assert "dist.all_reduce over groups['embedding']" in text


def test_a_reduce_onto_the_first_stage_is_named():
    # dist.reduce, as a new student writes it: the sum reaches the first stage only,
    # and what the last stage's tensor holds after it is gloo's business
    text = fails(gs.check_parity, wrong("reduce_first"), [(1, 2, 2, 2)])
    assert "it is that stage's own part alone" in text or "neither the sum" in text
    assert "while the first stage (ranks [0, 1, 2, 3]) holds the sum" in text
    assert "Your sync called dist.reduce: only its destination receives the sum" in text
    assert "no missing or doubled reduction" not in text.lower()


def test_an_average_that_forgets_cp_is_named():
    text = fails(gs.check_parity, wrong("dp_not_cp"), [(2, 1, 2, 2)])
    assert "It is 2 times the one-process gradient: divided by dp = 2 only" in text
    assert "divide by dp·cp = 4" in text
    gs.check_parity(wrong("dp_not_cp"), [(2, 1, 2, 1)])    # cp = 1: right


def test_sp_layernorms_averaged_over_tp_are_named():
    text = fails(gs.check_parity, wrong("tp_mean"), [(2, 2, 1, 1)])
    assert "the gradient of pos.weight" in text
    assert "must be summed over tp, not averaged" in text


def test_sp_layernorms_not_reduced_over_tp_are_named():
    text = fails(gs.check_parity, wrong("no_tp"), [(1, 2, 2, 2)])
    assert "the gradient of pos.weight" in text
    assert "Its sum over the tp group is the one-process gradient" in text


def test_only_the_layernorms_reduced_over_tp_is_named():
    text = fails(gs.check_parity, wrong("only_layernorms"), [(2, 2, 1, 1)])
    assert "the gradient of pos.weight" in text
    assert "Its sum over the tp group is the one-process gradient" in text


def test_the_chapters_sp_params_are_not_handed_over():
    text = fails(gs.check_parity, wrong("chapter_sp_params"), [(2, 2, 1, 1)])
    assert "'TiedStage' object has no attribute 'sp_params'" in text


def test_the_tied_weight_counted_twice_on_one_stage_is_named():
    text = fails(gs.check_parity, wrong("twice"), [(2, 2, 1, 1)])
    assert "It is twice the one-process gradient. With pp = 1" in text


def test_everything_over_the_world_is_right_but_loses_the_traffic():
    world = wrong("world")
    gs.check_parity(world, [(2, 1, 2, 1), (1, 2, 2, 2)])
    text = fails(gs.check_traffic, world, [(2, 1, 2, 1)])
    assert "rank 0 sent 205056 B" in text and "needs 118400 B" in text
    assert ("by group: the world 205056 B; needed: dp_cp 85632 B, embedding 32768 B"
            in text)
    assert "Unnecessary groups: the world." in text


def test_the_tied_weight_over_every_stage_loses_the_traffic():
    pp = wrong("pp_zeros")
    gs.check_parity(pp, [(1, 2, 3, 1)])
    gs.check_traffic(pp, [(2, 1, 2, 1)])                  # pp = 2: the same two ranks
    text = fails(gs.check_traffic, pp, [(1, 2, 3, 1)])
    assert "Unnecessary groups: pp." in text


def test_a_gradient_left_none_is_named():
    text = fails(gs.check_parity, wrong("grad_dropped"), [(2, 2, 1, 1)])
    assert "rank 0's pos.weight" in text and "had no gradient (.grad is None)" in text


def test_bytes_that_torch_distributed_does_not_see_get_no_traffic_points():
    functional = wrong("functional")
    gs.check_parity(functional, [(2, 1, 2, 1)])
    text = fails(gs.check_traffic, functional, [(2, 1, 2, 1)])
    assert "no call of ranks [0, 1, 2, 3] went through torch.distributed's" in text


def test_a_wrong_answer_gets_no_traffic_points():
    text = fails(gs.check_traffic, wrong("untied"), [(2, 1, 2, 1)])
    assert "is not right yet" in text and "its bytes are not graded" in text


def test_a_deadlock_ends_at_the_deadline_with_an_explanation():
    t0 = time.monotonic()
    text = fails(gs.check_parity, wrong("deadlock"), [(2, 1, 2, 1)], timeout=SHORT)
    assert stopped_as_a_stall(text, time.monotonic() - t0, SHORT)
    assert "sync_gradients did not finish within 3 s on 4 ranks" in text
    assert "rank 0 waited" in text and "in dist.all_reduce, which every rank of its " \
        "group, [0, 1], must call" in text


def test_the_untouched_stub_says_what_to_do():
    untouched = sources.reference(ASSIGNMENT, {"sync_gradients": lambda src: src[
        :src.index("    ### BEGIN SOLUTION")] + "    raise NotImplementedError()\n"},
        "untouched").sync_gradients
    text = fails(gs.check_parity, untouched, [(2, 1, 2, 1)])
    assert "NotImplementedError" in text and "Write your solution in place" in text


# -- part 3: the clipped step --------------------------------------------------------

def _norm_fails(name, layout):
    return fails(gs.check_clipped, ref.sync_gradients, wrong(name), [layout])


def test_a_norm_summed_over_dp_x_cp_is_named():
    text = _norm_fails("norm_over_dp_cp", (3, 1, 2, 1))
    assert "grad_norm on layout dp=3, tp=1, pp=2, cp=1 (6 ranks): at step 0" in text
    assert "It is sqrt(dp·cp) = sqrt(3) times too large: summed over dp x cp too" in text
    gs.check_clipped(ref.sync_gradients, wrong("norm_over_dp_cp"), [(1, 2, 3, 1)])


def test_the_tied_weight_counted_twice_in_the_norm_is_named():
    text = _norm_fails("norm_tied_twice", (1, 2, 3, 1))
    assert "It is the tied weight counted twice" in text


def test_replicated_parameters_counted_tp_times_in_the_norm_are_named():
    text = _norm_fails("norm_replicas_tp", (1, 2, 3, 1))
    assert "It is the parameters replicated over tp counted tp = 2 times" in text


def test_the_squared_norm_is_named():
    assert "It is the squared norm: take its square root" in _norm_fails(
        "norm_squared", (3, 1, 2, 1))


def test_each_ranks_own_norm_is_named():
    text = _norm_fails("norm_local", (1, 2, 3, 1))
    assert "different on different ranks" in text
    assert "It differs across the pp ranks" in text


def test_chapter_11s_clip_is_refused():
    text = _norm_fails("norm_chapter", (1, 2, 3, 1))
    assert "grad_norm called chapter 11's capstone.clip.grad_norm" in text


def test_a_norm_after_a_wrong_sync_is_not_graded():
    text = fails(gs.check_clipped, wrong("untied"), ref.grad_norm, [(1, 2, 3, 1)])
    assert "so the clipped step is not graded" in text
    assert "summed over the embedding group" in text


# -- layer 4: nbgrader on assignment 9 -------------------------------------------

SUBMISSIONS = {"reference": {}, "untouched": None,
               **{name: {"sync_gradients": EDITS[name]}
                  for name in ("untied", "tied_mean", "reduce_first", "world",
                               "deadlock")},
               "whole_pipeline": {"embedding_group": GROUP_EDITS["whole_pipeline"]},
               "norm_tied_twice": {"grad_norm": NORM_EDITS["norm_tied_twice"]}}
CELLS = {"test_embedding_group": 2, "test_two_stages": 2, "test_one_stage": 1,
         "test_all_dims": 2, "test_more_layouts": 3, "test_traffic": 2,
         "test_clipped_step": 3}
PP_CELLS = ("test_two_stages", "test_all_dims", "test_more_layouts")  # pp > 1 each
NOT_GRADED = {"test_traffic": "is not right yet",
              "test_clipped_step": "so the clipped step is not graded"}
FAILED = {  # submission -> the test cells that score zero, and what their message says
    "reference": {},
    "untouched": dict.fromkeys(CELLS, "NotImplementedError"),
    "untied": {**dict.fromkeys(PP_CELLS, "summed over the embedding group"),
               **NOT_GRADED},
    "tied_mean": {**dict.fromkeys(PP_CELLS, "It is half the one-process gradient"),
                  **NOT_GRADED},
    "reduce_first": {**dict.fromkeys(PP_CELLS, "Your sync called dist.reduce"),
                     **NOT_GRADED},
    "world": {"test_traffic": "Unnecessary groups: the world."},
    "deadlock": dict.fromkeys(PP_CELLS + ("test_traffic", "test_clipped_step"),
                              "did not finish within 4 s"),
    "whole_pipeline": {"test_embedding_group": "where its embedding group is [0, 4]"},
    "norm_tied_twice": {"test_clipped_step": "It is the tied weight counted twice"},
}


class TestNbgrader(RoundTrip):
    assignment, submissions, cells, failed = ASSIGNMENT, SUBMISSIONS, CELLS, FAILED
    totals = {"reference": 15, "untouched": 0, "untied": 3, "tied_mean": 3,
              "reduce_first": 3, "world": 13, "deadlock": 3, "whole_pipeline": 13,
              "norm_tied_twice": 12}
    stubs, hidden = 3, ("(3, 1, 2, 1)", "(2, 1, 2, 2)", "(3, 1, 1, 2)")
    try_cell, try_fails = "try-sync", ("untouched", "deadlock")
    timeout = 900   # s per nbgrader call: the nine took 107 s, and 304 s under load 17
    # The deadlock waits for its deadlines beside the others (autograde's `beside`):
    # these checks compare gradients and count bytes; none reads a clock or the
    # allocator (tests/test_grades_deterministic.py).
    beside = ("deadlock",)
