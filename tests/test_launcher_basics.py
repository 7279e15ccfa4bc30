"""The launcher's interface: start, run, results, lifecycle, environment of the ranks.

Run: .venv/bin/python -m pytest tests/test_launcher_basics.py
"""
import os
import sys
import threading

import pytest
import torch
import torch.distributed as dist

import labsupport as ls
from labsupport.launch import limits, placement


@pytest.fixture
def cluster():
    """A running group of 2 ranks: reused between tests (one group runs per process)."""
    c = ls.current()
    return c if c is not None and c.world_size == 2 else ls.start(world_size=2)


def test_results_come_back_as_a_list_by_rank(cluster):
    def rank_times(x, *, scale):
        return dist.get_rank() * x * scale

    assert cluster.run(rank_times, 3, scale=2) == [0, 6]


def test_closures_and_lambdas_defined_here_run_on_the_ranks(cluster):
    offset = 10
    assert cluster.run(lambda: dist.get_rank() + offset) == [10, 11]


def test_collectives_work_and_tensors_come_back_on_cpu_detached(cluster):
    def allreduce():
        t = torch.full((3,), float(dist.get_rank() + 1), requires_grad=True) * 1
        dist.all_reduce(t.data)
        return {"t": t, "rank": dist.get_rank()}

    results = cluster.run(allreduce)
    for rank, result in enumerate(results):
        assert result["rank"] == rank
        assert result["t"].device.type == "cpu" and not result["t"].requires_grad
        torch.testing.assert_close(result["t"], torch.full((3,), 3.0))


def test_world_size_one_works():
    with ls.start(world_size=1) as c:
        assert c.run(lambda: (dist.get_rank(), dist.get_world_size())) == [(0, 1)]


def test_ranks_use_the_kernels_interpreter_environment_and_directory(cluster, monkeypatch,
                                                                     tmp_path):
    monkeypatch.setenv("LABSUPPORT_TEST_VALUE", "42")
    monkeypatch.chdir(tmp_path)
    cluster.restart()  # the environment is taken at start
    info = cluster.run(lambda: (sys.executable, os.environ.get("LABSUPPORT_TEST_VALUE"),
                                os.getcwd(),
                                os.environ["RANK"], os.environ["WORLD_SIZE"]))
    assert info == [(sys.executable, "42", str(tmp_path), str(r), "2") for r in range(2)]


def test_ranks_are_fresh_interpreters_not_forks_of_the_kernel():
    # The ranks are forked from a separate server process, never from this one, so
    # state of this process (and, on GPU machines, its CUDA context) is not inherited.
    # The marker is set on `sys` (present in every interpreter) before the group
    # starts: a rank forked from this process would see it.
    sys._kernel_only_marker = True
    try:
        with ls.start(world_size=2) as c:
            parents = c.run(lambda: (os.getppid(), hasattr(sys, "_kernel_only_marker")))
    finally:
        del sys._kernel_only_marker
    assert all(ppid != os.getpid() and not marker for ppid, marker in parents), parents


def test_cpu_ranks_split_the_cores():
    with ls.start(world_size=2) as c:
        expected = max(1, limits.cpu_count() // 2)
        assert c.run(torch.get_num_threads) == [expected, expected]
    with ls.start(world_size=1, threads=1) as c:
        assert c.run(torch.get_num_threads) == [1]


def test_call_right_after_start_runs():
    for _ in range(3):
        assert ls.start(world_size=2).run(lambda: dist.get_rank()) == [0, 1]
    ls.shutdown()


def test_ls_run_reuses_a_matching_group_and_replaces_one_that_does_not_match():
    first = ls.start(world_size=2)
    assert ls.run(lambda: 1, world_size=2) == [1, 1] and ls.current() is first
    assert ls.run(lambda: dist.get_world_size(), world_size=3) == [3, 3, 3]
    assert ls.current() is not first and ls.current().world_size == 3
    assert ls.run(lambda: 2) == [2, 2, 2]  # no size given: the running group
    ls.shutdown()
    with pytest.raises(ValueError, match="say how many ranks"):
        ls.run(lambda: 1)


def test_rerunning_the_setup_cell_replaces_the_group_without_double_init():
    a = ls.start(world_size=2)
    pids = a.pids
    b = ls.start(world_size=2)  # the same cell again
    assert b.run(lambda: dist.is_initialized()) == [True, True]
    assert not set(pids) & set(b.pids)
    with pytest.raises(RuntimeError, match="shut down"):
        a.run(lambda: 1)
    ls.shutdown()


def test_context_manager_shuts_down_and_the_group_then_refuses_calls():
    with ls.start(world_size=2) as c:
        pids = c.pids
    assert c.pids == [] and ls.current() is None
    with pytest.raises(RuntimeError, match="was shut down"):
        c.run(lambda: 1)
    assert not [p for p in pids if _alive(p)]


@pytest.mark.parametrize("world_size, error, match", [
    (0, ValueError, "at least 1"),
    (-3, ValueError, "at least 1"),
    (10**6, ValueError, "more than this machine"),
    ("4", TypeError, "must be an int"),
    (True, TypeError, "must be an int"),
    (2.0, TypeError, "must be an int"),
])
def test_bad_world_size_is_refused_clearly(world_size, error, match):
    with pytest.raises(error, match=match):
        ls.start(world_size=world_size)


def test_unknown_backend_and_nccl_without_gpus_are_refused_clearly():
    with pytest.raises(ValueError, match="unknown backend 'mpi'.*'auto', 'gloo', 'nccl'"):
        ls.start(world_size=2, backend="mpi")
    too_many = placement.visible_gpus() + 1
    with pytest.raises(ValueError,
                       match=f"needs one GPU per rank: world_size={too_many}.*backend='gloo'"):
        ls.start(world_size=too_many, backend="nccl")


def test_bad_timeout_and_threads_are_refused():
    with pytest.raises(ValueError, match="timeout must be a positive"):
        ls.start(world_size=1, timeout=0)
    with pytest.raises(ValueError, match="threads must be a positive"):
        ls.start(world_size=1, threads=0)


def test_unpicklable_function_or_argument_is_refused_before_anything_runs(cluster):
    lock = threading.Lock()
    with pytest.raises(TypeError, match="cannot send .*picklable"):
        cluster.run(lambda: lock.locked())
    with pytest.raises(TypeError, match="cannot send .*picklable"):
        cluster.run(print, (i for i in range(3)))
    with pytest.raises(TypeError, match="needs a function"):
        cluster.run(42)
    assert cluster.run(lambda: "still fine") == ["still fine"] * 2


def test_unpicklable_return_value_is_a_clear_error(cluster):
    with pytest.raises(ls.RankError, match="return value .* cannot be sent back"):
        cluster.run(lambda: threading.Lock())
    assert cluster.run(lambda: 1) == [1, 1]


def test_start_on_a_rank_is_refused(cluster):
    def nested():
        import labsupport
        labsupport.start(world_size=1)

    with pytest.raises(ls.RankError, match="called on a rank"):
        cluster.run(nested)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_stopped_groups_leave_no_files_behind():
    from labsupport.launch import forkserver
    c = ls.start(world_size=2, timeout=2)
    c.run(print, "some output")
    with pytest.raises(ls.RankTimeout):  # a stopped generation, replaced in the background
        c.run(lambda: dist.recv(torch.zeros(1), src=1) if dist.get_rank() == 0 else None)
    c.shutdown()
    assert os.listdir(forkserver.get().dir) == ["server.log"]


def test_a_failed_start_is_one_clear_error_and_leaves_nothing_behind(monkeypatch):
    from labsupport.launch import forkserver
    ls.shutdown()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-interface0")  # gloo cannot start
    with pytest.raises(ls.RankError,
                       match="ranks 0, 1 raised RuntimeError.*no-such-interface0") as info:
        ls.start(world_size=2)
    assert "fresh group" not in str(info.value)
    assert ls.current() is None
    assert os.listdir(forkserver.get().dir) == ["server.log"]
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert ls.start(world_size=2).run(lambda: 1) == [1, 1]
