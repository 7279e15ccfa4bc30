"""Chapter 10: sharded checkpoints, resharding, exact resume, async saving, a two-node restart.

    python -m labsupport.bench checkpoint [--world-size 4] [--hidden 63] [--layers 4]
                                          [--steps 8] [--saves 4]

On the chapter's resumable ZeRO-3 decoder (``labsupport.checkpoints.resumable``, fp32
AdamW, dropout): the bytes each rank writes to its shard file over the
formula 12Ψ/N (weights, m and v; the largest rank); whether the checkpoint
saved by N ranks loads at N/2 ranks bitwise (every flat tensor); whether a
run resumed from its mid-run checkpoint gives the uninterrupted run's
losses bitwise; the median stall of the training loop per save with
``dcp.save`` and with ``dcp.async_save`` on its own gloo group (FSDP2, the
slowest rank; timings of this machine under its load); and whether two
torchrun agents on loopback (``labsupport.checkpoints.elastic``), one worker killed
once, finish with the uninterrupted losses. The last line is
machine-readable: ``ckpt_bytes_measured_over_formula=<x>
ckpt_async_stall_over_sync=<y> reshard_4_to_2_bitwise=<0|1>
resume_losses_equal=<0|1> elastic_two_node_resume_equal=<0|1>``.
"""
import argparse
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time


def _held(recipe, root):
    """On each rank: the newest checkpoint under ``root`` loaded into a fresh model; the
    pieces this rank then holds."""
    from labsupport.checkpoints import resumable
    from labsupport.checkpoints.sharded_checkpoint import zero3_pieces
    model, optimizer, scheduler, loader, _ = resumable.setup(recipe)
    resumable.resume(root, model, optimizer, scheduler, loader,
                     resumable.restore_training_state)
    return {k: t.clone() for k, (t, _, _) in zero3_pieces(model, optimizer).items()}


def _train_and_hold(recipe, root, steps):
    from labsupport.checkpoints import resumable
    resumable.train(recipe, root, steps, steps, resumable.training_state,
                    resumable.restore_training_state)
    return _held(recipe, root)


def _bitwise(by_rank_a, by_rank_b) -> bool:
    import torch
    a, b = ({name: torch.cat([r[name] for r in runs]) for name in runs[0]}
            for runs in (by_rank_a, by_rank_b))
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def sharded(recipe, args, workdir) -> dict:
    """Bytes per rank over 12Ψ/N; N -> N/2 bitwise; a resume's losses."""
    from labsupport import models
    from labsupport.checkpoints import resumable
    from labsupport.launch import session
    n, half = args.world_size, args.steps // 2
    root = os.path.join(workdir, "ours")
    saved = session.run(_train_and_hold, recipe, root, half, world_size=n)
    path = os.path.join(root, f"step{half:06d}")
    files = [os.path.getsize(os.path.join(path, f"rank{r}.bin")) for r in range(n)]
    psi = sum(p.numel() for p in models.GPT(models.GPTConfig(
        recipe.vocab_size, recipe.seq_len, recipe.hidden, recipe.heads,
        recipe.layers)).parameters())
    loaded = session.run(_held, recipe, root, world_size=max(1, n // 2))
    run = dict(steps=args.steps, every=args.steps + 1, world_size=n)
    reference = session.run(resumable.train, recipe, os.path.join(workdir, "reference"),
                       capture=None, restore=None, **run)
    resumed = session.run(resumable.train, recipe, root, capture=resumable.training_state,
                     restore=resumable.restore_training_state, **run)
    equal = [[r["loss"] for r in ref[half:]] == [r["loss"] for r in res]
             for ref, res in zip(reference, resumed)]
    return dict(bytes_ratio=max(files) / (12 * psi / n), files=files, psi=psi,
                reshard=_bitwise(saved, loaded), resume=all(equal))


def _fsdp2(recipe):
    """The recipe's decoder under FSDP2 (each block, then the root), AdamW, its data."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from labsupport import models
    torch.manual_seed(recipe.seed + 1000 + dist.get_rank())
    model = models.GPT(models.GPTConfig(recipe.vocab_size, recipe.seq_len, recipe.hidden,
                                        recipe.heads, recipe.layers,
                                        dropout=recipe.dropout), seed=recipe.seed)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    ids, targets = (models.shard(t, dist.get_rank(), dist.get_world_size())
                    for t in models.toy_tokens(recipe.batch, recipe.seq_len,
                                               recipe.vocab_size, seed=recipe.seed + 1))
    return model, torch.optim.AdamW(model.parameters(), lr=recipe.lr), ids, targets


def _stalls(recipe, root, asynchronous, saves) -> list:
    """Seconds the training loop stood still for each save (this rank)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model, optimizer, ids, targets = _fsdp2(recipe)
    group, pending, stalls = dist.new_group(backend="gloo"), None, []
    for step in range(2 * saves):
        optimizer.zero_grad()
        model(ids, targets).backward()
        optimizer.step()
        if step % 2:
            t0 = time.perf_counter()
            if pending is not None:
                pending.result()
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state, path = {"model": model_sd, "optim": optim_sd}, f"{root}/step{step}"
            if asynchronous:
                pending = dcp.async_save(state, checkpoint_id=path, process_group=group)
            else:
                dcp.save(state, checkpoint_id=path, process_group=group)
            stalls.append(time.perf_counter() - t0)
    if pending is not None:
        pending.result()
    return stalls


def stall_ratio(recipe, args, workdir) -> tuple:
    """Median stall per save (slowest rank) of dcp.save and of dcp.async_save."""
    from labsupport.launch import session
    medians = []
    for mode in ("sync", "async"):
        by_rank = session.run(_stalls, recipe, os.path.join(workdir, mode), mode == "async",
                         args.saves, world_size=args.world_size)
        medians.append(statistics.median(map(max, zip(*by_rank))))
    return tuple(medians)


def two_nodes(recipe, args, workdir) -> tuple:
    """A two-node torchrun job, rank 1 killed once: (its final losses == the
    uninterrupted run's, seconds)."""
    from labsupport.checkpoints import elastic, resumable
    from labsupport.launch import session
    job = os.path.join(workdir, "two-nodes")
    out = os.path.join(job, "out")
    os.makedirs(out)
    program = ["-m", "labsupport.checkpoints.resumable", "--root", os.path.join(job, "ckpt"),
               "--out", out, "--steps", str(args.steps), "--every", "2",
               "--fail", "1", str(args.steps - 3),
               "--recipe", json.dumps(dataclasses.asdict(recipe))]
    run = elastic.run_two_nodes(program, job, max_restarts=1, timeout=args.timeout)
    with open(os.path.join(out, "rank0.jsonl")) as f:
        final = {r["step"]: r["loss"] for r in map(json.loads, f)}   # last attempt wins
    reference = session.run(resumable.train, recipe, os.path.join(workdir, "ref-2"),
                       args.steps, args.steps + 1, None, None, world_size=2)[0]
    return [final.get(s) for s in range(args.steps)] == [r["loss"] for r in reference], \
        run.seconds


def main(argv):
    parser = argparse.ArgumentParser(prog="python -m labsupport.bench checkpoint")
    parser.add_argument("--world-size", type=int, default=4, help="N that saves (default 4)")
    parser.add_argument("--hidden", type=int, default=63)
    parser.add_argument("--heads", type=int, default=7)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8, help="steps of each run (even, >= 4)")
    parser.add_argument("--saves", type=int, default=4, help="timed saves of each kind")
    parser.add_argument("--timeout", type=float, default=300, help="the two-node run's deadline")
    args = parser.parse_args(argv)
    if args.steps < 4 or args.steps % 2:
        parser.error("--steps must be even and at least 4 (resume at steps/2, fail after "
                     "steps-3)")
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} must be divisible by --heads {args.heads}")
    if args.world_size < 2 or 8 % args.world_size:
        parser.error("--world-size must divide the global batch of 8 and be at least 2")
    report(args)


def report(args):
    from labsupport.checkpoints.resumable import Recipe
    from labsupport.launch import session
    recipe = Recipe(hidden=args.hidden, heads=args.heads, layers=args.layers,
                    seq_len=args.seq_len)
    workdir = tempfile.mkdtemp(prefix="bench-ckpt-")
    try:
        ours = sharded(recipe, args, workdir)
        print(f"bytes per rank (N = {args.world_size}): {ours['files']}; 12Ψ/N = "
              f"{12 * ours['psi'] / args.world_size:,.0f}; largest / formula "
              f"{ours['bytes_ratio']:.5f}")
        print(f"reshard {args.world_size} -> {max(1, args.world_size // 2)} bitwise: "
              f"{ours['reshard']}; resumed losses == uninterrupted: {ours['resume']}")
        sync, asyn = stall_ratio(recipe, args, workdir)
        print(f"training stopped per save (median, slowest rank): dcp.save "
              f"{sync * 1e3:.1f} ms, dcp.async_save {asyn * 1e3:.1f} ms")
        elastic_ok, seconds = two_nodes(recipe, args, workdir)
        print(f"two torchrun agents, a worker killed once: restarted and finished with the "
              f"uninterrupted losses: {elastic_ok} ({seconds:.1f} s)")
    finally:
        session.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"ckpt_bytes_measured_over_formula={ours['bytes_ratio']:.5f} "
          f"ckpt_async_stall_over_sync={asyn / sync:.3f} "
          f"reshard_4_to_2_bitwise={int(ours['reshard'])} "
          f"resume_losses_equal={int(ours['resume'])} "
          f"elastic_two_node_resume_equal={int(elastic_ok)}")

