"""One ring exchange, timed: the step of every hand-made ring, pipeline, ring attention.

    python -m labsupport.bench p2p [--world-sizes 2 4] [--bytes 1024] [--exchanges 100]

An exchange is chapter 2's ``exchange``: a send to the right neighbour and a
receive from the left in one ``batch_isend_irecv``, waited for. Each rank
times ``--exchanges`` of them after a warm-up, ``--repeats`` times, and
keeps the median; the slowest rank's is printed, beside ``dist.all_reduce``
of the same bytes timed the same way, with the point-to-point rules the
ranks ran by (``LABSUPPORT_P2P``: strict, NCCL's, as the test suite runs;
or gloo's own) and the CPU time each rank's gloo event-loop threads
(``gloo_tcp_loop``) used per exchange: gloo handles a socket's event only
if it can take that connection's lock at once and otherwise returns to a
level-triggered ``epoll_wait``, which reports the event again at once
(gloo/transport/tcp/pair.cc, ``Pair::handleEvents``), so on cores shared by
more ranks than there are, that thread spins. Last line, machine-readable:
``p2p_exchange_ms_w2=<x> p2p_exchange_ms_w4=<y>`` (one field per world size).
"""
import argparse
import os
import statistics
import time

LOOP = "gloo_tcp_loop"  # the name gloo gives its TCP event-loop thread


def _timed(step, exchanges, repeats):
    for _ in range(10):
        step()
    import torch.distributed as dist
    dist.barrier()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(exchanges):
            step()
        times.append((time.perf_counter() - start) / exchanges)
    return statistics.median(times)


def time_exchanges(nbytes, exchanges, repeats):
    """(seconds per exchange, per all-reduce, gloo loop CPU seconds per exchange
    or None where /proc is missing)."""
    import torch
    import torch.distributed as dist

    from labsupport.ring.ring import exchange
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    out = torch.zeros(max(1, nbytes // 4))
    incoming = torch.empty_like(out)
    before = _loop_cpu_s()
    ring_s = _timed(lambda: exchange(out, right, incoming, left), exchanges, repeats)
    after = _loop_cpu_s()
    loop_s = None if before is None else (after - before) / (exchanges * repeats + 10)
    reduce_s = _timed(lambda: dist.all_reduce(out), exchanges, repeats)
    return ring_s, reduce_s, loop_s


def _loop_cpu_s(name=LOOP):
    """CPU seconds the process's threads called ``name`` have used (/proc, Linux)."""
    if not os.path.isdir("/proc/self/task"):
        return None
    ticks = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                head, tail = f.read().rsplit(")", 1)
            if head.split("(", 1)[1] == name:
                fields = tail.split()
                ticks += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, IndexError, ValueError):
            continue
    return ticks / os.sysconf("SC_CLK_TCK")


def main(argv):
    from labsupport.launch import session, strict_p2p

    parser = argparse.ArgumentParser(prog="python -m labsupport.bench p2p")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--bytes", type=int, default=1024,
                        help="message size (default 1 KiB)")
    parser.add_argument("--exchanges", type=int, default=100, help="timed per repeat")
    parser.add_argument("--repeats", type=int, default=5, help="median of these")
    parser.add_argument("--backend", default="auto", help="auto, gloo or nccl")
    args = parser.parse_args(argv)
    mode = "strict (NCCL's rules)" if strict_p2p.requested() else "gloo's own rules"
    fields = []
    for world_size in args.world_sizes:
        with session.start(world_size=world_size, backend=args.backend) as cluster:
            rows = cluster.run(time_exchanges, args.bytes, args.exchanges, args.repeats,
                               timeout=600)
        ring_ms = max(r[0] for r in rows) * 1e3
        reduce_ms = max(r[1] for r in rows) * 1e3
        loops = [r[2] for r in rows if r[2] is not None]
        loop = f"{max(loops) * 1e3:.3f} ms" if loops else "n/a"
        print(f"N={world_size}, {args.bytes} B, point-to-point by {mode}: exchange "
              f"{ring_ms:.3f} ms, all_reduce {reduce_ms:.3f} ms (slowest rank's "
              f"median); gloo's loop thread used {loop} of CPU per exchange")
        fields.append(f"p2p_exchange_ms_w{world_size}={ring_ms:.3f}")
    print(" ".join(fields))
