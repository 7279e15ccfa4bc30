"""A rank that raises, dies or hangs ends the run with one clear error, fast; the next call works.

Run: .venv/bin/python -m pytest tests/test_launcher_failures.py
"""
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import labsupport as ls


@pytest.fixture
def cluster():
    c = ls.current()
    return c if c is not None and c.world_size == 4 else ls.start(world_size=4)


def raise_on_rank_1_while_others_wait():
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    dist.all_reduce(torch.ones(1))  # ranks 0, 2, 3 block here: rank 1 never joins


def test_an_exception_on_one_rank_is_reported_within_2s_naming_it(cluster):
    t0 = time.monotonic()
    with pytest.raises(ls.RankError) as info:
        cluster.run(raise_on_rank_1_while_others_wait)
    elapsed = time.monotonic() - t0
    assert elapsed < 2.0, f"the error took {elapsed:.2f} s"
    err = info.value
    assert err.ranks == [1]
    text = str(err)
    assert text.startswith("rank 1 raised ValueError: rank one is broken")
    assert 'raise ValueError("rank one is broken")' in text  # the remote source line
    assert "line 24, in raise_on_rank_1_while_others_wait" in text  # rank 1's raise
    assert "line 25, in raise_on_rank_1_while_others_wait" in text  # where the others wait
    assert "ranks 0, 2, 3 stopped here" in text and "dist.all_reduce(torch.ones(1))" in text
    assert isinstance(err.exception(1), ValueError)


def test_the_next_call_works_ten_times_in_a_row(cluster):
    for attempt in range(10):
        with pytest.raises(ls.RankError):
            cluster.run(raise_on_rank_1_while_others_wait)
        assert cluster.run(lambda: dist.get_rank()) == [0, 1, 2, 3], f"attempt {attempt}"


def test_any_failure_replaces_the_ranks_even_the_same_error_everywhere(cluster):
    # A rank that raised may have left a posted irecv behind, which would swallow
    # the next run's message: only a fresh group is safe.
    def post_a_receive_then_raise():
        rank = dist.get_rank()
        dist.irecv(torch.zeros(1), src=(rank + 1) % 4)
        raise KeyError("missing")

    pids = cluster.pids
    with pytest.raises(ls.RankError, match="^ranks 0, 1, 2, 3 raised KeyError") as info:
        cluster.run(post_a_receive_then_raise)
    assert info.value.ranks == [0, 1, 2, 3]
    assert not set(cluster.pids) & set(pids)

    def exchange():
        rank, t = dist.get_rank(), torch.zeros(1)
        mine = torch.tensor([float(rank)])
        dist.send(mine, (rank - 1) % 4) if rank % 2 else dist.recv(t, (rank + 1) % 4)
        dist.recv(t, (rank + 1) % 4) if rank % 2 else dist.send(mine, (rank - 1) % 4)
        return t.item()

    assert cluster.run(exchange, timeout=10) == [1.0, 2.0, 3.0, 0.0]


def test_chained_exceptions_show_both_tracebacks(cluster):
    def chained():
        try:
            {}["key"]
        except KeyError as exc:
            raise RuntimeError("lookup failed") from exc

    with pytest.raises(ls.RankError) as info:
        cluster.run(chained)
    text = str(info.value)
    assert "KeyError: 'key'" in text and "direct cause" in text
    assert "RuntimeError: lookup failed" in text


def test_sys_exit_on_a_rank_is_an_error_not_a_vanished_rank(cluster):
    with pytest.raises(ls.RankError, match="raised SystemExit: 3"):
        cluster.run(lambda: exit(3) if dist.get_rank() == 2 else dist.barrier())
    assert cluster.run(lambda: 1) == [1] * 4


@pytest.mark.parametrize("how, status", [
    (lambda: os._exit(3), "exit code 3"),
    (lambda: os.kill(os.getpid(), signal.SIGSEGV), "signal SIGSEGV"),
])
def test_a_rank_that_dies_is_reported_with_its_exit_status(cluster, how, status):
    def die_on_rank_2():
        if dist.get_rank() == 2:
            how()
        dist.barrier()

    with pytest.raises(ls.RankError, match=f"rank 2 died \\({status}\\)") as info:
        cluster.run(die_on_rank_2)
    if "SIGSEGV" in status:  # faulthandler's report from the dead rank is in the error
        assert "Segmentation fault" in str(info.value)
    else:                     # nothing on stderr: the report says so, not an empty section
        assert "--- rank 2 ---\n(it wrote nothing to stderr before it died)" in str(info.value)
    assert cluster.run(lambda: dist.get_world_size()) == [4] * 4


def test_a_rank_killed_from_outside_is_reported_and_the_next_run_works(cluster):
    import threading  # (imported here: the tests above check their own line numbers)
    victim = cluster.pids[1]
    threading.Timer(0.5, os.kill, (victim, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(ls.RankError, match=r"rank 1 died \(signal SIGKILL\)"):
        cluster.run(lambda: time.sleep(30) if dist.get_rank() == 1 else dist.barrier())
    assert time.monotonic() - t0 < 5.0      # the survivors' connection errors, then GRACE
    assert cluster.run(lambda: dist.get_world_size()) == [4] * 4
    assert victim not in cluster.pids


def test_a_hang_ends_at_the_deadline_with_each_stuck_ranks_stack(cluster):
    def wait_for_a_message_never_sent():
        if dist.get_rank() == 0:
            buf = torch.zeros(1)
            dist.recv(buf, src=3)  # rank 3 never sends
        return dist.get_rank()

    old_pids = cluster.pids
    t0 = time.monotonic()
    with pytest.raises(ls.RankTimeout) as info:
        cluster.run(wait_for_a_message_never_sent, timeout=1.5)
    assert time.monotonic() - t0 < 4.0
    text = str(info.value)
    assert text.startswith("rank 0 still running at the run's 1.5 s deadline; stopped")
    assert "dist.recv(buf, src=3)" in text  # where rank 0 was stuck
    assert isinstance(info.value, TimeoutError)
    assert cluster.run(lambda: dist.get_rank()) == [0, 1, 2, 3]
    assert not set(old_pids) & set(cluster.pids), "a timeout must replace the ranks"


def test_default_deadline_is_generous_and_settable_per_group():
    with ls.start(world_size=2) as c:
        assert c.timeout == 120.0
    with ls.start(world_size=2, timeout=1) as c:
        with pytest.raises(ls.RankTimeout, match="1 s deadline"):
            c.run(time.sleep, 30)
        assert c.run(lambda: "ok") == ["ok", "ok"]
