"""Parity between layouts, and the procedure that says why it breaks.

    report = compare((1, 1, 1, 1), (2, 2, 2, 1), steps=3)      # from the notebook
    print(report)    # equal, or: first step, parameter, ranks, factor, the reduction

The question of NVIDIA/Megatron-LM #1736 ("established ranges or detection
methods" for a parallel loss that differs from one GPU) and torchtitan's
answer in prose (``docs/converging.md``: same global batch, same seed
checkpoint, compare step 1, then the curves), executed: both layouts train
from the same seeded weights on the same global batches; the first step whose
loss or gradients differ beyond the tolerance is located, and in it the first
parameter (in the model's order) whose gradient differs, on which ranks, by
what factor; then each group the layout has is tried as the explanation:

- the ranks' gradients are |G| times the reference: a reduction over G
  doubled, or an average over G that forgot its division;
- they are 1/|G| of it: divided by |G| once too often;
- their sum over G is the reference: the all-reduce over G is missing (a
  partial gradient left unsummed, as LayerNorm's under sequence parallelism).
"""
import dataclasses
import math
import tempfile

import torch

from labsupport.launch import session
from labsupport.capstone import checkpoint, trainer
from labsupport.capstone.layout import Layout, layout_groups
from labsupport.capstone.trainer import all_reduce_buckets
from labsupport.tensor_parallel.gpt import allreduce_sequence_parallel_grads

LOSS_RTOL = 1e-5      # fp32: another order of the same sums
GRAD_RTOL = 1e-4      # of the parameter's largest reference entry, or of FLOOR x the
FLOOR = 1e-3          # model's: a gradient that is zero in exact arithmetic (the key
                      # biases': softmax ignores a constant added to a row) is noise


def local_slice(full, shard):
    """The part of a whole tensor that a rank holds: its TP chunk, or all of it."""
    if shard is None:
        return full
    dim, rank, tp = shard
    return full.chunk(tp, dim)[rank]


def assemble(outs, pick):
    """{name: whole tensor} from one layout's ``train`` results, ``pick(out)``
    giving each rank's {name: tensor}: TP chunks concatenated, taken from the
    ranks at dp = cp = 0 (the others hold the same after a correct sync)."""
    pieces = {}
    for out in outs:
        c = out["coords"]             # (dp, pp, cp, tp)
        if c[0] or c[2]:
            continue
        for name, t in pick(out).items():
            shard = out["shards"][name]
            pieces.setdefault(name, {})[0 if shard is None else shard[1]] = (t, shard)
    whole = {}
    for name, parts in pieces.items():
        t, shard = parts[0]
        whole[name] = t if shard is None else torch.cat(
            [parts[i][0] for i in range(shard[2])], dim=shard[0])
    return whole


def full_grads(outs, step):
    """{name: whole gradient} at ``step`` of one layout's ``train`` results."""
    return assemble(outs, lambda out: out["grads"][step])


def full_params(outs):
    """The whole decoder's parameters after ``train(..., return_params=True)``:
    ``models.GPT(config).load_state_dict(full_params(outs))``."""
    return assemble(outs, lambda out: out["params"])


def grad_differences(outs, ref, step):
    """{name: (largest |difference| over ranks / the parameter's scale, ranks
    where it passes GRAD_RTOL)} of every rank's gradient against the whole
    reference ``ref`` (one process's, or another layout's ``full_grads``)."""
    out, floor = {}, FLOOR * max(g.abs().max().item() for g in ref.values())
    for o in outs:
        for name, g in o["grads"][step].items():
            want = local_slice(ref[name], o["shards"][name]).to(g)
            scale = max(ref[name].abs().max().item(), floor) or 1.0
            diff = (g - want).abs().max().item() / scale
            worst, ranks = out.get(name, (0.0, []))
            out[name] = (max(worst, diff), ranks + [o["rank"]] * (diff > GRAD_RTOL))
    return out


def parity(outs, ref):
    """Layout results against a reference run (``trainer.reference`` or another
    layout's): the step-0 loss's relative difference, the largest relative
    difference of the curve, and the largest gradient difference of any
    recorded step (relative to each parameter's largest entry)."""
    losses = outs[0]["losses"]
    want = ref["losses"]
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, want)]
    steps = sorted(outs[0]["grads"])
    grads = max((d for k in steps
                 for d, _ in grad_differences(outs, ref["grads"][k], k).values()),
                default=0.0)
    return dict(step0_rel=rel[0], curve_rel=max(rel), grad_rel=grads)


@dataclasses.dataclass
class Report:
    """Where two runs part: None everywhere when they agree."""
    layouts: tuple
    step: int | None = None
    loss_rel: float | None = None
    parameter: str | None = None
    ranks: list | None = None
    factor: float | None = None
    reduction: str | None = None

    @property
    def equal(self):
        return self.step is None

    def __str__(self):
        a, b = (str(Layout(*x)) for x in self.layouts)
        if self.equal:
            return f"{b} = {a}: every step's loss and gradients within tolerance"
        lines = [f"{b} vs {a}: first difference at step {self.step} "
                 f"(loss relative difference {self.loss_rel:.1e})"]
        if self.parameter:
            lines.append(f"  first parameter: {self.parameter}, on ranks {self.ranks}, "
                         f"x{self.factor:.3g} the reference")
        lines.append(f"  diagnosis: {self.reduction or 'not a group-size factor'}")
        return "\n".join(lines)


def diagnose(outs, ref, step, name, layout):
    """(ranks, factor, explanation) for parameter ``name`` at ``step``."""
    layout = Layout(*layout)
    groups = layout_groups(layout)
    by_rank = {o["rank"]: o for o in outs}
    bad = grad_differences(outs, ref, step)[name][1]
    local = {r: o["grads"][step][name] for r, o in by_rank.items()
             if name in o["grads"][step]}
    want = {r: local_slice(ref[name], by_rank[r]["shards"][name]).to(g)
            for r, g in local.items()}
    got = torch.cat([local[r].flatten() for r in bad])
    exp = torch.cat([want[r].flatten() for r in bad])
    factor = (got @ exp / (exp @ exp)).item() if exp.abs().sum() else math.nan

    def close(a, b):
        scale = b.abs().max().item() or 1.0
        return (a - b).abs().max().item() / scale < GRAD_RTOL * 10

    sizes = {n: len(gs[0]) for n, gs in groups.items() if len(gs[0]) > 1
             and not (n == "dp_cp" and min(layout.dp, layout.cp) == 1)}  # = dp or cp
    for size in sorted(set(sizes.values())):
        names = " or ".join(n for n in sizes if sizes[n] == size)
        alike = (f" (groups of the same size: run a layout where they differ to tell "
                 f"them apart)" if " or " in names else "")
        if all(close(local[r], want[r] * size) for r in bad):
            return bad, factor, (f"x{size} = |{names}|: a reduction over {names} "
                                 f"doubled, or an average over {names} that does not "
                                 f"divide by "
                                 f"{size}{alike}")
        if all(close(local[r], want[r] / size) for r in bad):
            return bad, factor, (f"/{size} = |{names}|: divided by the size of {names} "
                                 f"once too often{alike}")
    for n in sizes:
        ok = True
        for g in groups[n]:
            held = [r for r in g if r in local]
            if not held or not any(r in bad for r in held):
                continue
            total = sum(local[r] for r in held)
            ok &= all(close(total, want[r]) for r in held)
        if ok:
            return bad, factor, (f"the sum over the {n} group is the reference: the "
                                 f"all-reduce over {n} is missing (partial gradients)")
    return bad, factor, None


def first_difference(outs_a, outs_b, layout_b, ref=None):
    """Report of where ``outs_b`` leaves ``outs_a`` (both ``train`` results with
    gradients recorded at every step); ``ref`` a one-process run to use as
    ``outs_a``'s whole gradients, if it has them."""
    la, lb = outs_a[0]["losses"], outs_b[0]["losses"]
    report = Report((outs_a[0]["layout"], tuple(layout_b)))
    for k in range(min(len(la), len(lb))):
        whole = ref["grads"][k] if ref else full_grads(outs_a, k)
        diffs = grad_differences(outs_b, whole, k)
        rel = abs(lb[k] - la[k]) / abs(la[k])
        bad = [n for n, (d, ranks) in diffs.items() if ranks]
        if rel <= LOSS_RTOL and not bad:
            continue
        report.step, report.loss_rel = k, rel
        if bad:
            order = list(whole)                       # the model's parameter order
            name = min(bad, key=order.index)
            report.parameter = name
            report.ranks, report.factor, report.reduction = diagnose(
                outs_b, whole, k, name, layout_b)
        return report
    return report


def sync_without_sp_reduce(stage, groups, layout):
    """Broken on purpose: ``trainer.sync_gradients`` without its first line, so
    the LayerNorm (and other sequence-parallel) gradients stay partial over tp."""
    all_reduce_buckets(stage, groups["dp_cp"], divide_by=layout.dp * layout.cp)


def sync_dp_not_cp(stage, groups, layout):
    """Broken on purpose: the gradients summed over the dp x cp ranks but
    averaged as if only dp held different tokens (divided by dp, not dp·cp)."""
    allreduce_sequence_parallel_grads(stage)
    all_reduce_buckets(stage, groups["dp_cp"], divide_by=layout.dp)


BROKEN = {"LayerNorm grads not reduced over tp under SP": sync_without_sp_reduce,
          "loss averaged over dp but not cp": sync_dp_not_cp}


def compare(layout_a, layout_b, steps=3, sync_b=None, **train_kw):
    """Train on both layouts (from the notebook: ranks started by ``ls.run``)
    and report the first step, parameter, ranks and factor where they differ.
    ``sync_b``: another gradient synchronisation for ``layout_b`` (a broken one)."""
    kw = dict(train_kw, record_grads=tuple(range(steps)))
    outs = []
    for layout, sync in ((layout_a, None), (layout_b, sync_b)):
        extra = {"sync": sync} if sync else {}
        outs.append(session.run(trainer.train, tuple(layout), steps, backend="gloo",
                           world_size=math.prod(layout), **kw, **extra))
    return first_difference(outs[0], outs[1], layout_b)


def parity_table(layouts, steps=4, dtype=torch.float32, **train_kw):
    """One row per layout against one process (``trainer.reference``): the
    step-0 loss's relative difference, the largest gradient difference at
    step 0 (``grad_differences``' measure), the curve's largest relative
    difference over ``steps`` steps. Runs the ranks from here (``ls.run``)."""
    ref = trainer.reference(steps, record_grads=(0,), dtype=dtype, **train_kw)
    rows = []
    for layout in layouts:
        outs = session.run(trainer.train, tuple(layout), steps, record_grads=(0,), dtype=dtype,
                      backend="gloo", world_size=math.prod(layout), **train_kw)
        rows.append(dict(layout=str(Layout(*layout)), **parity(outs, ref)))
    return rows


def resume_parity(saved_at=(2, 2, 2, 1), resume_at=(4, 1, 2, 1), steps=4, save_at=2,
                  root=None, **train_kw) -> dict:
    """From the notebook (ranks started by ``ls.run``): train ``steps`` steps at
    ``saved_at``, saving after ``save_at``; resume that checkpoint at ``resume_at``;
    {"uninterrupted", "resumed": the losses of steps save_at .. steps - 1,
    "max_rel": their largest relative difference, "equal": within LOSS_RTOL}.
    ``root``: where the checkpoints go (default: a temporary directory)."""
    def train(layout, **kw):
        return session.run(trainer.train, tuple(layout), steps, backend="gloo",
                           world_size=math.prod(layout), **train_kw, **kw)

    with tempfile.TemporaryDirectory() as tmp:
        root = root or tmp
        whole = train(saved_at, checkpoint_every=save_at, checkpoint_dir=root)
        resumed = train(resume_at, resume=checkpoint.path_for(root, save_at))
    want, got = whole[0]["losses"][save_at:], resumed[0]["losses"]
    rel = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    return dict(uninterrupted=want, resumed=got, max_rel=rel, equal=rel <= LOSS_RTOL)
