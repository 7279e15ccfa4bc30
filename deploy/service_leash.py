"""A hub service on a leash: it ends when the hub process that started it ends.

JupyterHub (6.1.1) starts a managed service (the idle culler) as a child
process and stops it when the hub stops cleanly. A hub that crashes (SIGKILL,
the OOM killer) stops nothing: its culler ran on as root, and the restarted
hub started a second one; every crash added one. Here the service's command
is run through this module, which asks Linux to send it SIGTERM when its
parent dies (``prctl(PR_SET_PDEATHSIG)``, kept across the ``exec`` of the
service since nothing in it changes credentials), checks that the parent has
not already died, then becomes the service (``exec``: same pid, the hub still
sees and stops its own child).

    python deploy/service_leash.py HUB_PID -- python -m jupyterhub_idle_culler ...

Linux only. Standard library only.
"""
import ctypes
import os
import signal
import sys
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def command(service, hub_pid=None):
    """The command that runs service (a list) leashed to hub_pid (default: this process,
    which is the hub when its configuration file calls this)."""
    return [sys.executable, str(Path(__file__).resolve()), str(hub_pid or os.getpid()), "--",
            *service]


def main(argv):
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: service_leash.py HUB_PID -- COMMAND...")
    hub = int(argv[0])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        sys.exit(f"service_leash: prctl failed: {os.strerror(ctypes.get_errno())}")
    if os.getppid() != hub:  # the hub died before the leash was on: no service for no hub
        sys.exit(f"service_leash: the hub (pid {hub}) is gone; not starting {argv[2]}")
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
