"""How fast the launcher starts, dispatches, recovers and communicates, beside bare baselines.

    python -m labsupport.bench launcher [--repeats 5] [--world-sizes 2 4]

Baselines are measured in the same run, interleaved with ours so that both see
the same machine load:
- start: a fresh process that imported torch calls ``ls.start`` (cold: it also
  starts the process server), vs ``torch.multiprocessing.spawn`` of the same
  ranks, each initialising gloo (what one-shot launchers pay on every call);
- no-op run on every rank vs a bare pipe round trip to the same number of
  processes (the floor of any dispatch);
- recovery: a failed call (one rank raises while the others wait in a
  collective) until the next successful call returns, vs a fresh spawn;
- a 4 MiB all_reduce through ``cluster.run`` vs the same all_reduce timed
  inside a bare spawned worker.
The last line is machine-readable.
"""
import argparse
import json
import statistics
import subprocess
import sys
import time

COLD_START = """
import json, time, torch
import labsupport as ls
t0 = time.perf_counter()
c = ls.start(world_size={ws}, backend="gloo")
cold = time.perf_counter() - t0
c.shutdown()
t0 = time.perf_counter()
c = ls.start(world_size={ws}, backend="gloo")
warm = time.perf_counter() - t0
print(json.dumps([cold, warm]))
"""
SPAWN_START = """
import json, time, torch
from labsupport.bench import _bare
t0 = time.perf_counter()
_bare.spawn_until_ready({ws})
print(json.dumps(time.perf_counter() - t0))
"""


def _python(code: str):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_start(ws, repeats):
    ours, warm, spawn = [], [], []
    for _ in range(repeats):
        cold_s, warm_s = _python(COLD_START.format(ws=ws))
        ours.append(cold_s)
        warm.append(warm_s)
        spawn.append(_python(SPAWN_START.format(ws=ws)))
    return statistics.median(ours), statistics.median(warm), statistics.median(spawn)


def measure_noop(cluster, calls=300):
    return _median_run_time(cluster, _noop, calls, warmup=20)


def _median_run_time(cluster, fn, calls, warmup):
    """Median seconds of ``cluster.run(fn)`` over ``calls`` calls, after ``warmup`` calls."""
    for _ in range(warmup):
        cluster.run(fn)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        cluster.run(fn)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_recover(cluster, repeats):
    """From the start of a call that fails (rank 1 raises while the others
    wait in a collective) to the end of the next successful call: detection,
    the error report, replacing the ranks and the next run, all included."""
    from labsupport.launch.errors import RankError
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        try:
            cluster.run(_fail_on_rank_1)
        except RankError:
            pass
        else:
            raise AssertionError("the failing benchmark call did not fail")
        cluster.run(_noop)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_allreduce(cluster, repeats=20):
    return _median_run_time(cluster, _allreduce_4mib, repeats, warmup=1)


def _noop():
    return None


def _fail_on_rank_1():
    import torch
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise RuntimeError("benchmark failure")
    dist.all_reduce(torch.ones(1))


_TENSOR = []  # per rank: the 4 MiB tensor, allocated once as in the bare worker


def _allreduce_4mib():
    import torch
    import torch.distributed as dist
    if not _TENSOR:
        _TENSOR.append(torch.ones(1 << 20))  # 4 MiB of float32
    dist.all_reduce(_TENSOR[0])


def bench_world_size(ws, repeats):
    from labsupport.bench import _bare
    from labsupport.launch import session
    start, warm_start, spawn = measure_start(ws, repeats)
    with session.start(world_size=ws, backend="gloo") as cluster:
        noop = measure_noop(cluster)
        pipe = _bare.pipe_round_trip(ws)
        recover = measure_recover(cluster, repeats)
        ours_ar = measure_allreduce(cluster)
    bare_ar = _bare.spawn_allreduce_median(ws)
    return dict(ws=ws, start=start, warm_start=warm_start, spawn=spawn, noop=noop, pipe=pipe,
                recover=recover, allreduce=ours_ar, bare_allreduce=bare_ar)


def report(rows):
    print(f"{'':24}" + "".join(f"{'world_size=' + str(r['ws']):>22}" for r in rows))
    lines = [
        ("start (cold server)", lambda r: f"{r['start']:.2f} s"),
        ("  start (warm server)", lambda r: f"{r['warm_start']:.3f} s"),
        ("  mp.spawn + gloo init", lambda r: f"{r['spawn']:.2f} s"),
        ("  ratio cold/spawn", lambda r: f"{r['start'] / r['spawn']:.2f}x"),
        ("no-op run", lambda r: f"{r['noop'] * 1e3:.2f} ms"),
        ("  bare pipe round trip", lambda r: f"{r['pipe'] * 1e3:.2f} ms"),
        ("failed call + next call", lambda r: f"{r['recover']:.3f} s"),
        ("  a fresh mp.spawn", lambda r: f"{r['spawn']:.2f} s"),
        ("4 MiB all_reduce via run", lambda r: f"{r['allreduce'] * 1e3:.2f} ms"),
        ("  inside a bare worker", lambda r: f"{r['bare_allreduce'] * 1e3:.2f} ms"),
        ("  ratio", lambda r: f"{r['allreduce'] / r['bare_allreduce']:.2f}x"),
    ]
    for name, fmt in lines:
        print(f"{name:24}" + "".join(f"{fmt(r):>22}" for r in rows))
    # The machine-readable line is at world size 4, else at the largest run,
    # and its field names say which world size that was.
    top = next((r for r in rows if r["ws"] == 4), max(rows, key=lambda r: r["ws"]))
    w = top["ws"]
    print(f"startup_ratio={top['start'] / top['spawn']:.3f} noop_ms_w{w}={top['noop'] * 1e3:.3f} "
          f"recover_s_w{w}={top['recover']:.3f} "
          f"allreduce_ratio={top['allreduce'] / top['bare_allreduce']:.3f}")


def main(argv):
    parser = argparse.ArgumentParser(prog="python -m labsupport.bench launcher")
    parser.add_argument("--repeats", type=int, default=5, help="runs per median (default 5)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args(argv)
    report([bench_world_size(ws, args.repeats) for ws in args.world_sizes])
