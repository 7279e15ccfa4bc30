"""Two torchrun agents on this machine: a two-node job on loopback, from the notebook.

    run = run_two_nodes(["-m", "labsupport.checkpoints.resumable", "--root", root, "--out", out],
                        workdir, max_restarts=1, timeout=120)
    run.returncodes, run.seconds, run.logs       # each agent's exit code and output

Each agent is ``python -m torch.distributed.run`` (torchrun) with
``--nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:<free port>``:
agent 0 hosts the rendezvous store (``is_host=true``), as the head node of a
real job would, and agent 1 joins it. Every connection goes over loopback
(``--local-addr``, ``GLOO_SOCKET_IFNAME=lo``); the port is picked free.

Loopback alone does not keep the job private: torch 2.13's ``TCPStore``
server binds every interface (``ss -ltn`` shows ``*:<port>``), whatever
address it is given; it can take an already-bound socket
(``master_listen_fd``), but the c10d rendezvous backend
(``torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py``,
``_create_tcp_store``) and the workers' store (``dynamic_rendezvous.py``,
``_create_tcp_store_server``) pass only a host and a port. So both agents
run in a network namespace of their own (``unshare --user --map-root-user
--net``, then ``nsenter``), where loopback is the only interface and
nothing outside can connect. Where the kernel refuses unprivileged user
namespaces, ``private_network=None`` (the default) warns and runs on the
host, ``True`` raises, ``False`` does not try.

The run has a deadline; whatever happens (an error, the deadline, an
interrupt), both agents and every worker they started are stopped before
this returns or raises: SIGTERM first (an agent then stops its own
workers), SIGKILL after ``STOP_WAIT`` seconds, workers found by their
parent's PID (torchrun starts each in its own session).
"""
import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings

from labsupport.launch.limits import cpu_count

STOP_WAIT = 5.0      # s: for an agent to stop its workers after SIGTERM
TAIL = 3000          # characters of an agent's log shown when it fails


@dataclasses.dataclass
class TwoNodeRun:
    returncodes: list      # each agent's exit code (0: its workers finished)
    seconds: float         # from starting the agents to both exiting
    logs: list             # each agent's output (torchrun's and its workers')
    private_network: bool  # True: in a network namespace of its own


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it; nothing is fixed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_command(node: int, port: int, program: list, *, nproc_per_node=1,
                  max_restarts=1, run_id="labsupport") -> list:
    """The torchrun command of node ``node`` (0 or 1) of the loopback job."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
            f"--nproc-per-node={nproc_per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}",
            f"--rdzv-conf=is_host={'true' if node == 0 else 'false'}",
            "--local-addr=127.0.0.1", f"--max-restarts={max_restarts}",
            "--monitor-interval=0.1", *program]


def run_two_nodes(program: list, workdir: str, *, nproc_per_node=1, max_restarts=1,
                  timeout=120.0, private_network=None) -> TwoNodeRun:
    """Run ``program`` (torchrun's arguments after its own: a script or ``-m module``)
    as a two-node job; its agents' logs go to ``workdir``. Raises RuntimeError if an
    agent fails, TimeoutError at the deadline; never leaves a process behind.
    ``private_network``: see the module's docstring."""
    port, procs, logs = free_port(), [], []
    env = _environment(2 * nproc_per_node)
    with contextlib.ExitStack() as stack:
        enter = _enter_prefix(stack, private_network)
        t0 = time.monotonic()
        try:
            for node in (0, 1):
                logs.append(os.path.join(workdir, f"agent{node}.log"))
                with open(logs[-1], "wb") as log:
                    procs.append(subprocess.Popen(
                        enter + agent_command(node, port, program, max_restarts=max_restarts,
                                              nproc_per_node=nproc_per_node),
                        env=env, stdin=subprocess.DEVNULL, stdout=log,
                        stderr=subprocess.STDOUT, start_new_session=True))
            codes = [_wait(p, t0 + timeout) for p in procs]
        finally:
            _stop(procs)
    seconds, texts = time.monotonic() - t0, [_read(path) for path in logs]
    if None in codes:
        raise TimeoutError(f"the two-node run passed its {timeout:g} s deadline; stopped "
                           f"both agents and their workers.\n{_tails(texts)}")
    if any(codes):
        raise RuntimeError(f"torchrun agents exited with codes {codes}.\n{_tails(texts)}")
    return TwoNodeRun(codes, seconds, texts, bool(enter))


# Run by the namespace's holder: bring loopback up (a new namespace's is down),
# say so, then hold the namespace open until the parent closes stdin or dies.
_HOLD = """import fcntl, socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
flags = struct.unpack('16sH', fcntl.ioctl(s, 0x8913, struct.pack('16sH22x', b'lo', 0))[:18])[1]
fcntl.ioctl(s, 0x8914, struct.pack('16sH22x', b'lo', flags | 1))   # SIOCSIFFLAGS, IFF_UP
print('ready', flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def private_network():
    """A network namespace of its own, loopback its only interface, while the block
    runs: yields the command prefix that runs a program inside it. Raises OSError,
    saying why, where it cannot be made (no util-linux, user namespaces refused)."""
    if not (shutil.which("unshare") and shutil.which("nsenter")):
        raise OSError("unshare and nsenter (util-linux) are not installed")
    holder = subprocess.Popen(
        ["unshare", "--user", "--map-root-user", "--net", "--", sys.executable, "-c", _HOLD],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True)
    try:
        if holder.stdout.readline().strip() != b"ready":
            holder.wait()
            raise OSError("could not make a private network namespace: "
                          + holder.stderr.read().decode(errors="replace").strip())
        yield ["nsenter", f"--target={holder.pid}", "--user", "--net",
               "--preserve-credentials", "--"]
    finally:
        holder.stdin.close()
        if _wait(holder, time.monotonic() + STOP_WAIT) is None:
            holder.kill()
            holder.wait()


def _enter_prefix(stack, wanted) -> list:
    """The prefix that starts an agent in a private network, [] on the host."""
    if wanted is False:
        return []
    try:
        return stack.enter_context(private_network())
    except OSError as err:
        if wanted:
            raise
        warnings.warn(f"{err}. The two agents run on the host: their rendezvous "
                      "store listens on every interface while the job runs, so "
                      "other machines and users can reach it.", stacklevel=3)
        return []


def _environment(workers: int) -> dict:
    """The agents' environment: loopback only; each attempt's workers their own store
    (a store shared across restarts hands restarted workers stale addresses: pytorch
    #135712); the CPU threads labsupport gives each of ``workers`` ranks on this machine
    (the same numerics as ``ls.run``); this copy of labsupport importable."""
    path = os.pathsep.join(filter(None, [_package_parent(), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo",
                TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONPATH=path,
                OMP_NUM_THREADS=str(max(1, cpu_count() // workers)))


def _wait(proc, deadline):
    try:
        return proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None


def _stop(procs):
    """SIGTERM every live agent, SIGKILL after STOP_WAIT, then any worker left."""
    workers = {p.pid: _children(p.pid) for p in procs}
    for p in procs:
        if p.poll() is None:
            _signal_group(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_WAIT
    for p in procs:
        if _wait(p, deadline) is None:
            _signal_group(p.pid, signal.SIGKILL)
            p.wait()
    for pids in workers.values():
        for pid in pids:          # each worker leads its own session (torchrun's doing)
            _signal_group(pid, signal.SIGKILL)


def _signal_group(pid, sig):
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _children(pid) -> list:
    """PIDs whose parent is ``pid`` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _read(path) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "backslashreplace")
    except OSError:
        return ""


def _tails(texts) -> str:
    return "\n".join(f"--- agent {i} (last {TAIL} characters) ---\n{t[-TAIL:]}"
                     for i, t in enumerate(texts))


def _package_parent() -> str:
    """The folder holding the labsupport package, so that the workers import this copy."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
