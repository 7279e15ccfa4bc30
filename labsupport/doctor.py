"""``python -m labsupport doctor``: can this node run the course's labs?

It reports the versions (Python, torch, NCCL), the GPUs this process sees and
``CUDA_VISIBLE_DEVICES``, the size of ``/dev/shm``, the cores per rank, then
starts ranks with ``ls.start`` and times an all-reduce (gloo; NCCL too when GPUs
are visible). Last, what the chapters do, from a fresh Jupyter kernel as they
run: under the default backend, an all-reduce of CPU tensors (the graders',
CPU models) and a batched isend/irecv pair round a ring on each rank's
device. It ends with a verdict that says what to fix for each problem.

Every measurement is a function passed to `diagnose`, so the tests fake the
failures (too little shared memory, more ranks than GPUs, a start that
blocks) without breaking the machine.
"""
import os
import platform
import shutil
import sys
import threading
import time
from dataclasses import dataclass

GIB = 1024 ** 3
# NCCL keeps its intra-node buffers in /dev/shm; Docker's default of 64 MiB
# makes it fail. NVIDIA's troubleshooting guide gives --shm-size=1g:
# https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/troubleshooting.html#docker
SHM_NEEDED = 1 * GIB
# The first start includes the process server's `import torch` (seen taking
# about 10 s on a cold GPU node); slower than this, the node is struggling.
SLOW_START_S = 30.0
SHM_FIX = ("give the container a larger /dev/shm: `docker run --shm-size=1g`, or on "
           "Kubernetes an emptyDir with medium: Memory mounted at /dev/shm "
           "(deploy/z2jh-values.yaml does this)")


@dataclass
class Check:
    name: str
    status: str        # "ok", "warn" or "fail"
    value: str         # what was found
    fix: str = ""      # what to do about it (warn and fail only)


def gpu_facts():
    """What torch sees: GPU names, CUDA build, NCCL version, CUDA_VISIBLE_DEVICES."""
    import torch
    facts = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "names": [],
             "nccl": None, "visible_env": os.environ.get("CUDA_VISIBLE_DEVICES")}
    try:
        if torch.cuda.is_available():
            facts["names"] = [torch.cuda.get_device_name(i)
                              for i in range(torch.cuda.device_count())]
            facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # a broken driver: report it, carry on with gloo
        facts["error"] = f"{type(e).__name__}: {e}"
    return facts


def shm_bytes(path="/dev/shm"):
    """Size of the shared-memory file system (None where there is none)."""
    try:
        return shutil.disk_usage(path).total
    except OSError:
        return None


def cores():
    """Cores this process may use (affinity, cgroup quota, $LABSUPPORT_CPUS)."""
    from labsupport.launch.limits import cpu_count
    return cpu_count()


def _allreduce():
    import torch
    import torch.distributed as dist

    from labsupport.launch.identity import device
    t = torch.ones(1024, device=device()) * (dist.get_rank() + 1)  # (1024,)
    dist.all_reduce(t)
    if t.is_cuda:
        torch.cuda.synchronize()
    return t[0].item()


def start_and_allreduce(world_size, backend, timeout):
    """Start ranks with ``ls.start``, all-reduce once; seconds taken and results."""
    from labsupport.launch.session import start
    t0 = time.perf_counter()
    with start(world_size=world_size, backend=backend, timeout=timeout) as cluster:
        started = time.perf_counter()
        results = cluster.run(_allreduce, timeout=timeout)
        done = time.perf_counter()
        used = cluster.backend
    return {"backend": used, "start_s": started - t0, "allreduce_s": done - started,
            "results": results}


def _with_deadline(fn, deadline):
    """fn() in a thread: its result, its exception, or TimeoutError after deadline."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # reported, never raised into the doctor
            box["error"] = e
    thread = threading.Thread(target=target, daemon=True, name="doctor-probe")
    thread.start()
    thread.join(deadline)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {deadline:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def check_ranks(world_size, backend, deadline, probe):
    """One Check: ranks start and an all-reduce gives the right sum, in time."""
    name = f"ranks + all-reduce ({backend}, {world_size} rank{'s' * (world_size != 1)})"
    try:
        got = _with_deadline(lambda: probe(world_size, backend, deadline), deadline)
    except TimeoutError as e:
        return Check(name, "fail", f"blocked: {e}", (
            "ranks did not start or the all-reduce hung: check that /tmp is writable, "
            "that `ulimit -u` allows more processes, that the node is not overloaded "
            "(uptime), and for NCCL that /dev/shm is large enough and the GPUs are "
            "not in exclusive mode held by another process (nvidia-smi)"))
    except Exception as e:
        return Check(name, "fail", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
                     "run the same ls.start in a notebook to see every rank's traceback")
    want = float(sum(range(1, world_size + 1)))
    value = (f"{got['backend']}: started in {got['start_s']:.1f} s, "
             f"all-reduce {1e3 * got['allreduce_s']:.1f} ms")
    if got["results"] != [want] * world_size:
        return Check(name, "fail", f"wrong sum {got['results']} (want {want})",
                     "the collectives are broken here: report it with this output")
    if got["start_s"] > SLOW_START_S:
        return Check(name, "warn", value, "the node is busy or its disk is slow: every "
                     "group start will feel this; fewer users per node helps")
    return Check(name, "ok", value)


def check_chapters(world_size, deadline, kernel):
    """One Check: from a kernel, CPU tensors and batched p2p work under the default backend."""
    name = f"kernel: CPU, batched p2p ({world_size} rank{'s' * (world_size != 1)})"
    try:
        got = _with_deadline(lambda: kernel(world_size, deadline), deadline)
    except Exception as e:
        text = f"{type(e).__name__}: {(str(e) or '-').splitlines()[0][:200]}"
        return Check(name, "fail", text, (
            "the chapters' collectives on CPU tensors or their batched sends and receives "
            "fail under the default backend: run the same from a notebook to see every "
            "rank's traceback (a plain 'nccl' process group has no CPU backend)"))
    want = [(float(sum(range(1, world_size + 1))), float((r - 1) % world_size))
            for r in range(world_size)]
    if [tuple(map(float, r)) for r in got] != want:
        return Check(name, "fail", f"wrong results {got} (want {want})",
                     "the collectives are broken here: report it with this output")
    return Check(name, "ok", "from a fresh kernel, as the chapters run")


def check_environment(ranks, facts, shm, ncores):
    """The Checks that need no rank: versions, GPUs, /dev/shm, cores."""
    gpus = len(facts["names"])
    visible = facts["visible_env"]
    checks = [Check("Python", "ok", platform.python_version()),
              Check("torch", "ok", f"{facts['torch']} (CUDA build: {facts['cuda_build']})")]
    where = f"CUDA_VISIBLE_DEVICES={'unset' if visible is None else repr(visible)}"
    names = ", ".join(facts["names"])
    if "error" in facts:
        checks.append(Check("GPUs", "fail", f"CUDA error: {facts['error']} ({where})",
                            "the driver does not work in this container: check nvidia-smi "
                            "and the node's GPU device plugin"))
    elif gpus == 0 and visible not in (None, ""):
        fix = ("this torch is a CPU build: install a CUDA wheel of torch"
               if facts["cuda_build"] is None else
               "CUDA sees none of these GPUs: check nvidia-smi and the ids in the variable")
        checks.append(Check("GPUs", "warn", f"0 visible ({where})", fix))
    else:
        checks.append(Check("GPUs", "ok", f"{gpus} visible{': ' + names if names else ''} "
                            f"({where}){'' if gpus else ' - the labs run on gloo, CPU'}"))
    if gpus and ranks > gpus:
        checks.append(Check("ranks per GPU", "warn", f"{ranks} ranks, {gpus} GPU(s) visible", (
            f"labsupport runs {ranks} ranks on gloo (CPU), one GPU per rank is needed for "
            f"NCCL: ask for {ranks} GPUs (COURSE_GPUS_PER_USER={ranks} on the course's hub, "
            f"a bigger profile on Kubernetes) or use world_size<={gpus}")))
    checks.append(Check("NCCL", "ok", facts["nccl"] or "not used (no GPU visible)"))
    checks.append(check_shm(shm, gpus))
    per_rank = ncores // ranks
    status = "ok" if per_rank >= 1 else "warn"
    checks.append(Check("cores per rank", status, f"{per_rank} ({ncores} cores, {ranks} ranks)",
                        "" if per_rank else "more ranks than cores: ranks take turns, so "
                        "timings mean little; ask for more cores or use fewer ranks"))
    return checks


def check_shm(size, gpus):
    if size is None:
        return Check("/dev/shm", "fail" if gpus else "warn", "missing", SHM_FIX)
    value = f"{size / GIB:.2f} GiB"
    if size >= SHM_NEEDED:
        return Check("/dev/shm", "ok", value)
    # gloo on the CPU does not need it; NCCL does (and fails at 64 MiB).
    return Check("/dev/shm", "fail" if gpus else "warn",
                 f"{value}: less than the {SHM_NEEDED // GIB} GiB NCCL needs", SHM_FIX)


def diagnose(ranks=2, deadline=60.0, *, facts=gpu_facts, shm=shm_bytes, ncores=cores,
             probe=start_and_allreduce, kernel=None):
    """Every Check, in report order. Each measurement can be replaced (tests)."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a positive int, got {ranks!r}")
    found = facts()
    checks = check_environment(ranks, found, shm(), ncores())
    checks.append(check_ranks(ranks, "gloo", deadline, probe))
    gpus = len(found["names"])
    if gpus and "error" not in found:
        checks.append(check_ranks(min(ranks, gpus), "nccl", deadline, probe))
    if kernel is None:
        from labsupport.doctor_kernel import kernel_probe as kernel
    checks.append(check_chapters(ranks, deadline, kernel))
    return checks


def report(checks, out=sys.stdout):
    """Print the checks and the verdict; True when nothing failed."""
    marks = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}
    print("labsupport doctor", file=out)
    for c in checks:
        print(f"  {marks[c.status]}  {c.name:<34} {c.value}", file=out)
    problems = [c for c in checks if c.status != "ok"]
    failed = any(c.status == "fail" for c in problems)
    if not problems:
        print("verdict: ready - the labs run here.", file=out)
    else:
        head = "NOT READY" if failed else "ready, with warnings"
        print(f"verdict: {head} ({len(problems)} to look at):", file=out)
        for c in problems:
            print(f"  - {c.name}: {c.fix}", file=out)
    return not failed


def main(argv=None):
    import argparse
    parser = argparse.ArgumentParser(prog="python -m labsupport doctor",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks to start (default 2)")
    parser.add_argument("--deadline", type=float, default=60.0,
                        help="seconds a start plus all-reduce may take (default 60)")
    args = parser.parse_args(argv)
    return 0 if report(diagnose(args.ranks, args.deadline)) else 1
