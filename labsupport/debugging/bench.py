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
    """The capstone's training on (2, 1, 1, 1): tokens/s (wall, as ``train`` times itself)
    and the CPU seconds of this rank's main thread per step after the first (read at
    each ``on_step``: waiting costs none, so it holds on a loaded machine)."""
    import time

    from labsupport.capstone.trainer import train
    marks = []
    out = train((2, 1, 1, 1), steps, batch=8, seq_len=32, micro_batches=2, warmup=1,
                on_step=lambda step, loss: marks.append(time.thread_time()))
    return dict(tokens_per_s=out["tokens_per_s"],
                cpu_per_step=(marks[-1] - marks[0]) / (len(marks) - 1))


def overheads(repeats=3, steps=8) -> dict:
    """The capstone's step in each of ``MODES``, alternated ``repeats`` times, medians:
    tokens/s and CPU s per step; ``detail`` and ``fr``, the ratios of wall step times
    (DETAIL over default; default, recorder on, over recorder off), ``detail_cpu`` and
    ``fr_cpu`` the same ratios of CPU time per step."""
    runs = {mode: [] for mode in MODES}
    for _ in range(repeats):
        for mode, env in MODES.items():
            with gather.environment(**dict({"TORCH_DISTRIBUTED_DEBUG": "OFF"}, **env)):
                cluster = session.start(world_size=2, backend="gloo")
            outs = cluster.run(_train, steps, timeout=300)
            runs[mode].append((outs[0]["tokens_per_s"],
                               max(o["cpu_per_step"] for o in outs)))
    session.shutdown()
    tps = {m: statistics.median(t for t, _ in v) for m, v in runs.items()}
    cpu = {m: statistics.median(c for _, c in v) for m, v in runs.items()}
    return dict(tokens_per_s=tps, cpu_per_step=cpu, runs=runs,
                detail=tps["default"] / tps["detail"], fr=tps["fr_off"] / tps["default"],
                detail_cpu=cpu["detail"] / cpu["default"], fr_cpu=cpu["default"] / cpu["fr_off"])


def _calls(n):
    """(wall seconds, CPU seconds of this thread) per all-reduce of one float."""
    import time

    import torch
    import torch.distributed as dist
    t = torch.ones(1)
    for _ in range(50):                     # warm
        dist.all_reduce(t)
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(n):
        dist.all_reduce(t)
    return (time.perf_counter() - wall) / n, (time.thread_time() - cpu) / n


def per_call(repeats=3, calls=500) -> dict:
    """{mode: (wall s, CPU s of the calling thread)} per all-reduce of one float on 2
    ranks, for each of ``MODES``, alternated ``repeats`` times, medians (the slower rank's).
    The calling thread's CPU time is what the recorder and DETAIL add to each call
    (a wait uses none), so it reads the same on a loaded machine, where wall time does
    not."""
    runs = {mode: [] for mode in MODES}
    for _ in range(repeats):
        for mode, env in MODES.items():
            with gather.environment(**dict({"TORCH_DISTRIBUTED_DEBUG": "OFF"}, **env)):
                cluster = session.start(world_size=2, backend="gloo")
            runs[mode].append(max(cluster.run(_calls, calls, timeout=300)))
    session.shutdown()
    return {mode: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
            for mode, v in runs.items()}


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
        print(f"capstone (2,1,1,1) {mode:8s} {tps:9.0f} tokens/s, "
              f"{cost['cpu_per_step'][mode] * 1e3:6.2f} ms CPU per step "
              f"(median of {args.repeats})")
    print(f"CPU per step: DETAIL x{cost['detail_cpu']:.3f}, Flight Recorder x{cost['fr_cpu']:.3f}")
    call = per_call(args.repeats)
    for mode, (wall, cpu) in call.items():
        print(f"one all-reduce of 1 float, 2 ranks, {mode:8s}: {wall * 1e6:6.0f} us wall, "
              f"{cpu * 1e6:6.0f} us CPU of the calling thread (median of {args.repeats})")
    named = sum(r["named"] and not r["left"] for r in rows)
    print(f"debug_faults_named={named}/{len(rows)} "
          f"debug_worst_seconds_to_name={max(r['seconds'] for r in rows):.1f} "
          f"debug_detail_overhead={cost['detail']:.3f} debug_fr_overhead={cost['fr']:.3f}")
