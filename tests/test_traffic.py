# Run: flock /tmp/course-heavy.lock .venv/bin/python -m pytest tests/test_traffic.py
"""The byte counter (labsupport.traffic) at world sizes 2 and 4.

Payload counts of point-to-point calls are exact; wire counts (TCP bytes) are
the payload plus gloo's small headers, and for collectives of a large tensor
they match the textbook formula within a few KiB.
"""
import socket
import struct

import pytest
import torch
import torch.distributed as dist

import labsupport as ls
from labsupport import traffic

HEADERS = 4 * 1024  # gloo's per-message headers plus a barrier's messages, bytes
BIG = 4 << 20  # bytes: large enough that headers are noise beside the payload


@pytest.fixture(scope="module", params=[2, 4], ids=["world_size=2", "world_size=4"])
def cluster(request):
    c = ls.start(world_size=request.param, backend="gloo")
    yield c
    c.shutdown()


def _counted(fn, *args):
    """fn(*args) in a count() block that ends once every rank's bytes arrived."""
    dist.barrier()
    with traffic.count() as t:
        fn(*args)
        dist.barrier()
    return t


def _isend_irecv_ring(numel):
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = torch.ones(numel), torch.empty(numel)
    with traffic.count() as t:  # even ranks send first, odd ones receive first:
        send = lambda: dist.isend(x, (rank + 1) % n)  # noqa: E731  a matched order
        recv = lambda: dist.irecv(y, (rank - 1) % n)  # noqa: E731  (NCCL's rules too)
        works = [send(), recv()] if rank % 2 == 0 else [recv(), send()]
        for w in works:
            w.wait()
    return t.sent, t.received, t.calls


def test_isend_irecv_payload_is_exact(cluster):
    for sent, received, calls in cluster.run(_isend_irecv_ring, 1000):
        assert (sent, received) == (4000, 4000)
        assert calls == {"isend": 1, "irecv": 1}


def _send_recv_pairs(numel):
    """Even ranks send numel doubles to the next rank, which answers with 3."""
    rank = dist.get_rank()
    x = torch.ones(numel, dtype=torch.float64)
    with traffic.count() as t:
        if rank % 2 == 0:
            dist.send(x, rank + 1)
            dist.recv(x[:3], rank + 1)
        else:
            dist.recv(x, rank - 1)
            dist.send(x[:3], rank - 1)
    return t.sent, t.received


def test_blocking_send_recv_payload_is_exact(cluster):
    for rank, counts in enumerate(cluster.run(_send_recv_pairs, 777)):
        assert counts == ((777 * 8, 24) if rank % 2 == 0 else (24, 777 * 8))


def _batched(numel):
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = torch.ones(numel, dtype=torch.int16), torch.empty(numel, dtype=torch.int16)
    with traffic.count() as t:
        ops = [dist.P2POp(dist.isend, x, (rank + 1) % n),
               dist.P2POp(dist.irecv, y, (rank - 1) % n)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    return t.sent, t.received, t.calls


def test_batch_isend_irecv_counts_each_op_once(cluster):
    for sent, received, calls in cluster.run(_batched, 501):
        assert (sent, received) == (1002, 1002)
        assert calls == {"batch_isend_irecv": 1}  # its inner isend/irecv not again


def _one_send(nbytes):
    x = torch.ones(nbytes // 4)
    t = _counted(lambda: (dist.send(x, 1) if dist.get_rank() == 0 else
                          dist.recv(x, 0) if dist.get_rank() == 1 else None))
    return t.sent, t.received, t.wire_sent, t.wire_received


def test_wire_is_payload_plus_small_overhead(cluster):
    results = cluster.run(_one_send, BIG)
    sent, _, wire_sent, _ = results[0]
    _, received, _, wire_received = results[1]
    assert sent == received == BIG
    assert 0 < wire_sent - sent <= HEADERS
    assert 0 < wire_received - received <= HEADERS
    for _, _, wire_sent, wire_received in results[2:]:  # bystanders: the barriers only
        assert wire_sent <= HEADERS and wire_received <= HEADERS


def _collectives(nbytes):
    n = dist.get_world_size()
    big = torch.ones(nbytes // 4)
    share = big[: big.numel() // n].clone()
    counts = {}
    for name, fn in (("all_reduce", lambda: dist.all_reduce(big)),
                     ("all_gather", lambda: dist.all_gather_single(big, share)),
                     ("reduce_scatter", lambda: dist.reduce_scatter_single(share, big))):
        t = _counted(fn)
        counts[name] = (t.wire_sent, t.wire_received)
    return counts


def test_collective_wire_bytes_match_the_formula(cluster):
    n = cluster.world_size
    formula = {
        "all_reduce": 2 * (n - 1) * BIG // n,
        "all_gather": (n - 1) * BIG // n,  # S is the output's size
        # Textbook (n-1)/n * S; gloo computes it as an all-reduce and keeps
        # each rank's chunk (chapter 1 shows this), so it moves 2(n-1)/n * S.
        "reduce_scatter": 2 * (n - 1) * BIG // n,
    }
    for counts in cluster.run(_collectives, BIG):
        for name, expected in formula.items():
            for counted in counts[name]:
                assert abs(counted - expected) <= HEADERS, (name, counted, expected)


def _rooted_and_all_to_all(nbytes):
    n, rank = dist.get_world_size(), dist.get_rank()
    big = torch.ones(nbytes // 4)
    share = big[: big.numel() // n].clone()
    on_root = list(big.chunk(n)) if rank == 0 else None
    counts = {}
    for name, fn in (("broadcast", lambda: dist.broadcast(big, src=0)),
                     ("scatter", lambda: dist.scatter(share, on_root, src=0)),
                     ("gather", lambda: dist.gather(share, on_root, dst=0)),
                     ("reduce", lambda: dist.reduce(big, dst=0)),
                     ("all_to_all", lambda: dist.all_to_all_single(big.clone(), big))):
        t = _counted(fn)
        counts[name] = (t.wire_sent, t.wire_received)
    return counts


def _rooted_formula(name, rank, n, s):
    """(sent, received) by rank for gloo's algorithms (chapter 1's table), root 0."""
    share, root, rest = s // n, rank == 0, s - s // n
    children = sum(1 for k in range(n.bit_length()) if 2**k > rank and rank + 2**k < n)
    return {"broadcast": (children * s, 0 if root else s),       # binomial tree
            "scatter": (rest if root else 0, 0 if root else share),
            "gather": (0 if root else share, rest if root else 0),
            "reduce": (rest if root else s, 2 * rest if root else rest),  # reduce-scatter, gather
            "all_to_all": (rest, rest)}[name]


def test_rooted_collectives_and_all_to_all_match_their_formulas(cluster):
    n = cluster.world_size
    for rank, counts in enumerate(cluster.run(_rooted_and_all_to_all, BIG)):
        for name, counted in counts.items():
            expected = _rooted_formula(name, rank, n, BIG)
            for c, e in zip(counted, expected):
                assert abs(c - e) <= 2 * HEADERS, (name, rank, counted, expected)


def test_an_empty_block_counts_no_payload():
    with traffic.count(settle=0) as t:
        pass
    assert (t.sent, t.received, t.calls) == (0, 0, {})


def _tcp_info(size, acked=0, received=0, sent=0, retransmitted=0):
    info = bytearray(size)
    struct.pack_into("QQ", info, traffic._TCP_INFO_BYTES_ACKED, acked, received)
    if size >= traffic._TCP_INFO_BYTES_SENT + 16:
        struct.pack_into("QQ", info, traffic._TCP_INFO_BYTES_SENT, sent, retransmitted)
    return bytes(info)


def test_retransmitted_bytes_are_not_counted_twice():
    # Linux >= 4.19: bytes sent include the segments sent again after a loss
    info = _tcp_info(232, acked=900, received=700, sent=1_500, retransmitted=500)
    assert traffic.tcp_info_bytes(info) == (1_000, 700)


def test_older_kernels_count_bytes_acknowledged():
    info = _tcp_info(160, acked=900, received=700)
    assert traffic.tcp_info_bytes(info) == (900, 700)


def test_a_real_socket_pair_counts_what_was_sent():
    with socket.create_server(("127.0.0.1", 0)) as server:
        with socket.create_connection(server.getsockname()) as client:
            peer, _ = server.accept()
            with peer:
                client.sendall(b"x" * 10_000)
                got = b""
                while len(got) < 10_000:
                    got += peer.recv(65536)
                def info(s):
                    return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
                assert traffic.tcp_info_bytes(info(client))[0] == 10_000
                assert traffic.tcp_info_bytes(info(peer))[1] == 10_000
