"""Chapter 11's trainer as a script, as picotron's ``train.py`` is: the same ``train``.

    torchrun --standalone --nproc-per-node 8 -m labsupport.capstone.run \\
        --dp 2 --tp 2 --pp 2 --cp 1 --steps 200 --checkpoint-every 50 \\
        --checkpoint-dir ckpt --log-file run.log
    # later, at any layout (here 4 ranks), from the newest checkpoint in ckpt/:
    torchrun --standalone --nproc-per-node 4 -m labsupport.capstone.run \\
        --dp 1 --tp 2 --pp 2 --cp 1 --steps 200 --checkpoint-dir ckpt --resume \\
        --log-file run.log

Every rank runs ``capstone.trainer.train`` on the layout (dp, tp, pp, cp),
the function the notebook runs with ``ls.run``: gloo on CPUs, NCCL with one
GPU per rank (``LOCAL_RANK``) where the node has a GPU for every local rank
(``labsupport.launch.torchrun.main``). Rank 0 prints a progress line per
``--log-every`` steps and appends it to ``--log-file``: the step, the global
batch's mean loss in nats and in bits per byte, the job's tokens/s over the
steps since the last line, MFU and the time left. picotron's ``train.py``
prints the same quantities (step, loss, tokens/s, tokens/s per GPU, MFU).

MFU (PaLM, Chowdhery et al. 2022, arXiv 2204.02311, appendix B) is the
model's FLOPs per second (``capstone.flops.per_token``: 6N + 12·L·h·s per
token) over a stated peak, per machine, never per rank: on CPUs this
machine's float32 matmul rate measured on all its cores
(``flops.measured_peak``), since the ranks share them, times the number of
machines; on GPUs one GPU's measured float32 matmul rate times the number of
GPUs. The log's first lines say which, with the command, the date, the
machine and the model.

Arguments that cannot work (a world size other than dp·tp·pp·cp, sizes that
do not divide, a checkpoint of another run) stop every rank with one message
before any process group is made, so no rank waits for another that left.
"""
import argparse
import datetime
import os
import platform
import shlex
import sys
import time

PROG = "python -m labsupport.capstone.run"


def parser():
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    a = p.add_argument
    for dim in ("dp", "tp", "pp", "cp"):
        a(f"--{dim}", type=int, default=1, help=f"{dim} degree (default 1)")
    a("--steps", type=int, default=20, help="steps in all, counted from step 0")
    a("--batch", type=int, default=8, help="sequences per global batch")
    a("--seq-len", type=int, default=32, help="bytes per sequence")
    a("--micro-batches", type=int, default=2, help="pipeline micro-batches per replica")
    a("--hidden", type=int, default=32)
    a("--layers", type=int, default=2)
    a("--heads", type=int, default=4)
    a("--lr", type=float, default=3e-3, help="AdamW's learning rate (constant)")
    a("--seed", type=int, default=0, help="the decoder's initial weights")
    a("--data-seed", type=int, default=0, help="the order of the training windows")
    a("--checkpoint-every", type=int, default=0, help="save every this many steps")
    a("--checkpoint-dir", help="where the checkpoints go (step<NNNNNN>/, DCP)")
    a("--resume", action="store_true",
      help="continue from the newest checkpoint in --checkpoint-dir (any layout)")
    # not --log: torchrun's parser reads every option of the command line, and
    # --log is an ambiguous prefix of its --log-dir and --logs-specs
    a("--log-file", help="append rank 0's lines to this file")
    a("--log-every", type=int, default=1, help="a progress line every this many steps")
    return p


def problems(args, world_size) -> list:
    """Everything wrong with these arguments on ``world_size`` ranks ([] if none)."""
    from labsupport.capstone import checkpoint, model
    from labsupport.capstone.layout import Layout

    out, layout = [], Layout(args.dp, args.tp, args.pp, args.cp)
    if min(layout) < 1:
        return [f"every degree must be >= 1, got dp, tp, pp, cp = {tuple(layout)}"]
    if world_size != layout.world_size:
        out.append(f"dp x tp x pp x cp = {args.dp} x {args.tp} x {args.pp} x {args.cp} "
                   f"needs {layout.world_size} ranks, and {world_size} were started: "
                   f"run torchrun --nproc-per-node {layout.world_size} (times nodes)")
    try:
        cfg = model_config(args)
        model.validate(cfg, layout, args.seq_len, True)
    except ValueError as err:
        out.append(str(err))
    if args.batch % args.dp:
        out.append(f"--batch {args.batch} does not split over dp={args.dp}")
    elif args.batch // args.dp % args.micro_batches:
        out.append(f"{args.batch // args.dp} sequences per replica do not split into "
                   f"--micro-batches {args.micro_batches}")
    if args.steps < 1 or args.log_every < 1 or args.checkpoint_every < 0:
        out.append("--steps and --log-every must be >= 1, --checkpoint-every >= 0")
    if (args.checkpoint_every or args.resume) and not args.checkpoint_dir:
        out.append("--checkpoint-every and --resume need --checkpoint-dir")
    path = checkpoint.latest(args.checkpoint_dir) if args.resume else None
    if path and not out:
        saved = checkpoint.read_meta(path)
        if saved["step"] >= args.steps:
            out.append(f"{path} is at step {saved['step']}: --steps {args.steps} "
                       "leaves nothing to train (steps count from step 0)")
        try:
            checkpoint.check_meta(saved, run_meta(args, layout, cfg), path)
        except ValueError as err:
            out.append(str(err))
    return out


def model_config(args):
    """The decoder of the command line, through the one home of its sizes."""
    from labsupport.capstone.model import run_config
    return run_config(args.seq_len, model_sizes(args))


def model_sizes(args) -> dict:
    """``--hidden``, ``--layers``, ``--heads``: ``model.run_config``'s sizes (and train's)."""
    return dict(hidden=args.hidden, layers=args.layers, heads=args.heads)


def run_meta(args, layout, cfg):
    import torch

    from labsupport.capstone import checkpoint
    loader = dict(step=0, seed=args.data_seed, batch=args.batch, seq_len=args.seq_len)
    return checkpoint.run_meta(cfg, layout, loader, "adamw", torch.float32)


def command_line(argv) -> str:
    """The command that started this job, as torchrun's workers can tell it."""
    nodes = int(os.environ.get("WORLD_SIZE", 1)) // int(os.environ.get(
        "LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    launch = ["torchrun"] + ([f"--nnodes {nodes}"] if nodes > 1 else []) + [
        f"--nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', '?')}"]
    return " ".join(launch + ["-m", "labsupport.capstone.run", shlex.join(argv)])


def job_peak(device):
    """(FLOP/s, what it is): the job's float32 peak, measured here (rank 0)."""
    import torch

    from labsupport import overlap
    from labsupport.capstone import flops
    from labsupport.launch.limits import cpu_count
    world = int(os.environ["WORLD_SIZE"])
    if device.type == "cuda":
        n = 4096
        one = overlap.matmul_flops(n, n, n, device=device)
        name = torch.cuda.get_device_name(device)
        return one * world, (f"measured float32 {n}^3 matmul on one {name}: "
                             f"{one / 1e12:.1f} TFLOP/s, x {world} GPUs")
    nodes = world // int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cores = cpu_count()
    one = flops.measured_peak(threads=cores)
    return one * nodes, (f"measured float32 1024^3 matmul on all {cores} cores of "
                         f"this machine: {one / 1e9:.1f} GFLOP/s, x {nodes} machine(s)")


def machine(device) -> str:
    import torch

    from labsupport.launch.limits import cpu_count
    if device.type == "cuda":
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(device)}"
    try:
        from labsupport.capstone.flops import cpu_theoretical_peak
        model = cpu_theoretical_peak()["model"]
    except (OSError, AttributeError):
        model = platform.processor() or platform.machine()
    return f"{model}, {cpu_count()} cores usable"


class Progress:
    """Rank 0's lines: to stdout and appended to the log file."""

    def __init__(self, args, per_token, peak):
        self.args, self.per_token, self.peak = args, per_token, peak
        self.tokens = args.batch * args.seq_len        # per step, the global batch
        self.t0 = self.last_t = time.perf_counter()    # reset when training starts
        self.last_step, self.timed_from = None, None

    def write(self, line):
        print(line, flush=True)
        if self.args.log_file:
            with open(self.args.log_file, "a") as f:
                f.write(line + "\n")

    def __call__(self, step, loss):
        import datetime as dt

        from labsupport.capstone import trainer
        now, args = time.perf_counter(), self.args
        if self.timed_from is None:               # the first step warms up: not timed
            self.timed_from, self.last_step = (step, now), step - 1
        saved = args.checkpoint_every and (step + 1) % args.checkpoint_every == 0
        if (step + 1) % args.log_every and step + 1 != args.steps and not saved:
            return
        rate = (step - self.last_step) * self.tokens / (now - self.last_t)
        k0, t0 = self.timed_from
        per_step = (now - t0) / (step - k0) if step > k0 else now - self.t0
        eta = dt.timedelta(seconds=round(per_step * (args.steps - step - 1)))
        mfu = 100 * rate * self.per_token / self.peak
        line = (f"step {step + 1:>{len(str(args.steps))}}/{args.steps} | "
                f"loss {loss:.6f} | {trainer.bits_per_byte(loss):.4f} bits/byte | "
                f"{rate:,.0f} tok/s | MFU {mfu:.2f}% | ETA {eta}")
        if saved:
            line += f" | saved {args.checkpoint_dir}/step{step + 1:06d}"
        self.write(line)
        self.last_step, self.last_t = step, now


def worker(args, argv, resume):
    """One rank: the peak (rank 0, the others waiting), then ``train``."""
    import torch
    import torch.distributed as dist

    from labsupport.capstone import flops, trainer
    from labsupport.launch import identity
    rank, device = dist.get_rank(), identity.device()
    cfg = model_config(args)
    per_token = flops.per_token(cfg, args.seq_len)
    progress = None
    dist.barrier()                   # the others wait while rank 0 measures the peak
    if rank == 0:
        peak, what = job_peak(device)
        from labsupport import models
        n = sum(p.numel() for p in models.GPT(cfg).parameters())
        progress = Progress(args, per_token, peak)
        now = datetime.datetime.now(datetime.UTC)
        progress.write(f"# {command_line(argv)}")
        progress.write(f"# {now:%Y-%m-%d %H:%M:%S} UTC | {machine(device)} | "
                       f"torch {torch.__version__}, {identity.backend_of()} | "
                       f"{os.environ.get('OMP_NUM_THREADS', '?')} thread(s) per rank")
        progress.write(f"# layout dp={args.dp} tp={args.tp} pp={args.pp} cp={args.cp} "
                       f"({dist.get_world_size()} ranks) | decoder L={cfg.layers} "
                       f"h={cfg.hidden} heads={cfg.heads} V={cfg.vocab_size}, {n:,} "
                       f"parameters | global batch {args.batch} x {args.seq_len} "
                       f"bytes, m={args.micro_batches} | AdamW lr={args.lr:g}")
        progress.write(f"# FLOPs per token 6N + 12·L·h·s = {per_token:,.0f} | peak: "
                       f"{what}")
        if resume:
            from labsupport.capstone import checkpoint
            saved = checkpoint.read_meta(resume)
            progress.write(f"# resuming from {resume}: step {saved['step']}, saved at "
                           f"dp, tp, pp, cp = {tuple(saved['layout'])}")
    dist.barrier()
    if progress is not None:
        progress.t0 = progress.last_t = time.perf_counter()
    out = trainer.train(
        (args.dp, args.tp, args.pp, args.cp), args.steps, batch=args.batch,
        seq_len=args.seq_len, micro_batches=args.micro_batches, lr=args.lr,
        seed=args.seed, data_seed=args.data_seed,
        model=model_sizes(args),
        checkpoint_every=args.checkpoint_every, checkpoint_dir=args.checkpoint_dir,
        resume=resume, on_step=progress, warmup=1)
    if progress is not None:
        seconds = time.perf_counter() - progress.t0
        progress.write(
            f"# done: steps {out['first_step'] + 1} to {args.steps} in "
            f"{seconds:.1f} s; "
            f"{out['tokens_per_s']:,.0f} tok/s after the first step (MFU "
            f"{100 * out['tokens_per_s'] * per_token / progress.peak:.2f}%); last loss "
            f"{out['losses'][-1]:.6f} ({trainer.bits_per_byte(out['losses'][-1]):.4f} "
            "bits/byte)")
    return out["losses"]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        parser().error("start it with torchrun, e.g. torchrun --standalone "
                       "--nproc-per-node 4 -m labsupport.capstone.run --dp 2 --pp 2")
    wrong = problems(args, int(os.environ["WORLD_SIZE"]))
    if wrong:                        # every rank stops here, before any group exists
        if os.environ["RANK"] == "0":
            print(f"{PROG}: error: " + "\n  ".join(wrong), file=sys.stderr, flush=True)
        sys.exit(2)
    from labsupport.capstone import checkpoint
    from labsupport.launch.lifetime import die_with_parent
    from labsupport.launch.torchrun import main as ls_main
    die_with_parent(os.getppid(), watchdog_period=0.5, pdeathsig=False)  # no orphans
    resume = checkpoint.latest(args.checkpoint_dir) if args.resume else None
    if args.resume and resume is None and os.environ["RANK"] == "0":
        print(f"no checkpoint in {args.checkpoint_dir}: starting at step 0", flush=True)
    ls_main(worker, args, argv, resume)


if __name__ == "__main__":
    main()
