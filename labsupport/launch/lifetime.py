"""Process-lifetime helpers shared by the process server and the ranks (Linux)."""
import ctypes
import os
import signal
import threading
import time

PR_SET_PDEATHSIG = 1


def die_with_parent(expected_ppid: int, watchdog_period: float | None = None,
                    pdeathsig: bool = True):
    """Exit when the parent exits, even if it is killed with SIGKILL.

    The kernel asks for SIGKILL at its death (prctl PR_SET_PDEATHSIG). That
    signal is tied to the parent *thread*, and is lost if the parent died
    before the call, so the parent PID is checked right after, and, with a
    ``watchdog_period``, again by a daemon thread. ``pdeathsig=False`` when
    the parent thread may end before the parent process (a child started
    from a short-lived thread): then only the parent PID is watched.
    """
    try:
        if not pdeathsig:
            raise OSError("parent-death signal not wanted")
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:  # not Linux/glibc, or not wanted: the watchdog still works
        watchdog_period = watchdog_period or 0.5
    if os.getppid() != expected_ppid:
        os._exit(1)
    if watchdog_period:
        threading.Thread(target=_watch, args=(expected_ppid, watchdog_period),
                         name="labsupport-watchdog", daemon=True).start()


def _watch(expected_ppid: int, period: float):
    while True:
        time.sleep(period)
        if os.getppid() != expected_ppid:
            os._exit(1)


def flush_c_stdio():
    """Flush C-level stdio buffers (printf from C/C++ extensions) into our files."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


def describe_status(status: int | None) -> str:
    """'exit code 3' / 'signal SIGSEGV' from a waitpid status."""
    if status is None:
        return "no exit status yet"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            return f"signal {signal.Signals(sig).name}"
        except ValueError:
            return f"signal {sig}"
    return f"exit code {os.WEXITSTATUS(status)}"
