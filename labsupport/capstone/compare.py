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
  partial gradient left unsummed, as LayerNorm's under sequence parallelism);
- their mean over G is the reference: G is left out of the average (each rank
  kept its own tokens' gradient: cp ranks left out of the dp all-reduce, or no
  dp all-reduce at all);
- each is the sum of the reference's tp shards: a tp-sharded gradient
  all-reduced over tp, as if it were replicated.

Each explanation names its group; groups of one size are told apart by the
sum and mean tests, which look at the ranks of each group, not at a factor.

When a step's loss and gradients agree, its updates (each parameter's change
in the optimizer's step) are compared too: gradients equal and an update k
times the reference is a parameter the optimizer steps k times (its
parameter list holds it k times).
"""
import dataclasses
import math
import tempfile
import warnings

import torch

from labsupport.capstone import checkpoint, trainer
from labsupport.capstone.layout import Layout, layout_groups
from labsupport.capstone.trainer import all_reduce_buckets
from labsupport.launch import session
from labsupport.tensor_parallel.gpt import allreduce_sequence_parallel_grads

LOSS_RTOL = 1e-5      # fp32: another order of the same sums
GRAD_RTOL = 1e-4      # of the parameter's largest reference entry, or of FLOOR x the
FLOOR = 1e-3          # model's: a gradient that is zero in exact arithmetic (the key
                      # biases': softmax ignores a constant added to a row) is noise
UPDATE_RTOL = 1e-4    # of the parameter's largest reference update (entries whose
                      # reference gradient passes the floor: Adam divides a gradient
                      # by its own size, so a noise gradient moves by ~lr either way)


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


def full_updates(outs, step):
    """{name: whole update} (the parameters' change) at ``step``."""
    return assemble(outs, lambda out: out["updates"][step])


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


def update_differences(outs, ref_updates, ref_grads, step):
    """{name: (largest |difference| over ranks / the parameter's largest
    reference update, ranks where it passes UPDATE_RTOL)} of every rank's
    update at ``step``, over the entries whose reference gradient passes
    FLOOR x the model's largest (the others' updates are noise under Adam)."""
    out = {}
    floor = FLOOR * max(g.abs().max().item() for g in ref_grads.values())
    for o in outs:
        for name, u in o["updates"][step].items():
            keep = local_slice(ref_grads[name], o["shards"][name]).abs() > floor
            if not keep.any():
                continue
            want = local_slice(ref_updates[name], o["shards"][name]).to(u)
            scale = want[keep].abs().max().item() or 1.0
            diff = (u - want)[keep].abs().max().item() / scale
            worst, ranks = out.get(name, (0.0, []))
            out[name] = (max(worst, diff), ranks + [o["rank"]] * (diff > UPDATE_RTOL))
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
    what: str = "gradient"        # or "update": gradients equal, the step differs

    @property
    def equal(self):
        return self.step is None

    def __str__(self):
        a, b = (str(Layout(*x)) for x in self.layouts)
        if self.equal:
            return f"{b} = {a}: every step's loss and gradients within tolerance"
        loss = (f"loss within {LOSS_RTOL:.0e}" if self.loss_rel <= LOSS_RTOL
                else f"loss relative difference {self.loss_rel:.1e}")
        lines = [f"{b} vs {a}: first difference at step {self.step} ({loss})"]
        if self.parameter:
            factor = (f"x{self.factor:.3g} the reference's" if not math.isnan(self.factor)
                      else "nonzero where the reference's is zero")
            lines.append(f"  first parameter: {self.parameter}, on ranks {self.ranks}, "
                         f"its {self.what} {factor}")
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
        alike = (" (groups of the same size: run a layout where they differ to tell "
                 "them apart)" if " or " in names else "")
        if all(close(local[r], want[r] * size) for r in bad):
            return bad, factor, (f"x{size} = |{names}|: a reduction over {names} "
                                 f"doubled, or an average over {names} that does not "
                                 f"divide by "
                                 f"{size}{alike}")
        if all(close(local[r], want[r] / size) for r in bad):
            return bad, factor, (f"/{size} = |{names}|: divided by the size of {names} "
                                 f"once too often{alike}")
    def every_group(n, holds):
        """``holds(held)`` for every group of name n with a bad rank (``held``:
        its ranks that hold the parameter)."""
        for g in groups[n]:
            held = [r for r in g if r in local]
            if held and any(r in bad for r in held) and not holds(held):
                return False
        return True

    for n in sizes:
        if every_group(n, lambda held: all(close(sum(local[q] for q in held), want[r])
                                           for r in held)):
            return bad, factor, (f"the sum over the {n} group is the reference: the "
                                 f"all-reduce over {n} is missing (partial gradients)")
    for n in sizes:
        if every_group(n, lambda held: all(
                close(sum(local[q] for q in held) / len(held), want[r]) for r in held)):
            return bad, factor, (f"the mean over the {n} group is the reference: the "
                                 f"average over {n} is missing ({n} left out of the "
                                 f"gradient all-reduce: each rank kept the gradient of its "
                                 f"own {TOKENS.get(n, 'part')})")
    sharded = all(by_rank[r]["shards"][name] is not None for r in bad)
    if "tp" in sizes and sharded and every_group("tp", lambda held: all(
            close(local[r], sum(want[q] for q in held)) for r in held)):
        return bad, factor, ("the sum of the reference's tp shards: a tp-sharded "
                             "gradient all-reduced over tp (each tp rank holds a "
                             "different shard; only replicated, partial gradients are "
                             "summed over tp)")
    return bad, factor, None


TOKENS = {"dp": "rows", "cp": "positions", "dp_cp": "rows and positions"}


def diagnose_update(outs, ref_updates, ref_grads, step, name):
    """(ranks, factor, explanation) for an update that differs while the
    gradients agree: k times the reference's is a parameter stepped k times."""
    bad = update_differences(outs, ref_updates, ref_grads, step)[name][1]
    floor = FLOOR * max(g.abs().max().item() for g in ref_grads.values())
    got, exp = [], []
    for o in outs:
        if o["rank"] in bad:
            shard = o["shards"][name]
            keep = local_slice(ref_grads[name], shard).abs() > floor
            got.append(o["updates"][step][name][keep])
            exp.append(local_slice(ref_updates[name], shard).to(got[-1])[keep])
    got, exp = torch.cat(got), torch.cat(exp)
    factor = (got @ exp / (exp @ exp)).item()
    times = round(factor)
    if times >= 2 and (got - times * exp).abs().max() <= UPDATE_RTOL * 10 * (
            times * exp).abs().max():
        words = {2: "twice", 3: "three times"}.get(times, f"{times} times")
        return bad, factor, (f"updated {words} (x{times} the one-process update) "
                             f"with gradients equal: the optimizer steps {name} "
                             f"{words}; its parameter list holds it {words}")
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
            if "updates" not in outs_a[0] or k not in outs_a[0]["updates"]:
                continue
            moved = update_differences(outs_b, full_updates(outs_a, k), whole, k)
            wrong = [n for n, (d, ranks) in moved.items() if ranks]
            if not wrong:
                continue
            name = min(wrong, key=list(whole).index)
            report.step, report.loss_rel, report.parameter = k, rel, name
            report.what = "update"
            report.ranks, report.factor, report.reduction = diagnose_update(
                outs_b, full_updates(outs_a, k), whole, k, name)
            return report
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


def sync_dp_not_cp_ranks(stage, groups, layout):
    """Broken on purpose: the gradients averaged over the dp group alone, as in a
    data-parallel trainer that cp was added to: the cp ranks, which saw other
    positions of the same rows, are left out of the all-reduce."""
    allreduce_sequence_parallel_grads(stage)
    all_reduce_buckets(stage, groups["dp"], divide_by=layout.dp)


def sync_without_dp(stage, groups, layout):
    """Broken on purpose: no all-reduce over dp at all; the gradients are averaged
    over the cp ranks only (each dp replica keeps its own rows' gradient)."""
    allreduce_sequence_parallel_grads(stage)
    all_reduce_buckets(stage, groups["cp"], divide_by=layout.cp)


def sync_every_grad_over_tp(stage, groups, layout):
    """Broken on purpose: every gradient summed over tp, as if tp were another
    dp: right for the partial gradients of sequence parallelism, wrong for a
    tp-sharded weight, whose ranks hold different shards."""
    all_reduce_buckets(stage, groups["tp"], divide_by=1)
    all_reduce_buckets(stage, groups["dp_cp"], divide_by=layout.dp * layout.cp)


def adamw_one_weight_twice(params, lr=3e-3):
    """Broken on purpose: the trainer's AdamW (its default lr) over a
    parameter list that holds the stage's first weight twice, as a list
    collected module by module holds a weight that two modules share.
    ``torch.optim`` only warns ("optimizer contains a parameter group with
    duplicate parameters", torch/optim/optimizer.py) and steps it twice."""
    params = list(params)
    with warnings.catch_warnings():   # the warning is the bug's only sign
        warnings.simplefilter("ignore", UserWarning)
        return torch.optim.AdamW(params + params[:1], lr=lr, weight_decay=0.0)


# The broken variants, by name: the train() keywords that make each.
BROKEN = {"LayerNorm grads not reduced over tp under SP":
          dict(sync=sync_without_sp_reduce),
          "loss averaged over dp but not cp": dict(sync=sync_dp_not_cp),
          "a weight updated twice": dict(optimizer=adamw_one_weight_twice),
          "cp ranks left out of the gradient average": dict(sync=sync_dp_not_cp_ranks),
          "no dp all-reduce at all": dict(sync=sync_without_dp),
          "a tp-sharded gradient all-reduced over tp": dict(sync=sync_every_grad_over_tp)}


def compare(layout_a, layout_b, steps=3, sync_b=None, optimizer_b=None, **train_kw):
    """Train on both layouts (from the notebook: ranks started by ``ls.run``)
    and report the first step, parameter, ranks and factor where they differ.
    ``sync_b``, ``optimizer_b``: another gradient synchronisation or optimizer
    for ``layout_b`` (a broken one, ``BROKEN``)."""
    kw = dict(train_kw, record_grads=tuple(range(steps)))
    outs = []
    for layout, extra in ((layout_a, {}), (layout_b, dict(sync=sync_b,
                                                          optimizer=optimizer_b))):
        extra = {k: v for k, v in extra.items() if v is not None}
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
