"""Count the bytes a rank sends and receives while a block of code runs.

    with ls.traffic.count() as traffic:
        dist.all_reduce(t)
    traffic.wire_sent, traffic.wire_received       # bytes on this rank's TCP connections
    traffic.sent, traffic.received                 # payload of send/recv/isend/irecv calls

Two levels, because they answer different questions:

- **wire**: what really crossed this rank's TCP connections (gloo's, and a
  TCPStore's under torchrun), read from the kernel's per-socket counters
  (``TCP_INFO``: bytes sent, bytes received). This is the
  count to set beside a formula for a *collective*, whose internal algorithm
  the caller does not see. It includes gloo's small per-message headers.
  NCCL traffic over NVLink or shared memory is not on a TCP socket: on GPUs
  the wire count is only the socket part.
- **payload**: the tensor bytes of the point-to-point calls made in the block
  (``send``, ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv``), exact,
  as ``labsupport.calls`` (the one recorder of calls) sees them: where
  torch.distributed is called through its module (``dist.send(...)``). This
  is what a hand-written ring sends.
"""
import contextlib
import os
import socket
import struct
import time

from labsupport import calls

# Offsets in Linux's struct tcp_info (include/uapi/linux/tcp.h) of
# tcpi_bytes_acked and tcpi_bytes_received (u64s, Linux >= 4.2) and of
# tcpi_bytes_sent and tcpi_bytes_retrans (u64s, Linux >= 4.19). Bytes sent
# minus bytes sent again are counted when they first leave, so the count
# depends neither on when the peer's acknowledgements come back nor on
# retransmissions (which happen even on loopback under load); older kernels
# fall back to bytes acknowledged.
_TCP_INFO_BYTES_ACKED = 120
_TCP_INFO_BYTES_RECEIVED = 128
_TCP_INFO_BYTES_SENT = 200
_TCP_INFO_SIZE = 256


class Traffic:
    """Byte counts of one ``count()`` block; filled in when the block ends."""

    def __init__(self):
        self.sent = 0            # payload bytes of send/isend (and batched isend)
        self.received = 0        # payload bytes of recv/irecv (and batched irecv)
        self.wire_sent = 0       # TCP bytes sent during the block
        self.wire_received = 0   # TCP bytes received during the block
        self.calls = {}          # point-to-point call name -> number of calls

    def __repr__(self):
        return (f"Traffic(sent={self.sent}, received={self.received}, "
                f"wire_sent={self.wire_sent}, wire_received={self.wire_received})")


def tcp_totals() -> tuple[int, int]:
    """(bytes sent, bytes received) summed over this process's TCP sockets."""
    sent = received = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:  # closed meanwhile, or not a socket after all
            continue
        with sock:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET,
                                                                      socket.AF_INET6):
                continue
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SIZE)
            out, into = tcp_info_bytes(info)
            sent += out
            received += into
    return sent, received


def tcp_info_bytes(info: bytes) -> tuple[int, int]:
    """(bytes sent once, bytes received) from one socket's struct tcp_info."""
    if len(info) >= _TCP_INFO_BYTES_SENT + 16:
        sent, sent_again = struct.unpack_from("QQ", info, _TCP_INFO_BYTES_SENT)
        sent -= sent_again
    else:
        sent = struct.unpack_from("Q", info, _TCP_INFO_BYTES_ACKED)[0]
    return sent, struct.unpack_from("Q", info, _TCP_INFO_BYTES_RECEIVED)[0]


@contextlib.contextmanager
def count(settle: float = 0.02):
    """Count this rank's traffic during the block (see the module docstring).

    The wire count is read after the block with a short ``settle`` pause, so
    that bytes already on their way (gloo sends from background threads) are in.
    """
    traffic = Traffic()
    wire_before = tcp_totals()
    with calls.record() as log:
        yield traffic
    _add_payload(traffic, log)
    time.sleep(settle)
    wire_after = tcp_totals()
    traffic.wire_sent = wire_after[0] - wire_before[0]
    traffic.wire_received = wire_after[1] - wire_before[1]


def _add_payload(traffic: Traffic, log: calls.Log):
    """The point-to-point calls of the block: bytes each way, calls by name (a batch
    is one call of batch_isend_irecv)."""
    batches = set()
    for c in log.calls:
        if c["kind"] != "p2p":
            continue
        if "send" in c["op"]:
            traffic.sent += c["nbytes"]
        else:
            traffic.received += c["nbytes"]
        name = c["op"] if c["batch"] is None else "batch_isend_irecv"
        if c["batch"] is None or c["batch"] not in batches:
            traffic.calls[name] = traffic.calls.get(name, 0) + 1
            batches.add(c["batch"])
