# Run: .venv/bin/python -m pytest tests/test_gpu_path.py   (~45 s on 2 idle cores)
"""The GPU path, checked on a CPU (issue 25): what ranks on GPUs get, reproduced with gloo.

- The backend rule: GPU ranks get "cpu:gloo,cuda:nccl" (CPU tensors through
  gloo), $LABSUPPORT_BACKEND says what "auto" means, and the device-placement
  check: that group reproduced on a CPU ("cpu:gloo,cuda:gloo") runs the
  lessons' CPU-tensor collectives, a CUDA-only group ("cuda:gloo", what a
  plain "nccl" group is for CPU tensors) fails them; the graders pin gloo.
- torchrun (ls.main) makes the same group, device_id included.
- A rank waits for its GPU work inside the run's deadline (after an error
  too, keeping the error), and results come back with every tensor on the
  CPU, wherever it sits and whatever its class.
- Timings go through labsupport.timing (a GPU's work, not the host's queueing):
  ddp_probe, chapter 5's harness (zero-bubble's is its subclass), the
  time-beside-bytes sweeps (collectives timed by timing.CallClock); no measuring
  module reads time.perf_counter itself but where listed, with the reason;
  chapters 0, 4 and 6 call it in their cells.
- Threads per rank follow the container's CPU quota and $LABSUPPORT_CPUS.
- NCCL's environment in every rank and in the process server.
- make test-gpu skips in one line here; its sanitizer masks GPU-only outputs.
"""
import dataclasses
import os
import pickle
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import labsupport as ls
from grading_rings import ring_all_reduce
from labsupport import models, timing
from labsupport.data_parallel import ddp
from labsupport.data_parallel import probe as ddp_probe
from labsupport.launch import cluster as cluster_module
from labsupport.launch import forkserver, limits, placement, rank_main, session, torchrun
from labsupport.pipeline import pipeline

ROOT = Path(__file__).resolve().parent.parent


# -- the backend rule and the device-placement check ---------------------------------

def test_gpu_ranks_get_a_cpu_backend_too_and_the_environment_says_what_auto_means(
        monkeypatch):
    monkeypatch.setattr(placement, "visible_gpus", lambda: 2)
    monkeypatch.setenv(placement.ENV, "auto")
    on_gpus = placement.place(2)
    assert (on_gpus.backend, on_gpus.devices) == ("cpu:gloo,cuda:nccl", ("cuda:0", "cuda:1"))
    monkeypatch.setenv(placement.ENV, "gloo")  # CI on a GPU node: the CPU suite on gloo
    assert placement.place(2).backend == "gloo"
    assert placement.place(2, backend="nccl").backend == "cpu:gloo,cuda:nccl"  # explicit wins
    monkeypatch.setenv(placement.ENV, "NCCL")
    assert placement.place(2).devices == ("cuda:0", "cuda:1")
    monkeypatch.setenv(placement.ENV, "gpu")
    with pytest.raises(ValueError, match="LABSUPPORT_BACKEND='gpu': use auto, gloo or nccl"):
        placement.place(2)


def lesson_collectives():
    """What the lessons and checks hand to collectives on CPU tensors: a grader's
    ring, a CPU model wrapped for data parallelism, a DeviceMesh on the CPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    t = torch.arange(8.0)
    ring_all_reduce(t)  # batched p2p of CPU tensors
    model = ddp.DataParallelNaive(models.DeepMLP(d_in=4, width=8, depth=2, d_out=2, seed=0))
    model(torch.ones(2, 4)).sum().backward()
    model.sync_gradients()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)]).redistribute(
        mesh, [Replicate()]).to_local()
    return t.tolist(), full.tolist()


def gpu_group_on_the_cpu(rule_backend):
    """A group made as for 2 GPU ranks, gloo standing in for NCCL (no GPU here):
    plain "nccl" serves CUDA tensors only, so it becomes "cuda:gloo"."""
    backend = "cuda:gloo" if rule_backend == "nccl" else rule_backend.replace("nccl", "gloo")
    where = placement.Placement(2, backend, ("cpu", "cpu"), 1, None)
    return cluster_module.Cluster(where)


def test_the_gpu_group_runs_the_lessons_cpu_collectives_where_nccl_alone_fails(monkeypatch):
    monkeypatch.setattr(placement, "visible_gpus", lambda: 2)
    monkeypatch.setenv(placement.ENV, "auto")
    rule = placement.place(2).backend  # what 2 GPU ranks get
    with gpu_group_on_the_cpu(rule) as group:
        assert group.run(lesson_collectives) == [([0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0],
                                                   [0.0, 1.0, 2.0, 3.0])] * 2
        assert group.run(ls.backend_of, "cpu") == ["gloo"] * 2
    with gpu_group_on_the_cpu("nccl") as group:  # a CUDA-only group
        with pytest.raises(ls.RankError, match="No backend type associated with device type cpu"):
            group.run(lesson_collectives)
        assert group.run(ls.backend_of, "cpu") == [None, None]


def test_the_graders_pin_gloo_whatever_group_the_chapter_runs(monkeypatch):
    monkeypatch.setattr(placement, "visible_gpus", lambda: 2)
    monkeypatch.setenv(placement.ENV, "auto")
    chapter = gpu_group_on_the_cpu("nccl")  # CUDA tensors only, like NCCL
    chapter.backend = placement.place(2).backend  # ... and what 2 GPUs would run
    monkeypatch.setattr(session, "_current", chapter)
    ls.grading.check_allreduce(ring_all_reduce, world_sizes=(2,), sizes=(8,))
    assert session.current().backend == "gloo"  # the chapter's group was replaced
    ls.shutdown()


def groups_the_graders_make():
    """(file:line, backend) of every group a grader asks the launcher for
    (``group_for``, ``session.start``, ``session.run``) in labsupport/grading and the
    checking core it runs on (labsupport/checking)."""
    import ast
    found = []
    for path in sorted([*(ROOT / "labsupport" / "grading").glob("*.py"),
                        *(ROOT / "labsupport" / "checking").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                    node.func.attr == "group_for" or (
                        node.func.attr in ("start", "run") and
                        getattr(node.func.value, "id", None) in ("session", "ls"))):
                backend = next((k.value.value for k in node.keywords if k.arg == "backend"
                                and isinstance(k.value, ast.Constant)), None)
                found.append((f"{path.name}:{node.lineno}", backend))
    return found


def test_every_group_a_grader_makes_is_pinned_to_gloo():
    made = groups_the_graders_make()
    assert any(where.startswith("diagnosis.py") for where, _ in made)  # the scan sees them
    assert [where for where, backend in made if backend != "gloo"] == []


def backend_string_tests():
    """Code lines of the chapters and assignment sources that read the backend
    string (``dist.get_backend()``, a group's ``backend``) or compare with "gloo"
    or "nccl" anything but ``ls.backend_of``'s answer."""
    import nbformat
    found = []
    compares = re.compile(r"""[!=]=\s*["'](gloo|nccl)["']|["'](gloo|nccl)["']\s*[!=]=""")
    for path in sorted((ROOT / "notebooks").rglob("*.ipynb")):
        if ".ipynb_checkpoints" in path.parts:
            continue
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            for line in cell.source.splitlines() if cell.cell_type == "code" else []:
                if "get_backend" in line or re.search(r"\.backend\s*[!=]=", line) or (
                        compares.search(line) and "backend_of" not in line):
                    found.append(f"{path.relative_to(ROOT)} cell {i}: {line.strip()}")
    return found


def test_no_chapter_asks_the_backend_string_what_a_group_does():
    """On GPUs the string is "cpu:gloo,cuda:nccl": a test of it is silently
    skipped. ``ls.backend_of(x.device)``, asked in the run, says what that
    run's group does with x's tensors."""
    assert backend_string_tests() == []


# -- torchrun: the same group as ls.start ---------------------------------------------

def test_ls_main_makes_the_group_ls_start_makes_device_id_included(monkeypatch):
    made = {}
    for name, value in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(placement.ENV, "auto")
    monkeypatch.delenv("NCCL_DEBUG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: made.setdefault("current", d))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: made.update(
        backend=backend, **kw))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)
    monkeypatch.setattr(ls.strict_p2p, "install", lambda: made.setdefault("strict", True))
    assert torchrun.main(lambda x: x + 1, 41) == 42
    gpus = placement.place  # what ls.start gives 2 GPU ranks, for comparison
    monkeypatch.setattr(placement, "visible_gpus", lambda: 2)
    assert made["backend"] == gpus(2).backend == "cpu:gloo,cuda:nccl"
    assert made["device_id"] == made["current"] == torch.device("cuda", 1)
    assert made["strict"] and os.environ["NCCL_DEBUG"] == "WARN"


# -- a rank waits for its GPU; results come back on the CPU ----------------------------

def gpu_work_that_never_ends():
    torch.cuda.is_initialized = lambda: True  # as after any CUDA call
    torch.cuda.synchronize = lambda *args: time.sleep(60)  # an NCCL op never matched
    return "returned"


def gpu_work_that_asserts():
    torch.cuda.is_initialized = lambda: True

    def synchronize(*args):
        raise RuntimeError("CUDA error: device-side assert triggered")
    torch.cuda.synchronize = synchronize


def test_a_rank_waits_for_its_gpu_inside_the_deadline_and_says_so():
    group = ls.start(world_size=2, backend="gloo")
    with pytest.raises(ls.RankTimeout) as info:
        group.run(gpu_work_that_never_ends, timeout=2)
    assert "an NCCL or CUDA operation it queued never completed" in str(info.value)
    with pytest.raises(ls.RankError, match="device-side assert triggered"):
        group.run(gpu_work_that_asserts)  # in this run, not a later one
    assert group.run(lambda: 1) == [1, 1]
    ls.shutdown()


def gpu_work_then_an_error(gpu):
    """The function raises with GPU work queued, which then fails or never ends."""
    from labsupport.launch import rank_main as this_rank
    torch.cuda.is_initialized = lambda: True

    def synchronize(*args):
        if gpu == "fails":
            raise RuntimeError("CUDA error: device-side assert triggered")
        time.sleep(60)
    torch.cuda.synchronize = synchronize
    this_rank.AFTER_ERROR_WAIT = 0.5
    raise ValueError("the function's own error")


def test_a_rank_whose_function_raised_still_waits_for_its_gpu_and_keeps_the_error():
    group = ls.start(world_size=2, backend="gloo")
    with pytest.raises(ls.RankError) as info:
        group.run(gpu_work_then_an_error, "fails")
    assert "the function's own error" in str(info.value)
    assert "failed too: RuntimeError: CUDA error: device-side assert triggered" in str(info.value)
    started = time.monotonic()
    with pytest.raises(ls.RankError) as info:  # the function's error, not the deadline's
        group.run(gpu_work_then_an_error, "never ends", timeout=60)
    assert not isinstance(info.value, ls.RankTimeout) and time.monotonic() - started < 30
    assert "the function's own error" in str(info.value)
    assert "had not completed 0.5 s after the error" in str(info.value)
    assert group.run(lambda: 1) == [1, 1]
    ls.shutdown()


@dataclasses.dataclass
class Result:
    loss: torch.Tensor
    steps: int


class Plain:
    pass


class Tagged(torch.Tensor):
    """A tensor subclass with an attribute of its own."""


class TaggedParameter(torch.nn.Parameter):
    pass


def test_every_tensor_of_a_result_goes_back_on_the_cpu(monkeypatch):
    moved = set()
    cpu = torch.Tensor.cpu

    def recording_cpu(tensor, *args, **kwargs):
        moved.add(tensor.data_ptr())
        return cpu(tensor, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "cpu", recording_cpu)
    layer, plain, loss = torch.nn.Linear(2, 3), Plain(), torch.ones(2, requires_grad=True) * 2
    plain.state = torch.zeros(4)
    tagged = (torch.arange(3.0, requires_grad=True) * 2).as_subclass(Tagged)
    tagged.tag = "mine"
    param = TaggedParameter(torch.ones(2))
    value = {"result": Result(loss, 3), "model": layer, "object": plain,
             "subclass": tagged, "parameter": param}
    back = pickle.loads(rank_main._dump_result(value))
    for tensor in (loss, layer.weight, layer.bias, plain.state, tagged, param):
        assert tensor.data_ptr() in moved
    assert back["result"].steps == 3 and back["result"].loss.grad_fn is None
    assert isinstance(back["model"].weight, torch.nn.Parameter)
    torch.testing.assert_close(back["model"].weight, layer.weight)
    assert type(back["subclass"]) is Tagged and back["subclass"].tag == "mine"
    assert back["subclass"].requires_grad and back["subclass"].grad_fn is None
    assert back["subclass"].as_subclass(torch.Tensor).tolist() == [0.0, 2.0, 4.0]
    assert type(back["parameter"]) is TaggedParameter and back["parameter"].requires_grad


def a_dtensor_result():
    """A DTensor as a rank returns it, its local shard moved through ``.cpu()``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    shards = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    moved, cpu = [], torch.Tensor.cpu
    torch.Tensor.cpu = lambda t, *a, **k: moved.append(t.data_ptr()) or cpu(t, *a, **k)
    try:
        data = rank_main._dump_result(shards)
    finally:
        torch.Tensor.cpu = cpu
    return data, shards.to_local().data_ptr() in moved


def test_a_dtensor_result_keeps_its_placements_its_shard_on_the_cpu():
    from torch.distributed.tensor import DTensor, Shard
    for rank, (data, shard_moved) in enumerate(
            ls.run(a_dtensor_result, world_size=2, backend="gloo")):
        back = pickle.loads(data)
        assert shard_moved and isinstance(back, DTensor) and back.placements == (Shard(0),)
        assert back.shape == (4,) and back.to_local().tolist() == [2.0 * rank, 2.0 * rank + 1]
    ls.shutdown()


# -- timings: the device's work ----------------------------------------------------------

def test_a_timeline_on_a_gpu_waits_for_its_work_and_on_a_cpu_does_not(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", waited.append)
    with timing_timeline("cuda:1").span("compute", "F"):
        pass
    assert waited == [torch.device("cuda:1")] * 2  # at the start and at the end
    with timing_timeline("cpu").span("compute", "F"):
        pass
    assert timing.now(None) > 0 and len(waited) == 2


def timing_timeline(device):
    from labsupport.timeline import Timeline
    return Timeline(0, device)


def probes_time_the_device():
    """Per probe, the devices its clock waited for: ddp_probe's steps, chapter 5's
    pipeline (zero-bubble's harness is its subclass), and the time-beside-bytes
    sweeps of chapters 4 (forward and g's all-reduce) and 5 (a stage's forward)."""
    import labsupport.pipeline.crossing
    import labsupport.tensor_parallel.crossing
    seen, sync = [], timing.sync
    timing.sync = lambda device=None: seen.append(str(device)) or sync(device)

    def devices(probe, *args, **kwargs):
        seen.clear()
        probe(*args, **kwargs)
        return sorted(set(seen))
    try:
        x, y = models.toy_regression(8, 4, 2, seed=1)
        x4, y4 = models.toy_regression(4, 8, 4, seed=1)
        return {
            "ddp_probe": devices(ddp_probe.profile_steps,
                                 lambda: models.DeepMLP(4, 8, 2, 2, seed=0),
                                 ddp.DataParallelNaive, x, y, steps=1, warmup=0),
            "pipeline": devices(pipeline.run_step, pipeline.train_step_1f1b, x4, y4, 2, 1,
                                dict(d_in=8, width=16, depth=3, d_out=4, seed=0)),
            "crossings.tensor_parallel": devices(
                labsupport.tensor_parallel.crossing._forward_times, 16, 1),
            "crossings.pipeline": devices(labsupport.pipeline.crossing._forward_and_send,
                                          labsupport.pipeline.crossing.stage(16, 1),
                                          torch.randn(8, 16))}
    finally:
        timing.sync = sync


def test_the_probes_and_harnesses_time_through_labsupport_timing():
    every_rank = {"ddp_probe": ["cpu"], "pipeline": ["cpu"], "crossings.tensor_parallel": ["cpu"]}
    assert ls.run(probes_time_the_device, world_size=2, backend="gloo") == [
        dict(every_rank, **{"crossings.pipeline": ["cpu"]}),  # rank 0 times the stage,
        dict(every_rank, **{"crossings.pipeline": []})]       # rank 1 sends it back
    ls.shutdown()


def all_reduce_timed_by_the_call_clock():
    """A recorded all-reduce on a CallClock: its span and the waits for the device."""
    from labsupport import calls
    seen, sync = [], timing.sync
    timing.sync = lambda device=None: seen.append(str(device)) or sync(device)
    try:
        clock = timing.CallClock(torch.device("cpu"))
        with calls.record(clock) as log:
            dist.all_reduce(torch.ones(1 << 16))
            dist.all_reduce(torch.ones(4), async_op=True).wait()  # not timed: async
    finally:
        timing.sync = sync
    return clock.total(log.calls[:1]), len(clock.seconds), seen


def test_the_call_clock_times_a_blocking_collective_on_the_device():
    for seconds, timed, seen in ls.run(all_reduce_timed_by_the_call_clock, world_size=2,
                                       backend="gloo"):
        assert 0 < seconds < 10 and timed == 1 and seen == ["cpu", "cpu"]
    ls.shutdown()


# Where a module that measures may read time.perf_counter itself, and why; everywhere
# else its clock is labsupport.timing's (a GPU's work, not the host's queueing of it).
HOST_CLOCKS = {
    "timing.now": "the clock itself, once the device is idle",
    "calls._new": "a call's host-side stamps (NCCL's end when queued: calls.py says so); "
                  "timing.CallClock times calls on the device",
    "calls._ended": "the same",
    "data_parallel.probe.GradReadyProbe.start":
        "the backward's segments, host-side by design: a wait for the GPU in a gradient hook "
        "would undo the overlap",
    "data_parallel.probe.GradReadyProbe._ready": "the same",
    "context_parallel.ring_attention.ring_forward":
        "when a K/V transfer is posted (its span ends on the timeline's device clock, "
        "record_since)",
    "overlap.median_seconds": "waits for the GPU itself (torch.cuda.synchronize)",
    "sweep._timed": "each call it times waits for its device (sweep's run_once: timing.sync)",
    "doctor.start_and_allreduce": "start-up time, and an all-reduce that waits for the GPU",
    "capstone.run.Progress.__init__": "the torchrun script's progress line (tokens/s, ETA) "
                                      "between steps, each of which ends in loss.item(), "
                                      "a wait for the device",
    "capstone.run.Progress.__call__": "the same",
    "capstone.run.worker": "the same, over the whole run, after train's closing barrier",
    "debugging.gather.run_fault": "the seconds from a fault's start to its named report, "
                                  "a wall-clock span by definition (the launcher's deadline)",
    "debugging.zoo._busy": "a straggler's pause spent computing on the host (a fault, not a "
                           "measurement)",
}


def perf_counter_readers():
    """'module.function' of every direct time.perf_counter() in the measuring modules
    (labsupport and its topics' crossings; the launcher and the benchmarks,
    bench/ and each topic's bench.py or <x>_bench.py, are not lessons')."""
    import ast
    found = set()

    def visit(node, names):
        for child in ast.iter_child_nodes(node):
            inner = names + [child.name] if isinstance(
                child, (ast.FunctionDef, ast.ClassDef)) else names
            if isinstance(child, ast.Attribute) and child.attr == "perf_counter":
                found.add(".".join(inner))
            visit(child, inner)
    for path in sorted((ROOT / "labsupport").rglob("*.py")):
        parts = list(path.relative_to(ROOT / "labsupport").with_suffix("").parts)
        if parts[0] not in ("launch", "bench") and not parts[-1].endswith("bench"):
            visit(ast.parse(path.read_text()), parts)
    return found


def test_no_measuring_module_reads_the_host_clock_but_where_listed():
    assert perf_counter_readers() == set(HOST_CLOCKS)


# -- threads per rank: the container's quota ------------------------------------------

def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cpu_count_reads_the_cgroup_quota_v2_and_v1_and_the_hubs_limit(tmp_path, monkeypatch):
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    write(v2 / "cpu.max", "800000 100000\n")  # 8 cores of a 128-core node
    assert limits.cgroup_cpus(str(v2)) == 8
    write(v2 / "cpu.max", "max 100000\n")
    assert limits.cgroup_cpus(str(v2)) is None
    write(v1 / "cpu" / "cpu.cfs_quota_us", "150000\n")
    write(v1 / "cpu" / "cpu.cfs_period_us", "100000\n")
    assert limits.cgroup_cpus(str(v1)) == 1  # 1.5 cores: whole ones, at least 1
    write(v1 / "cpu" / "cpu.cfs_quota_us", "-1\n")
    assert limits.cgroup_cpus(str(v1)) is None
    assert limits.cgroup_cpus(str(tmp_path / "none")) is None
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(128)))
    write(v2 / "cpu.max", "800000 100000\n")
    monkeypatch.setattr(limits, "CGROUP", str(v2))
    monkeypatch.delenv(limits.CPUS_ENV, raising=False)
    assert limits.cpu_count() == 8
    assert placement.place(4, backend="gloo").threads == 2  # 4 ranks x 2 threads, not 32
    monkeypatch.setenv(limits.CPUS_ENV, "4")  # the hub's per-user limit
    assert limits.cpu_count() == 4
    monkeypatch.setenv(limits.CPUS_ENV, "four")
    with pytest.raises(ValueError, match="LABSUPPORT_CPUS='four': give the number of cores"):
        limits.cpu_count()


# -- NCCL's environment -------------------------------------------------------------------

def rank_env():
    return {k: os.environ.get(k) for k in placement.NCCL_ENV}


def test_every_rank_gets_nccls_environment_unless_the_user_set_it(monkeypatch):
    assert ls.run(rank_env, world_size=2, backend="gloo")[0] == {
        "NCCL_DEBUG": "WARN", "TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING": "false"}
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    ls.start(world_size=2, backend="gloo")
    assert ls.run(rank_env)[1]["NCCL_DEBUG"] == "INFO"
    server = forkserver.get()
    with open(f"/proc/{server.pid}/environ", "rb") as f:
        assert b"PYTORCH_NVML_BASED_CUDA_CHECK=1" in f.read().split(b"\0")
    ls.shutdown()


def test_timing_now_is_perf_counter_on_the_cpu():
    before = time.perf_counter()
    assert before <= timing.now("cpu") <= timing.now(None) <= time.perf_counter()


# -- make test-gpu ------------------------------------------------------------------------

def test_make_test_gpu_skips_in_one_line_without_two_gpus():
    if placement.visible_gpus() >= 2:
        pytest.skip("this machine has the GPUs: make test-gpu runs for real here")
    out = subprocess.run(["scripts/test_gpu.sh"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stderr == ""
    assert out.stdout.startswith("test-gpu: skipped: ") and out.stdout.count("\n") == 1


def test_the_gpu_sanitizer_masks_what_differs_on_gpus_only():
    from nbval.plugin import get_sanitize_patterns

    patterns = get_sanitize_patterns((ROOT / "tests" / "nbval_sanitize_gpu.cfg").read_text())

    def sanitize(text):
        for regex, replace in patterns:
            text = re.sub(regex, replace, text)
        return text

    cpu = ("labsupport: ranks run on gloo (CPU): no CUDA GPU visible\nrank 0 on cpu\n"
           "naive: profiler: 18 gloo:all_reduce, issued after backward\n")
    gpu = "rank 0 on cuda:0\nnaive: profiler: 18 nccl:all_reduce, issued after backward\n"
    assert sanitize(cpu) == sanitize(gpu)
    kept = "N = 4: DDP fp16 sends 0.50 of what fp32 DDP sends; cpu model, 3 calls"
    assert sanitize(kept) == kept
