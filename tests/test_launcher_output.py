"""Rank output: captured at file-descriptor level, labelled, in rank order, never blocking.

Run: .venv/bin/python -m pytest tests/test_launcher_output.py
"""
import ctypes
import os
import sys

import pytest
import torch.distributed as dist

import labsupport as ls


@pytest.fixture
def cluster():
    c = ls.current()
    return c if c is not None and c.world_size == 4 else ls.start(world_size=4)


def test_output_is_labelled_and_in_rank_order_whatever_the_timing(cluster, capfd):
    def chatty():
        import time
        rank = dist.get_rank()
        time.sleep(0.05 * (3 - rank))  # rank 3 prints first
        print(f"hello from {rank}")
        print(f"warning from {rank}", file=sys.stderr)

    for _ in range(3):
        cluster.run(chatty)
        out, err = capfd.readouterr()
        assert out == "".join(f"[rank{r}] hello from {r}\n" for r in range(4))
        assert err == "".join(f"[rank{r}] warning from {r}\n" for r in range(4))


def test_file_descriptor_and_c_level_output_is_captured(cluster, capfd):
    def low_level():
        os.write(1, f"fd1 {dist.get_rank()}\n".encode())
        os.write(2, f"fd2 {dist.get_rank()}\n".encode())
        libc = ctypes.CDLL(None)
        libc.printf(b"printf %d\n", dist.get_rank())  # buffered by C stdio until the run ends

    cluster.run(low_level)
    out, err = capfd.readouterr()
    for r in range(4):
        assert f"[rank{r}] fd1 {r}\n" in out and f"[rank{r}] printf {r}\n" in out
        assert f"[rank{r}] fd2 {r}\n" in err


def test_ten_megabytes_of_prints_are_captured_whole(cluster, capfd):
    line = "x" * 99  # 100 bytes with the newline

    def flood():
        if dist.get_rank() == 1:
            for _ in range(100_000):
                print(line)
        dist.barrier()
        return "done"

    assert cluster.run(flood, timeout=120) == ["done"] * 4
    out, _ = capfd.readouterr()
    assert out.count(f"[rank1] {line}\n") == 100_000


def test_output_of_a_failed_run_is_still_shown(cluster, capfd):
    def fail_after_print():
        print("before the error")
        raise RuntimeError("late")

    with pytest.raises(ls.RankError):
        cluster.run(fail_after_print)
    out, _ = capfd.readouterr()
    assert out == "".join(f"[rank{r}] before the error\n" for r in range(4))


def test_streaming_shows_lines_while_the_run_is_still_going(cluster, capfd):
    marks = []

    def slow_printer():
        import time
        for i in range(3):
            print(f"step {i}", flush=True)
            time.sleep(0.4)

    import threading
    done = threading.Event()

    def watch():  # what has reached our stdout before the run ends
        while not done.wait(0.1):
            marks.append(capfd.readouterr().out)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        cluster.run(slow_printer, stream=True)
    finally:
        done.set()
        watcher.join()
    early = "".join(marks)
    assert "[rank0] step 0\n" in early, "streamed output should appear before the run ends"
