"""One rank: join the process group, then run what the kernel sends until told to stop.

This module runs in a process forked by the process server (``forkserver_main``).
Its stdout and stderr file descriptors point at files that the kernel reads,
so output from Python, C++, gloo and NCCL is all captured and a rank can never
block on a full pipe. A traceback of every thread is written to a third file on
SIGUSR1 (``faulthandler``), which is how the kernel learns where a stuck rank is.
"""
import ast
import faulthandler
import io
import os
import pickle
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection

from labsupport.launch import flight, identity
from labsupport.launch.lifetime import die_with_parent, flush_c_stdio
from labsupport.launch.limits import COLLECTIVE_TIMEOUT

NAMESPACE: dict = {}  # globals of %%ranks cells, kept between cells


def warm_imports():
    """Imports every rank needs; done once in the process server, before forking."""
    import cloudpickle  # noqa: F401
    import torch  # noqa: F401

    # A rank's first optimizer step imports torch._dynamo (~1.5 s): paid once
    # here rather than by every rank of every group.
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.utils._pytree  # noqa: F401


def main(fd: int, spec: dict, server_pid: int) -> int:
    die_with_parent(server_pid, watchdog_period=1.0)
    conn = Connection(fd)
    _redirect_output(spec)
    _apply_environment(spec)
    if spec.get("fr_path"):
        flight.install(spec["fr_path"])  # the rank's Flight Recorder, written on SIGUSR2
    try:
        _init_process_group(spec)
    except BaseException as exc:
        conn.send_bytes(pickle.dumps(("error", describe_exception(exc))))
        return 1
    conn.send_bytes(pickle.dumps(("ready", os.getpid())))
    return _serve(conn)


def _redirect_output(spec: dict):
    for fd, path in ((1, spec["out_path"]), (2, spec["err_path"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(target, fd)
        os.close(target)
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    faulthandler.enable(file=2, all_threads=True)  # a segfault leaves a traceback
    stacks = os.open(spec["stack_path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)


def _apply_environment(spec: dict):
    """The kernel's environment, sys.path and working directory as of this start."""
    os.environ.clear()
    os.environ.update(spec["env"])
    sys.path[:] = spec["sys_path"]
    os.chdir(spec["cwd"])
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _init_process_group(spec: dict):
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # A FileStore in the group's private (0700) directory: no TCP port to pick,
    # so no collisions between users, and nothing listening for strangers.
    store = dist.FileStore(spec["store_path"], spec["world_size"])
    # The call's deadline, kept by the kernel, is the only one that ends a hang:
    # this group and every group made on this rank (dist.new_group, a DeviceMesh)
    # wait longer than any deadline (see limits).
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = COLLECTIVE_TIMEOUT
    # torch read TORCH_DISTRIBUTED_DEBUG when the process server imported it, before
    # this rank had the kernel's environment: read it again (DETAIL wraps every group
    # made from now on and checks each collective's fingerprint across ranks).
    dist.set_debug_level_from_env()
    dist.init_process_group(spec["backend"], store=store, rank=spec["rank"],
                            world_size=spec["world_size"], timeout=COLLECTIVE_TIMEOUT,
                            device_id=device if device.type == "cuda" else None)
    identity.STATE.update(rank=spec["rank"], world_size=spec["world_size"], device=device,
                 backend=spec["backend"])
    from labsupport.launch import strict_p2p
    strict_p2p.install()  # NCCL's point-to-point rules on gloo, if LABSUPPORT_P2P=strict
    NAMESPACE.update(rank=spec["rank"], world_size=spec["world_size"],
                     local_rank=spec["rank"], device=device, dist=dist, torch=torch,
                     __name__="__main__")


def _serve(conn: Connection) -> int:
    while True:
        try:
            kind, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the kernel is gone
            return 0
        if kind == "exit":
            _leave_group()
            return 0
        reply = _execute(kind, payload)
        sys.stdout.flush()
        sys.stderr.flush()
        flush_c_stdio()
        conn.send_bytes(reply)


def _execute(kind: str, payload) -> bytes:
    import cloudpickle
    try:
        if kind == "run":
            fn, args, kwargs = cloudpickle.loads(payload)
            value = fn(*args, **kwargs)
        else:
            value = _exec_cell(*payload)
    except BaseException as exc:  # SystemExit too: a rank must not vanish mid-group
        _settle_gpu_after(exc)
        return pickle.dumps(("error", describe_exception(exc)))
    try:
        _wait_for_gpu()
        return pickle.dumps(("ok", _dump_result(value)))
    except BaseException as exc:
        return pickle.dumps(("error", describe_exception(exc)))


def _exec_cell(source: str, filename: str):
    """Run a %%ranks cell; like IPython, return the value of a final expression."""
    tree = ast.parse(source, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), NAMESPACE)
    if last is not None:
        return eval(compile(ast.Expression(last.value), filename, "eval"), NAMESPACE)
    return None


def _wait_for_gpu():
    """Wait for the GPU work the function queued, inside the run's deadline.

    NCCL collectives and CUDA kernels run after the Python call that queued
    them has returned: without this, a hang or a device-side assert would
    surface in a later, unrelated run. A rank stuck here at the deadline is
    reported as such (``errors.format_stack_dump``).
    """
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()


AFTER_ERROR_WAIT = 5.0  # s: how long a rank whose function raised waits for its GPU


def _settle_gpu_after(exc: BaseException):
    """After the function raised: wait for its queued GPU work too, so that it
    runs (or fails) in this run, not in a later one; what went wrong there is
    added to ``exc`` as a note. Waited for at most AFTER_ERROR_WAIT seconds in a
    thread (synchronize cannot be interrupted): the reader gets the function's
    error, not a deadline; a rank whose work is stuck then is replaced with the
    group, as after any failure (``cluster._collect_or_abort``).
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    failed = []

    def wait():
        try:
            _wait_for_gpu()
        except BaseException as gpu_exc:
            failed.append(gpu_exc)
    waiter = threading.Thread(target=wait, name="labsupport-gpu-wait", daemon=True)
    waiter.start()
    waiter.join(AFTER_ERROR_WAIT)
    if waiter.is_alive():
        exc.add_note(f"(labsupport: the GPU work this rank had queued had not completed "
                     f"{AFTER_ERROR_WAIT:g} s after the error: an NCCL operation the other "
                     f"ranks did not match, or a CUDA kernel that never ends)")
    elif failed:
        exc.add_note(f"(labsupport: waiting for this rank's queued GPU work afterwards "
                     f"failed too: {type(failed[0]).__name__}: {failed[0]})")


def _dump_result(value) -> bytes:
    from labsupport.launch import cpu_pickle
    try:
        return cpu_pickle.dumps(value)
    except Exception as exc:
        raise TypeError(f"the return value ({type(value).__name__}) cannot be sent back to "
                        f"the notebook: {exc}. Return tensors, numbers or plain "
                        "containers.") from None


def describe_exception(exc: BaseException) -> dict:
    """A picklable description of an exception, its chain and its frames."""
    te = traceback.TracebackException.from_exception(exc, lookup_lines=False)
    desc = _describe(te)
    try:  # the exception object itself, for callers that want to inspect it
        import cloudpickle
        desc["pickled"] = cloudpickle.dumps(exc.with_traceback(None))
    except Exception:
        desc["pickled"] = None
    return desc


def _describe(te: traceback.TracebackException) -> dict:
    return {
        "type": te.exc_type.__name__ if te.exc_type else "Exception",
        "text": "".join(te.format_exception_only()).rstrip("\n"),
        "frames": [(f.filename, f.lineno, f.name) for f in te.stack if f.filename != __file__],
        "cause": _describe(te.__cause__) if te.__cause__ else None,
        "context": (_describe(te.__context__)
                    if te.__context__ and not te.__suppress_context__ else None),
    }


def _leave_group():
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
