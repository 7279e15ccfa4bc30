"""Assignment 9's functions run on the ranks: the student's groups, sync and norm.

``train_on_rank`` trains ``STEPS`` steps of the tied decoder with chapter 11's
loop (``capstone.trainer.step``) and the student's ``sync``; with ``norm``,
each step's gradients are then clipped as one process's ``clip_grad_norm_``
clips them (``clip_grads_with_norm_`` with the norm the student computed,
``MAX_NORM``). ``groups_on_rank`` runs the student's ``embedding_group``.
``outcome`` runs either once per (function, layout) through
``diagnosis.run_on_ranks`` (a deadline: a deadlock ends in an explanation),
shared by the checks that grade the same run.

What the chapter decided is not handed over: the stage given to the sync has
no ``sp_params`` (the student finds which gradients sequence parallelism
leaves partial), and a student's function may not call the chapter's own
answer (``REFUSED``: chapter 4's list of those parameters, chapter 11's
clipping, the grader's own embedding groups): ``_refusing`` notes such a call
with ``sys.setprofile``, however the function was imported, and the rank
raises an AssertionError that says so.
"""
import contextlib
import sys

import torch
import torch.distributed as dist

from labsupport import calls, p2p_log
from labsupport.capstone import clip, trainer
from labsupport.capstone.layout import Layout
from labsupport.capstone.model import validate
from labsupport.checking.diagnosis import TIMEOUT, log_path, name_of, run_on_ranks
from labsupport.grading.grad_sync_4d import tied
from labsupport.grading.grad_sync_4d.config import (
    MAX_NORM,
    MICRO_BATCHES,
    SEQ_LEN,
    STEPS,
    TIED,
    layers_for,
    train_config,
)
from labsupport.launch import identity
from labsupport.tensor_parallel import gpt as tp_gpt

_CHAPTERS = {  # the functions that hold a part's answer: what the text calls them
    "sync": {tp_gpt.sequence_parallel_params: "chapter 4's sequence_parallel_params",
             tp_gpt.allreduce_sequence_parallel_grads:
                 "chapter 4's allreduce_sequence_parallel_grads",
             trainer.sync_gradients: "chapter 11's trainer.sync_gradients"},
    "norm": {f: f"chapter 11's capstone.clip.{f.__name__}" for f in
             (clip.grad_norm, clip.counted_grads, clip.clip_grad_norm_)},
    "groups": {tied.embedding_groups: "the grader's embedding_groups",
               tied.tied_groups: "the grader's tied_groups"},
}
REFUSED = {part: {f.__code__: what for f, what in fns.items()}
           for part, fns in _CHAPTERS.items()}


@contextlib.contextmanager
def _refusing(part, fn):
    """Run the block; if it called one of ``REFUSED[part]``, raise an AssertionError
    naming it (even over the block's own exception: the call is the cause)."""
    refused, seen = REFUSED[part], []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in refused:
            seen.append(refused[frame.f_code])

    old = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(old)
        if seen:
            raise AssertionError(
                f"{name_of(fn)} called {seen[0]}, which holds the answer of this part: "
                "decide it yourself, from the stage, the groups and the layout you are "
                "given")


_RUNS = {}   # (ids of the functions, layout, timeout) -> (functions, result or failure)


def outcome(rank_fn, fns, layout, timeout, name):
    """The ranks' results of ``rank_fn(log_dir, *fns, layout)``, once per functions
    and layout (the checks of one run share it); a failure -> AssertionError."""
    timeout = TIMEOUT if timeout is None else timeout
    layout = Layout(*layout)
    key = (rank_fn.__name__, tuple(map(id, fns)), tuple(layout), timeout)
    if key not in _RUNS or any(a is not b for a, b in zip(_RUNS[key][0], fns)):
        try:
            result = run_on_ranks(rank_fn, (*fns, tuple(layout)), layout.world_size,
                                  timeout, name)
        except AssertionError as failure:
            result = str(failure)
        _RUNS[key] = (fns, result)
    result = _RUNS[key][1]
    if isinstance(result, str):
        raise AssertionError(result)
    return result


def groups_on_rank(log_dir, build, layout):
    """On each rank: ``build(layout)``, and what it returned: None, or the ranks of
    the group (which then sums a one over itself: every member made it)."""
    layout, rank = Layout(*layout), dist.get_rank()
    tied._STUDENT_BUILDING.append(True)
    try:
        with p2p_log.record(log_path(log_dir, rank)), _refusing("groups", build), \
                _new_group_in_step():
            group = build(layout)
            out = dict(rank=rank, ranks=None, kind=type(group).__name__)
            if isinstance(group, dist.ProcessGroup):
                ones = torch.ones(1)
                dist.all_reduce(ones, group=group)
                out.update(ranks=dist.get_process_group_ranks(group), summed=ones.item())
            elif group == dist.GroupMember.NON_GROUP_MEMBER:
                out["kind"] = "not a member"
    finally:
        tied._STUDENT_BUILDING.pop()
    return out


NEW_GROUP = ("dist.new_group, which is collective over the whole world: every rank "
             "must call it for every group, in the same order, the groups it is not "
             "in included (it returns a non-member marker there)")


@contextlib.contextmanager
def _new_group_in_step():
    """While the student's ``embedding_group`` runs, each ``dist.new_group`` call first
    all-gathers, over the world, the ranks it was given: two ranks that make different
    groups at the same call are told so at once, and a rank that skips a call leaves the
    others waiting here (the deadline explains it). Without this, two groups made under
    one name (each by its own members only) meet in gloo's rendezvous, which, by the
    machine's timing, hangs or wires one group's ranks to the other's."""
    real, calls_made = dist.new_group, [0]

    def in_step(ranks=None, *args, **kwargs):
        mine = None if ranks is None else [int(r) for r in ranks]
        if mine is not None and len(set(mine)) != len(mine):
            return real(ranks, *args, **kwargs)          # its own error names the duplicate
        calls_made[0] += 1
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, None if mine is None else sorted(mine))
        if any(x != every[0] for x in every):
            made = ", ".join(f"rank {r} {x}" for r, x in enumerate(every))
            raise AssertionError(
                f"at call {calls_made[0]} of dist.new_group the ranks asked for different "
                f"groups ({made}): {NEW_GROUP}.")
        return real(ranks, *args, **kwargs)

    dist.new_group = in_step
    try:
        yield
    finally:
        dist.new_group = real


def train_on_rank(log_dir, sync, norm, layout):
    """On each rank: ``STEPS`` steps of the tied decoder with ``sync`` (then, if
    ``norm`` is given, the clip by its norm); the losses, the gradients before
    and after the sync at step 0, the calls the sync made, the norms."""
    layout = Layout(*layout)
    cfg = train_config(layers_for(layout), None if norm is None else MAX_NORM)
    sequence_parallel = layout.tp > 1          # Megatron's: no SP without TP
    validate(cfg.gpt_config(), layout, SEQ_LEN, sequence_parallel)
    stage, groups, coords = trainer.build(layout, cfg.gpt_config(), seed=cfg.seed,
                                          sequence_parallel=sequence_parallel,
                                          stage_class=tied.TiedStage,
                                          groups_of=tied.tied_groups)
    partial = {id(p) for p in stage.sp_params} if sequence_parallel else set()
    del stage.sp_params                        # the student decides which they are
    opt = cfg.make_optimizer(list(stage.parameters()))
    rank, seen, norms = dist.get_rank(), {}, []

    def grads():
        return {n: p.grad.detach().clone() for n, p in stage.named_parameters()
                if isinstance(p.grad, torch.Tensor)}

    def traced(stage, groups, layout):
        first = not seen
        if first:
            seen["before"] = grads()
        with calls.record() as log, _refusing("sync", sync):
            sync(stage, groups, layout)
        if first:
            seen["calls"] = [dict(op=c["op"], kind=c["kind"], ranks=c["ranks"],
                                  nbytes=c["nbytes"]) for c in log.calls]
            seen["grads"] = grads()
            seen["missing"] = [n for n, _ in stage.named_parameters()
                               if n not in seen["grads"]]
        if norm is not None:
            norms.append(_clip_by(norm, stage, groups, layout))

    traced.__name__ = name_of(sync)

    def one_step(k, ids, targets):
        return trainer.step(stage, opt, (ids, targets), layout, groups, coords,
                            MICRO_BATCHES, sync=traced)

    with p2p_log.record(log_path(log_dir, rank)):     # no barrier: a deadlock is the sync's
        out = trainer.run_steps(one_step, cfg.loader(layout, coords), STEPS, timed=False,
                                device=identity.device())
    rename = {"lm_head.weight": TIED} if stage.last and not stage.first else {}

    def renamed(d):
        return {rename.get(n, n): v.cpu() if torch.is_tensor(v) else v
                for n, v in d.items()}

    return dict(rank=rank, layout=tuple(layout), coords=tuple(coords), losses=out["losses"],
                grads=renamed(seen["grads"]), before=renamed(seen["before"]),
                shards=renamed(stage.shards()), norms=norms,
                sp=[rename.get(n, n) for n, p in stage.named_parameters()
                    if id(p) in partial],
                calls=seen["calls"], missing=seen["missing"],
                group_ranks={n: r and list(r) for n, r in groups["ranks"].items()})


def _clip_by(norm, stage, groups, layout) -> float:
    """The student's norm, then every gradient scaled as ``clip_grad_norm_`` scales it."""
    with _refusing("norm", norm):
        total = norm(stage, groups, layout)
    if not (torch.is_tensor(total) and total.numel() == 1) and not isinstance(
            total, (int, float)):
        raise AssertionError(f"{name_of(norm)} returned {type(total).__name__}: return "
                             "the global norm, a one-element tensor (or a float)")
    total = torch.as_tensor(float(total))
    torch.nn.utils.clip_grads_with_norm_(stage.parameters(), MAX_NORM, total)
    return total.item()

