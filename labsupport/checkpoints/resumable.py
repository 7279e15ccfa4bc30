"""Chapter 10's resumable training: chapter 7's ZeRO-3 decoder with its whole training state.

    recipe = Recipe(hidden=63, layers=4)              # sizes, data, optimizer
    records = train(recipe, root, 8, 2, training_state, restore_training_state)
    # on every rank (ls.run or torchrun): 8 steps in all, a checkpoint every 2

``train`` resumes from the newest complete checkpoint under ``root`` (if
any), takes ``steps`` steps in all, and saves a sharded checkpoint
(``labsupport.checkpoints.sharded_checkpoint``) every ``every`` steps: the ZeRO-3
shards of the parameters and of AdamW's moments, plus each rank's
``training_state``: the step, the data position, the learning-rate
schedule and the RNG that draws the dropout masks. It returns one record per
step taken (the loss over all ranks, the learning rate, this rank's
samples, a fingerprint of its RNG), so that a resumed run can be compared
with an uninterrupted one step by step.

Under torchrun, with a failure injected once (``labsupport.checkpoints.elastic`` starts it
as two nodes on loopback)::

    torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=$HEAD:$PORT --max-restarts=1 -m labsupport.checkpoints.resumable \\
        --root /shared/ckpt --out /shared/out --steps 8 --every 2 --fail 1 5

The code between the lesson markers is the chapter's
(notebooks/10_checkpoints_and_failures.ipynb), kept identical by
tests/test_sharded_checkpoint.py.
"""
import argparse
import dataclasses
import hashlib
import json
import os
import signal

import torch
import torch.distributed as dist

from labsupport import models
from labsupport.checkpoints.sharded_checkpoint import (
    latest_checkpoint,
    load_resharded,
    read_extra,
    save_sharded,
    unit_layout,
    zero3_pieces,
    zero3_restore,
    zero3_wanted,
)
from labsupport.zero import zero


# --- lesson: notebooks/10_checkpoints_and_failures.ipynb (the notebook's copy must match) ---
@dataclasses.dataclass(frozen=True)
class Recipe:
    """One training run: the shared decoder's sizes, its data, AdamW."""
    vocab_size: int = 255
    seq_len: int = 32
    hidden: int = 63
    heads: int = 7
    layers: int = 4
    dropout: float = 0.1
    data_size: int = 64       # sequences in the data set
    batch: int = 8            # the global batch, over all ranks
    lr: float = 1e-2
    warmup: int = 4           # steps of linear learning-rate warm-up
    seed: int = 0


class ShuffledBatches:
    """Global batches of a data set reshuffled every epoch.

    Its whole state is ``position``: samples consumed so far, over all
    ranks. A count of samples, not of steps or of one rank's batches, so
    it means the same at any data-parallel degree.
    """

    def __init__(self, size, batch, seed):
        self.size, self.batch, self.seed, self.position = size, batch, seed, 0

    def next(self):
        """The next global batch: sample indices (B,), the same on all ranks."""
        per_epoch = self.size // self.batch * self.batch
        epoch, offset = divmod(self.position, per_epoch)
        order = torch.randperm(self.size, generator=torch.Generator(
        ).manual_seed(self.seed + epoch))
        self.position += self.batch
        return order[offset:offset + self.batch]


def setup(recipe):
    """ZeRO-3 decoder, AdamW, warm-up schedule, data order, data."""
    torch.manual_seed(recipe.seed + 1000 + dist.get_rank())   # dropout
    cfg = models.GPTConfig(recipe.vocab_size, recipe.seq_len, recipe.hidden,
                           recipe.heads, recipe.layers, dropout=recipe.dropout)
    gpt = models.GPT(cfg, seed=recipe.seed)
    model = zero.Zero3(gpt, units=gpt.blocks)
    optimizer = torch.optim.AdamW(model.shards.parameters(), lr=recipe.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / recipe.warmup))
    loader = ShuffledBatches(recipe.data_size, recipe.batch, recipe.seed)
    data = models.toy_tokens(recipe.data_size, recipe.seq_len,
                             recipe.vocab_size, seed=recipe.seed + 1)
    return model, optimizer, scheduler, loader, data


def train_step(model, optimizer, scheduler, loader, data):
    """One step on this rank's 1/N of the next global batch; its record."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    samples = models.shard(loader.next(), rank, world_size)       # (B/N,)
    record = dict(lr=optimizer.param_groups[0]["lr"],
                  samples=samples.tolist(), rng=fingerprint())
    optimizer.zero_grad()
    loss = model(data[0][samples], data[1][samples])
    loss.backward()
    if isinstance(model, zero.Zero3):
        model.sync_gradients()              # FSDP2 does it inside backward
    optimizer.step()
    scheduler.step()
    loss = loss.detach()
    dist.all_reduce(loss)                  # the global batch's mean loss
    return dict(record, loss=loss.item() / world_size)


def fingerprint():
    """A short digest of this process's RNG state (its dropout stream)."""
    state = torch.get_rng_state().numpy().tobytes()
    return hashlib.sha1(state).hexdigest()[:8]


def resume(root, model, optimizer, scheduler, loader, restore):
    """Load the newest complete checkpoint under ``root``; the next step."""
    path = latest_checkpoint(root)
    if path is None:
        return 0
    tensors, _ = load_resharded(path, zero3_wanted(model))
    extras, rank = read_extra(path), dist.get_rank()
    if len(extras) == dist.get_world_size():
        state = extras[rank]
    else:         # another N: the global state carries over, not RNG streams
        state = dict(extras[0], rng=torch.get_rng_state())
    step = restore(state, loader, scheduler)
    zero3_restore(model, optimizer, tensors, step)
    return step


def train(recipe, root, steps, every, capture, restore, log=None):
    """Resume from ``root`` if it holds a checkpoint, train up to ``steps``,
    save every ``every`` steps; one record per step taken."""
    model, optimizer, scheduler, loader, data = setup(recipe)
    start = resume(root, model, optimizer, scheduler, loader, restore)
    records = []
    for step in range(start, steps):
        records.append(dict(step=step, resumed_from=start, **train_step(
            model, optimizer, scheduler, loader, data)))
        if log is not None:
            log(records[-1])            # e.g. to a file, or a failure
        if (step + 1) % every == 0:
            save_sharded(os.path.join(root, f"step{step + 1:06d}"),
                         zero3_pieces(model, optimizer),
                         capture(step + 1, loader, scheduler),
                         layout=unit_layout(model))
    return records


def training_state(step, loader, scheduler):
    """What resuming at ``step`` needs besides the model and optimizer."""
    return dict(step=step, position=loader.position,
                scheduler=scheduler.state_dict(), rng=torch.get_rng_state())


def restore_training_state(state, loader, scheduler):
    """Put a saved ``training_state`` back; the step to continue from."""
    loader.position = state["position"]
    scheduler.load_state_dict(state["scheduler"])
    for group, lr in zip(scheduler.optimizer.param_groups,
                         scheduler.get_last_lr()):
        group["lr"] = lr                 # the schedule's, not the initial
    torch.set_rng_state(state["rng"])
    return state["step"]
# --- end of lesson ---


def _worker(recipe, root, out, steps, every, fail):
    """One torchrun worker: train, logging each step to ``out``/rank<r>.jsonl;
    ``fail`` = (rank, step): that rank is SIGKILLed after that step, once."""
    rank, marker = dist.get_rank(), os.path.join(out, "failed-once")

    def log(record):
        with open(os.path.join(out, f"rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps(dict(record, pid=os.getpid())) + "\n")
        if fail is not None and (rank, record["step"]) == tuple(fail) \
                and not os.path.exists(marker):
            open(marker, "w").close()    # once per job, whichever attempt
            os.kill(os.getpid(), signal.SIGKILL)     # a lost GPU, not an error

    train(recipe, root, steps, every, training_state, restore_training_state, log=log)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m labsupport.checkpoints.resumable",
                                     description="Chapter 10's resumable training, "
                                                 "under torchrun.")
    parser.add_argument("--root", required=True, help="checkpoint directory (shared by all nodes)")
    parser.add_argument("--out", required=True, help="directory for each worker's records")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2, help="save every this many steps")
    parser.add_argument("--fail", type=int, nargs=2, metavar=("RANK", "STEP"),
                        help="SIGKILL this rank after this step, once per job")
    parser.add_argument("--recipe", default="{}", help="Recipe fields as JSON")
    args = parser.parse_args(argv)
    from labsupport.launch.lifetime import die_with_parent
    from labsupport.launch.torchrun import main as ls_main
    die_with_parent(os.getppid(), watchdog_period=0.5, pdeathsig=False)  # no orphans
    recipe = Recipe(**json.loads(args.recipe))
    ls_main(_worker, recipe, args.root, args.out, args.steps, args.every, args.fail,
            backend="gloo")


if __name__ == "__main__":
    main()
