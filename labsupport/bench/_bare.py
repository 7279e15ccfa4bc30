"""Bare baselines for the launcher benchmark: torch.multiprocessing.spawn and plain pipes."""
import os
import socket
import statistics
import time

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank, ws, port):
    import torch.distributed as dist
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=ws)


def _ready_worker(rank, ws, port, queue, stop):
    _init(rank, ws, port)
    queue.put(rank)
    stop.wait()


def spawn_until_ready(ws: int):
    """Spawn ws fresh interpreters that each init gloo; return once all are ready."""
    ctx = mp.get_context("spawn")
    queue, stop = ctx.SimpleQueue(), ctx.Event()
    procs = mp.spawn(_ready_worker, args=(ws, _free_port(), queue, stop), nprocs=ws, join=False)
    for _ in range(ws):
        queue.get()
    stop.set()
    procs.join()


def _allreduce_worker(rank, ws, port, queue):
    import torch
    import torch.distributed as dist
    _init(rank, ws, port)
    t = torch.ones(1 << 20)
    times = []
    for i in range(23):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        queue.put(statistics.median(times))
    dist.destroy_process_group()


def spawn_allreduce_median(ws: int) -> float:
    """Median time of a 4 MiB all_reduce inside bare spawned gloo workers (rank 0's clock)."""
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_allreduce_worker, args=(ws, _free_port(), queue), nprocs=ws, join=True)
    return queue.get()


def _echo(conn):
    while conn.recv() is not None:
        conn.send(None)


def pipe_round_trip(ws: int, calls: int = 300) -> float:
    """Median time to send a message to ws processes and get every answer back."""
    ctx = mp.get_context("spawn")
    pairs = [ctx.Pipe() for _ in range(ws)]
    procs = [ctx.Process(target=_echo, args=(child,)) for _, child in pairs]
    for p in procs:
        p.start()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        for parent, _ in pairs:
            parent.send(1)
        for parent, _ in pairs:
            parent.recv()
        times.append(time.perf_counter() - t0)
    for (parent, _), p in zip(pairs, procs):
        parent.send(None)
        p.join()
    return statistics.median(times[20:])
