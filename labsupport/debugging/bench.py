"""``python -m labsupport.bench debug``: is every fault of the zoo named, how fast, and what
DETAIL and the Flight Recorder cost on the capstone's step.

For every fault (``zoo.FAULTS``): run it on a fresh group with a short deadline, check
that its tool named it (``gather.named``: kind, rank, op and sequence number, or the
late rank, or the first diverging step), the seconds from the run's start to its report,
and that no rank process is left behind it (the process server's children are the
current group's ranks only). Then the capstone trainer's step time (tokens/s as
``train`` times itself) with DETAIL on, and with the Flight Recorder off
(``TORCH_FR_BUFFER_SIZE=0``), each against the default (recorder on, DETAIL off):
the three run alternately ``--repeats`` times (the machine's load drifts), medians;
and the recorder's cost per collective (``per_call``: all-reduces of one float).
Last line: ``debug_faults_named=<named>/<total> debug_worst_seconds_to_name=<s>
debug_detail_overhead=<ratio> debug_fr_overhead=<ratio>``.
"""
import argparse
import statistics

from labsupport.debugging import gather, zoo
from labsupport.launch import forkserver, session

MODES = {"default": {}, "detail": dict(TORCH_DISTRIBUTED_DEBUG="DETAIL"),
         "fr_off": dict(TORCH_FR_BUFFER_SIZE="0")}


def leftover_ranks() -> int:
    """Processes the process server has beyond the current group's ranks."""
    import psutil
    server = forkserver.current()
    if server is None:
        return 0
    cluster = session.current()
    mine = set(cluster.pids) if cluster is not None else set()
    children = psutil.Process(server.proc.pid).children(recursive=True)
    return len([p for p in children if p.pid not in mine and p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE])


def zoo_rows(timeout=4.0, names=None) -> list[dict]:
    """One row per fault: named, what was said, seconds to the report, ranks left over."""
    rows = []
    for name in names or zoo.FAULTS:
        fault = zoo.FAULTS[name]
        art, seconds, error = gather.run_fault(fault, timeout=timeout)
        said = gather.named(fault, art, error)
        rows.append(dict(fault=name, tool=fault.tool, named=said["named"], said=said["said"],
                         seconds=seconds, left=leftover_ranks()))
    session.shutdown()
    return rows


def _train(steps):
    from labsupport.capstone.trainer import train
    return train((2, 1, 1, 1), steps, batch=8, seq_len=32, micro_batches=2, warmup=1)


def overheads(repeats=3, steps=8) -> dict:
    """Median tokens/s of the capstone's step in each mode (alternated), and the ratios
    of step times: DETAIL over default, default (recorder on) over recorder off."""
    runs = {mode: [] for mode in MODES}
    for _ in range(repeats):
        for mode, env in MODES.items():
            with gather.environment(**dict({"TORCH_DISTRIBUTED_DEBUG": "OFF"}, **env)):
                cluster = session.start(world_size=2, backend="gloo")
            outs = cluster.run(_train, steps, timeout=300)
            runs[mode].append(outs[0]["tokens_per_s"])
    session.shutdown()
    med = {m: statistics.median(v) for m, v in runs.items()}
    return dict(tokens_per_s=med, runs=runs,
                detail=med["default"] / med["detail"], fr=med["fr_off"] / med["default"])


def _calls(n):
    import torch
    import torch.distributed as dist

    from labsupport import timing
    t = torch.ones(1)
    for _ in range(50):                     # warm
        dist.all_reduce(t)
    start = timing.now()
    for _ in range(n):
        dist.all_reduce(t)
    return (timing.now() - start) / n


def per_call(repeats=3, calls=500) -> dict:
    """Seconds per all-reduce of one float on 2 ranks with the Flight Recorder on (the
    default) and off, alternated ``repeats`` times, medians: the recorder's cost is per
    call (each entry keeps the caller's Python stack), so small steps of many
    collectives pay it most."""
    runs = {"on": [], "off": []}
    for _ in range(repeats):
        for mode, env in (("on", {}), ("off", dict(TORCH_FR_BUFFER_SIZE="0"))):
            with gather.environment(**dict({"TORCH_DISTRIBUTED_DEBUG": "OFF"}, **env)):
                cluster = session.start(world_size=2, backend="gloo")
            runs[mode].append(max(cluster.run(_calls, calls, timeout=300)))
    session.shutdown()
    return {mode: statistics.median(v) for mode, v in runs.items()}


def main(argv):
    parser = argparse.ArgumentParser(prog="python -m labsupport.bench debug")
    parser.add_argument("--timeout", type=float, default=4.0,
                        help="the deadline of each fault's run (s; default 4)")
    parser.add_argument("--repeats", type=int, default=5, help="alternated overhead runs")
    parser.add_argument("--steps", type=int, default=8, help="capstone steps per run")
    parser.add_argument("--faults", nargs="+", choices=sorted(zoo.FAULTS), default=None)
    args = parser.parse_args(argv)
    rows = zoo_rows(args.timeout, args.faults)
    for r in rows:
        print(f"{r['fault']:24s} {'named' if r['named'] else 'MISSED':6s} "
              f"{r['seconds']:5.1f} s  left={r['left']}  {r['tool']}: {r['said'][:90]}")
    cost = overheads(args.repeats, args.steps)
    for mode, tps in cost["tokens_per_s"].items():
        print(f"capstone (2,1,1,1) {mode:8s} {tps:9.0f} tokens/s (median of {args.repeats})")
    call = per_call(args.repeats)
    print(f"one all-reduce of 1 float, 2 ranks: {call['on'] * 1e6:.0f} us with the Flight "
          f"Recorder, {call['off'] * 1e6:.0f} us without (median of {args.repeats})")
    named = sum(r["named"] and not r["left"] for r in rows)
    print(f"debug_faults_named={named}/{len(rows)} "
          f"debug_worst_seconds_to_name={max(r['seconds'] for r in rows):.1f} "
          f"debug_detail_overhead={cost['detail']:.3f} debug_fr_overhead={cost['fr']:.3f}")
