"""Checks of assignment 9: the gradient synchronisation of a 4-D layout, embedding tied.

    import labsupport as ls
    g = ls.grading.grad_sync_4d
    g.check_parity(sync_gradients, [(2, 1, 2, 1)])   # gradients = one process's
    g.check_traffic(sync_gradients, [(2, 1, 2, 1)])  # no byte more than needed

The student writes ``sync_gradients(stage, groups, layout)``, called on every
rank after the backward pass of chapter 11's composed step
(``capstone.trainer.step``: 1F1B over the pipeline stages, tensor, sequence
and context parallelism inside), on a layout ``(dp, tp, pp, cp)``. Unlike the
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

This package holds the plumbing only (``tied``: the tied stage and the
embedding groups; here: the runs, on ``capstone.trainer``'s loop, and their
comparison): which gradient goes over which group with which divisor is the
student's answer and lives in the instructors' source notebook.

Each check trains ``STEPS`` steps on the ranks through ``grading.run``'s
machinery (``diagnosis.run_on_ranks``: a deadline, so a deadlock ends in an
explanation, never a hung grader), with the same global batches as one
process training the tied ``models.GPT`` (``reference``), and compares every
parameter's gradient at step 0, after the student's sync (relative to the
parameter's largest entry, ``capstone.compare``'s measure and tolerances),
and the loss of every step. The calls the student's sync makes are recorded
(``labsupport.calls``) at step 0 for the traffic check, which counts bytes
sent per rank the way a ring moves them (chapter 2: an all-reduce of S bytes
over n ranks sends 2(n-1)/n·S per rank) and reads no clock.
"""
import functools

import torch
import torch.distributed as dist

from labsupport import calls, models, p2p_log
from labsupport.capstone import compare, trainer
from labsupport.capstone.layout import Layout
from labsupport.capstone.model import validate
from labsupport.checking.diagnosis import TIMEOUT, log_path, name_of, run_on_ranks
from labsupport.grading.grad_sync_4d.tied import TiedStage, embedding_groups, tied_groups  # noqa: F401 - the tests' and notebook's
from labsupport.launch import identity

VISIBLE = {"two_stages": ((2, 1, 2, 1),), "one_stage": ((2, 2, 1, 1),),
           "all_dims": ((1, 2, 2, 2),)}
TRAFFIC = tuple(layout for layouts in VISIBLE.values() for layout in layouts)
STEPS = 3             # the gradients at step 0, the loss of every step
BATCH, SEQ_LEN, MICRO_BATCHES = 12, 16, 2   # 12 rows split over dp = 1, 2, 3, 4, 6
LR = 3e-3
SIZES = dict(vocab_size=256, hidden=32, heads=4)
TIED = "tok.weight"   # the one-process name of the tied weight


def tied_config(layers=2) -> models.GPTConfig:
    """The assignment's decoder: chapter 11's sizes, the LM head tied to the
    token embedding."""
    return models.GPTConfig(**SIZES, seq_len=SEQ_LEN, layers=layers, tie_weights=True)


def layers_for(layout) -> int:
    """Blocks enough for every pipeline stage to hold one (2 at least)."""
    return max(2, Layout(*layout).pp)


def train_config(layers=2) -> trainer.TrainConfig:
    """What every graded run and the reference train: the tied decoder, the
    assignment's batches (the Bible's training split), AdamW."""
    return trainer.TrainConfig(model=tied_config(layers), batch=BATCH, seq_len=SEQ_LEN,
                               micro_batches=MICRO_BATCHES, lr=LR)


@functools.lru_cache(maxsize=4)
def reference(layers=2, steps=STEPS) -> dict:
    """One process training the tied ``models.GPT`` on the same global batches:
    {"losses": per step, "grads": {name: gradient at step 0}}."""
    out = trainer.reference(steps, train_config(layers), record_grads=(0,))
    return dict(losses=out["losses"], grads=out["grads"][0])


# -- the checks ---------------------------------------------------------------------

def check_parity(sync, layouts=VISIBLE["two_stages"], timeout=None):
    """After ``sync``, every parameter's gradient at step 0 is one process's (each
    rank's shard of it), and the loss of each of ``STEPS`` steps is too."""
    for layout in layouts:
        layout = Layout(*layout)
        outs = _outcome(sync, layout, timeout)
        ref = reference(layers_for(layout))
        problem = _parity_problem(outs, ref, layout)
        if problem:
            raise AssertionError(f"{name_of(sync)} on {_describe(layout)}: {problem}")


def check_traffic(sync, layouts=TRAFFIC, timeout=None):
    """Right on each layout first; then no rank sends more bytes than the
    reductions the layout needs: the partial gradients under SP summed over tp,
    every gradient averaged over dp x cp, the tied weight summed over the
    embedding group (ring bytes: 2(n-1)/n of each all-reduce's payload)."""
    name = name_of(sync)
    for layout in layouts:
        layout = Layout(*layout)
        outs = _outcome(sync, layout, timeout)
        problem = _parity_problem(outs, reference(layers_for(layout)), layout)
        if problem:
            raise AssertionError(f"{name} is not right yet on {_describe(layout)}, so "
                                 f"its bytes are not graded: {problem}")
        unseen = [o["rank"] for o in outs if needed_bytes(o) and not o["calls"]]
        if unseen:
            raise AssertionError(
                f"{name} on {_describe(layout)}: no call of ranks {unseen} went "
                "through torch.distributed's collectives (dist.all_reduce and the "
                "like), so their bytes cannot be counted: synchronise with them.")
        over = [o for o in outs if _sent(o["calls"]) > needed_bytes(o) * (1 + 1e-9)]
        if over:
            raise AssertionError(f"{name} on {_describe(layout)}: " + _traffic_message(
                over, layout))


def parity(sync, layout, timeout=None) -> dict:
    """For a try-out: the largest difference of any gradient at step 0 (relative
    to its parameter's largest entry) and of the losses (relative), against one
    process; raises like the checks if the run fails (a deadlock, an error)."""
    layout = Layout(*layout)
    outs = _outcome(sync, layout, timeout)
    ref = reference(layers_for(layout))
    diffs = compare.grad_differences([dict(o, grads={0: o["grads"]}) for o in outs],
                                     ref["grads"], 0)
    losses = zip(outs[0]["losses"], ref["losses"])
    return dict(layout=str(layout), grad_rel=max(d for d, _ in diffs.values()),
                loss_rel=max(abs(a - b) / abs(b) for a, b in losses))


# -- what a layout needs ------------------------------------------------------------

def needed(out) -> dict:
    """{group name: payload bytes} of the reductions rank ``out`` must take part in."""
    layout = Layout(*out["layout"])
    nbytes = {n: g.numel() * g.element_size() for n, g in out["grads"].items()}
    need = {}
    if layout.tp > 1 and out["sp"]:
        need["tp"] = sum(nbytes[n] for n in out["sp"])
    if layout.dp * layout.cp > 1:
        need["dp_cp"] = sum(nbytes.values())
    if layout.pp > 1 and TIED in nbytes:
        need["embedding"] = nbytes[TIED]
    return need


def needed_bytes(out) -> float:
    """What a ring sends per rank for ``needed(out)``: 2(n-1)/n of each payload."""
    sizes = {name: len(ranks or ()) for name, ranks in out["group_ranks"].items()}
    return sum(2 * (sizes[n] - 1) / sizes[n] * b for n, b in needed(out).items())


_FACTOR = {"all_reduce": 2, "broadcast": 1, "reduce": 1}   # others: 1 (gather, scatter)


def _sent(recorded) -> float:
    """Bytes a rank sends for its recorded calls: point-to-point payloads, and
    each collective as a ring moves it, factor·(n-1)/n of its payload."""
    total = 0.0
    for c in recorded:
        n = len(c["ranks"])
        if c["kind"] == "p2p":
            total += c["nbytes"] if "send" in c["op"] else 0
        else:
            total += _FACTOR.get(c["op"], 1) * (n - 1) / n * c["nbytes"]
    return total


def _group_name(ranks, out) -> str:
    """The layout's name for a group of ranks, as the student's ``groups`` has it."""
    ranks = tuple(sorted(ranks))
    for name in ("tp", "dp_cp", "embedding", "dp", "cp", "pp"):
        if tuple(sorted(out["group_ranks"][name] or ())) == ranks:
            return name
    if len(ranks) == Layout(*out["layout"]).world_size:
        return "the world"
    return f"the group of ranks {list(ranks)}"


def _traffic_message(over, layout) -> str:
    o = over[0]
    need = needed(o)
    used = {}
    for c in o["calls"]:
        if c["kind"] == "collective" or "send" in c["op"]:
            name = _group_name(c["ranks"], o)
            used[name] = used.get(name, 0) + _sent([c])
    extra = [n for n in used if n not in need and used[n] > 0]
    sizes = {n: len(r or ()) for n, r in o["group_ranks"].items()}
    mine = ", ".join(f"{n} {b:.0f} B" for n, b in used.items()) or "nothing"
    want = ", ".join(f"{n} {2 * (sizes[n] - 1) / sizes[n] * b:.0f} B"
                     for n, b in need.items()) or "nothing"
    text = (f"rank {o['rank']} sent {_sent(o['calls']):.0f} B for the gradients' "
            f"synchronisation (ring bytes: 2(n-1)/n of each all-reduce's payload), "
            f"where the layout needs {needed_bytes(o):.0f} B; by group: {mine}; "
            f"needed: {want}. ")
    if extra:
        text += ("Unnecessary groups: " + ", ".join(extra) + ". ")
    text += ("Reduce each gradient only over the ranks whose copies must be "
             "combined: the partial ones of sequence parallelism over tp, every one "
             "averaged over dp x cp in one all-reduce (dp_cp, not dp then cp), the "
             "tied weight summed over its embedding group (the two ranks holding it, "
             "not every stage).")
    others = sorted({x["rank"] for x in over} - {o["rank"]})
    if others:
        text += f" Ranks {others} too."
    return text


# -- comparing a layout with one process -----------------------------------------------

def _parity_problem(outs, ref, layout) -> str | None:
    for o in outs:
        if o["missing"]:
            return (f"after your sync rank {o['rank']}'s {', '.join(o['missing'][:3])} "
                    "had no gradient (.grad is None): leave every gradient in its "
                    "parameter's .grad")
        for n, g in o["grads"].items():
            want = compare.local_slice(ref["grads"][n], o["shards"][n])
            if g.shape != want.shape or g.dtype != want.dtype:
                return (f"after your sync rank {o['rank']}'s {n}.grad is a {g.dtype} "
                        f"tensor of shape {tuple(g.shape)}, where its parameter is "
                        f"{want.dtype} {tuple(want.shape)}: keep each gradient the "
                        "shape of its parameter's shard")
    diffs = compare.grad_differences([dict(o, grads={0: o["grads"]}) for o in outs],
                                     ref["grads"], 0)
    bad = [n for n in ref["grads"] if n in diffs and diffs[n][1]]
    if bad:
        name = bad[0]
        ranks = diffs[name][1]
        why = _diagnose(outs, ref["grads"], name, ranks, layout)
        more = f" ({len(bad) - 1} other parameters differ too)" if len(bad) > 1 else ""
        return (f"the gradient of {_label(name)} after your sync differs from one "
                f"process's on ranks {ranks}, by up to {diffs[name][0]:.2g} of its "
                f"largest entry{more}. {why}")
    for k, (a, b) in enumerate(zip(outs[0]["losses"], ref["losses"])):
        if abs(a - b) > compare.LOSS_RTOL * abs(b):
            return (f"the gradients of step 0 are right, but the loss of step {k} is "
                    f"{a:.6f} where one process has {b:.6f}: every step must be "
                    "synchronised the same way (and only the gradients changed)")
    return None


def _label(name):
    if name == TIED:
        return (f"{TIED} (the token embedding, tied to the LM head: lm_head.weight on "
                "the last stage)")
    return name


def _diagnose(outs, ref, name, ranks, layout) -> str:
    """Which reduction explains the difference of ``name`` on ``ranks``."""
    local = {o["rank"]: o["grads"][name] for o in outs if name in o["grads"]}
    want = {o["rank"]: compare.local_slice(ref[name], o["shards"][name])
            for o in outs if name in o["grads"]}
    coords = {o["rank"]: Layout(*layout).coords(o["rank"]) for o in outs}
    sp = {o["rank"]: name in o["sp"] for o in outs}

    def close(a, b):
        scale = max(b.abs().max().item(), 1e-30)
        return (a - b).abs().max().item() / scale < compare.GRAD_RTOL * 10

    def summed_over(axis):  # the sum over each group of this axis is the reference
        groups = {}
        for r in local:
            c = coords[r]
            key = tuple(v for a, v in zip(c._fields, c) if a not in axis)
            groups.setdefault(key, []).append(r)
        return all(close(sum(local[r] for r in g), want[g[0]])
                   for g in groups.values() if any(r in ranks for r in g))

    def factor(k):
        return k > 1 and all(close(local[r], want[r] * k) for r in ranks)

    dp, cp, tp, pp = layout.dp, layout.cp, layout.tp, layout.pp
    if name == TIED and pp > 1 and summed_over(("pp",)):
        return ("The first stage's gradient (the embedding's use) plus the last "
                "stage's (the LM head's) is the one-process gradient: the tied "
                "weight's two copies must be summed over the embedding group, "
                "groups['embedding'] (the first and last stage's ranks of the same dp, "
                "cp and tp), so that both stages step it the same way.")
    if name == TIED and pp == 1 and factor(2):
        return ("It is twice the one-process gradient. With pp = 1 the embedding and "
                "the LM head are one Parameter on one stage: autograd has already "
                "summed both uses, so there is nothing to add across stages (and the "
                "embedding group is this rank alone).")
    if tp > 1 and any(sp[r] for r in ranks) and summed_over(("tp",)):
        return ("Its sum over the tp group is the one-process gradient: under sequence "
                "parallelism each tp rank's LayerNorms (and row-parallel biases, the "
                "position embedding) saw only its s/tp positions, so their gradients "
                "are partial and must be summed over tp, not averaged.")
    if dp * cp > 1 and all(close(_replica_mean(local, coords, q), want[q])
                           for q in ranks):
        return (f"The mean over the {dp * cp} dp x cp ranks is the one-process "
                "gradient: each of them saw different tokens (rows for dp, positions "
                "for cp), so every gradient must be averaged over dp_cp (a sum, then "
                "/ dp·cp).")
    readings = [(dp * cp, f"summed over dp x cp but not divided by dp·cp = {dp * cp}"),
                (cp, f"divided by dp = {dp} only: the cp ranks also saw different "
                     f"tokens (their positions), so divide by dp·cp = {dp * cp}"),
                (dp, f"divided by cp = {cp} only: divide by dp·cp = {dp * cp}"),
                (tp, "summed over tp once too often, or a tp sum applied to a "
                     "gradient that is not partial"),
                (2, "counted twice")]
    for k, text in readings:
        if factor(k):
            return f"It is {k} times the one-process gradient: {text}."
    for k, _ in readings[:3]:
        if k > 1 and all(close(local[r] * k, want[r]) for r in ranks):
            return (f"It is 1/{k} of the one-process gradient: divided by {k} once too "
                    "often (average over dp x cp = a sum, then one division by dp·cp).")
    return ("No missing or doubled reduction over one group explains it: check "
            "which parameters are partial under sequence parallelism (sum over tp), "
            "that every gradient is averaged over dp x cp, and that only the tied "
            "weight is summed over the embedding group.")


def _replica_mean(local, coords, q):
    """The mean of ``local`` over the ranks holding rank q's piece of the model
    (those that differ from it in dp and cp only)."""
    piece = (coords[q].pp, coords[q].tp)
    same = [r for r in local if (coords[r].pp, coords[r].tp) == piece]
    return sum(local[r] for r in same) / len(same)


def _describe(layout) -> str:
    return (f"layout dp={layout.dp}, tp={layout.tp}, pp={layout.pp}, cp={layout.cp} "
            f"({layout.world_size} ranks)")


# -- running the student's sync on the ranks ------------------------------------------

_RUNS = {}   # (id(sync), layout, timeout) -> (sync, outs or the failure's text)


def _outcome(sync, layout, timeout):
    """The ranks' results of ``_train`` with ``sync`` (once per function and layout:
    the parity and traffic checks share a run); a failure -> AssertionError."""
    timeout = TIMEOUT if timeout is None else timeout
    key = (id(sync), tuple(layout), timeout)
    if key not in _RUNS or _RUNS[key][0] is not sync:
        try:
            result = run_on_ranks(_train, (sync, tuple(layout)), layout.world_size,
                                  timeout, name_of(sync))
        except AssertionError as failure:
            result = str(failure)
        _RUNS[key] = (sync, result)
    result = _RUNS[key][1]
    if isinstance(result, str):
        raise AssertionError(result)
    return result


def _train(log_dir, sync, layout):
    """On each rank: ``STEPS`` steps of the tied decoder with ``sync``; its losses,
    its gradients after the sync at step 0, and the calls the sync made."""
    layout = Layout(*layout)
    cfg = train_config(layers_for(layout))
    validate(cfg.gpt_config(), layout, SEQ_LEN, True)
    stage, groups, coords = trainer.build(layout, cfg.gpt_config(), stage_class=TiedStage,
                                          groups_of=tied_groups)
    opt = cfg.make_optimizer(list(stage.parameters()))
    rank, seen = dist.get_rank(), {}

    def traced(stage, groups, layout):
        with calls.record() as log:
            sync(stage, groups, layout)
        if not seen:
            seen["calls"] = [dict(op=c["op"], kind=c["kind"], ranks=c["ranks"],
                                  nbytes=c["nbytes"]) for c in log.calls]
            named = list(stage.named_parameters())
            seen["grads"] = {n: p.grad.detach().clone() for n, p in named
                             if isinstance(p.grad, torch.Tensor)}
            seen["missing"] = [n for n, _ in named if n not in seen["grads"]]

    traced.__name__ = name_of(sync)

    def one_step(k, ids, targets):
        return trainer.step(stage, opt, (ids, targets), layout, groups, coords,
                            MICRO_BATCHES, sync=traced)

    with p2p_log.record(log_path(log_dir, rank)):     # no barrier: a deadlock is the sync's
        out = trainer.run_steps(one_step, cfg.loader(layout, coords), STEPS, timed=False,
                                device=identity.device())
    rename = {"lm_head.weight": TIED} if stage.last and not stage.first else {}
    shards = stage.shards()
    sp = {id(p) for p in stage.sp_params}
    return dict(rank=rank, layout=tuple(layout), coords=tuple(coords), losses=out["losses"],
                grads={rename.get(n, n): g.cpu() for n, g in seen["grads"].items()},
                shards={rename.get(n, n): s for n, s in shards.items()},
                sp=[rename.get(n, n) for n, p in stage.named_parameters()
                    if id(p) in sp],
                calls=seen["calls"], missing=seen["missing"],
                group_ranks={n: r and list(r) for n, r in groups["ranks"].items()})
