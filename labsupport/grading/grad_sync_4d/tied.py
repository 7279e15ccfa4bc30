"""Assignment 9's tied decoder on a 4-D layout: the rank's stage and the embedding groups.

The assignment's decoder ties the LM head to the token embedding
(``models.GPTConfig(tie_weights=True)``, GPT-2's choice). With the embedding on
the first pipeline stage and the head on the last, the one weight lives on two
stages (``TiedStage``, the rank's piece of it); Megatron-LM keeps the two copies
equal by summing their gradients over its *embedding group*, the first and last
stage's ranks that hold the same shard (the grader's ``embedding_groups``,
``tied_groups``, which refuse to run inside a student's ``embedding_group``;
``_allreduce_word_embedding_grads`` in
``megatron/core/distributed/finalize_model_grads.py``). The grader
(``grading.grad_sync_4d``) trains this stage with ``capstone.trainer``'s loop.
"""
import torch.distributed as dist

from labsupport.capstone.layout import Layout, make_groups
from labsupport.capstone.model import Stage


class TiedStage(Stage):
    """Chapter 11's ``Stage`` of a tied decoder: the LM head's weight is the token
    embedding's shard (the same rows V/tp of the same matrix: the embedding is
    split by vocabulary rows, the head by output rows, so tp rank t holds the
    same slice in both). On the first and last stage, different ranks when
    pp > 1, the two copies start equal (one seeded model); with pp = 1 they are
    one Parameter (``named_parameters`` lists it once, as ``tok.weight``)."""

    def __init__(self, gpt, layout, coords, groups, sequence_parallel=True):
        if not gpt.cfg.tie_weights:
            raise ValueError("TiedStage needs a tied decoder (tie_weights=True)")
        super().__init__(gpt, layout, coords, groups, sequence_parallel)
        if self.first and self.last:
            self.lm_head.weight = self.tok.weight

    def shared_embedding_or_output_weight(self):
        """The tied weight this stage holds (the embedding's on the first stage, the
        head's on the last), or None (Megatron-LM's name for it)."""
        if self.first:
            return self.tok.weight
        return self.lm_head.weight if self.last else None


def embedding_groups(layout) -> list:
    """Megatron's embedding groups, as lists of ranks: for each (dp, cp, tp)
    coordinate, the ranks of the first and the last stage (one rank if pp = 1):
    what the grader checks a student's groups against."""
    _refuse_while_the_student_builds()
    layout = Layout(*layout)
    out = []
    for dp in range(layout.dp):
        for cp in range(layout.cp):
            for tp in range(layout.tp):
                ends = {layout.rank((dp, pp, cp, tp)) for pp in (0, layout.pp - 1)}
                out.append(sorted(ends))
    return out


_GROUPS = {}
_STUDENT_BUILDING = []   # non-empty while a student's embedding_group runs (the grader's)


def _refuse_while_the_student_builds():
    if _STUDENT_BUILDING:
        raise AssertionError(
            "embedding_group called the grader's own groups (grad_sync_4d.tied): build "
            "the embedding groups yourself with dist.new_group")


def tied_groups(layout) -> dict:
    """``capstone.layout.make_groups`` plus "embedding", this rank's embedding
    group (and its ranks under "ranks"). Every rank makes every group in one
    order; cached per layout for the life of the process group. A middle stage
    holds no tied weight and is in no embedding group: None (as in Megatron).
    The grader hands these to the student's sync, so that part 1 (the student's
    own groups) and part 2 are graded apart."""
    _refuse_while_the_student_builds()
    layout = Layout(*layout)
    key = (layout, id(dist.group.WORLD))
    if key not in _GROUPS:
        base, rank, mine = make_groups(layout), dist.get_rank(), (None, None)
        for ranks in embedding_groups(layout):
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = (group, ranks)
        _GROUPS[key] = dict(base, embedding=mine[0],
                            ranks=dict(base["ranks"], embedding=mine[1]))
    return _GROUPS[key]
