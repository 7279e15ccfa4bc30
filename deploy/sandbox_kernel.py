"""Start a grading kernel as the unprivileged sandbox user, with limits.

nbgrader runs as root (it must read the hidden tests and the gradebook) and
starts its kernel through a kernel spec that deploy/grade_sandboxed.py writes
for each submission; that spec runs this script, as root, which:

1. copies the connection file (the kernel's sockets and HMAC key, written by
   jupyter_client for root only) into the submission's job folder;
2. moves to a network namespace of its own, with only its own loopback up:
   the student's code cannot reach the hub, a server, or the internet (to
   send away what it sees), yet ranks still talk over 127.0.0.1. The kernel
   talks to nbgrader over Unix sockets in the job folder (``transport=ipc``),
   which the namespace does not cut;
3. sets the limits, hard, so the student's code cannot raise them:
   address space per process (``RLIMIT_AS``), processes and threads of the
   sandbox user (``RLIMIT_NPROC``), CPU seconds per process (``RLIMIT_CPU``),
   no core files, no file over 1 GiB;
4. drops to the sandbox user with no supplementary groups, checks that root
   cannot be regained, and replaces itself with the kernel, in the job
   folder's ``work/`` (a copy of the submission's files, never the
   autograded notebook that holds the hidden tests), with HOME and TMPDIR in
   the job folder and an environment rebuilt from a short list, so nothing
   of root's environment (tokens, paths) reaches the student's code, and
   IPython's history kept in memory (on disk, a later cell could read the
   hidden tests' source from it).

    python sandbox_kernel.py --user USER --job DIR --memory BYTES --processes N
                             --cpu-seconds S -- CONNECTION_FILE [KERNEL ARGS...]
"""
import argparse
import ctypes
import fcntl
import os
import pwd
import resource
import shutil
import socket
import struct
import sys
from pathlib import Path

KEEP = ("LANG", "LC_ALL", "PYTHONPATH", "LABSUPPORT_GRADING_TIMEOUT", "LABSUPPORT_CPUS",
        "NBGRADER_EXECUTION", "JPY_PARENT_PID")
FILE_SIZE = 1 << 30
CLONE_NEWNET = 0x40000000  # <sched.h>
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1  # <linux/sockios.h>, <net/if.h>


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--user", required=True)
    parser.add_argument("--job", required=True, type=Path)
    parser.add_argument("--memory", required=True, type=int, help="bytes per process")
    parser.add_argument("--processes", required=True, type=int)
    parser.add_argument("--cpu-seconds", required=True, type=int)
    parser.add_argument("connection_file")
    parser.add_argument("kernel_args", nargs=argparse.REMAINDER)
    return parser.parse_args(argv)


def sandbox_account(name):
    """The sandbox user's passwd entry; root, or a user with root's group, refused."""
    account = pwd.getpwnam(name)
    if account.pw_uid == 0 or account.pw_gid == 0:
        sys.exit(f"sandbox_kernel: {name} is root or in root's group: refusing to run "
                 "students' code as it")
    return account


def environment(account, job):
    env = {k: os.environ[k] for k in KEEP if k in os.environ}
    env.update(HOME=str(job / "home"), TMPDIR=str(job / "tmp"), USER=account.pw_name,
               LOGNAME=account.pw_name, CUDA_VISIBLE_DEVICES="",
               PATH=f"{Path(sys.executable).parent}:/usr/bin:/bin")
    return env


def isolate_network():
    """A network namespace of this process's own, its loopback up (unshare(2), netdevice(7))."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        sys.exit(f"sandbox_kernel: no network namespace ({os.strerror(ctypes.get_errno())}): "
                 "grading needs root with CAP_SYS_ADMIN; refusing to run students' code "
                 "with the network open")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | IFF_UP, b""))


def limit(args):
    for which, value in ((resource.RLIMIT_AS, args.memory),
                         (resource.RLIMIT_NPROC, args.processes),
                         (resource.RLIMIT_CPU, args.cpu_seconds),
                         (resource.RLIMIT_CORE, 0), (resource.RLIMIT_FSIZE, FILE_SIZE)):
        resource.setrlimit(which, (value, value))


def become(account):
    os.setgroups([])
    os.setgid(account.pw_gid)
    os.setuid(account.pw_uid)
    try:
        os.setuid(0)
    except PermissionError:
        return
    sys.exit("sandbox_kernel: root could be regained after dropping it: refusing")


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    if os.geteuid() != 0:
        sys.exit("sandbox_kernel: must start as root (it drops to the sandbox user)")
    account = sandbox_account(args.user)
    connection = args.job / "connection.json"
    shutil.copyfile(args.connection_file, connection)
    os.chown(connection, account.pw_uid, account.pw_gid)
    os.chmod(connection, 0o600)
    env = environment(account, args.job)
    isolate_network()
    limit(args)
    become(account)
    os.umask(0o077)
    os.chdir(args.job / "work")
    kernel_args = [a for a in args.kernel_args if a != "--"]
    os.execve(sys.executable, [sys.executable, "-m", "ipykernel_launcher", "-f",
                               str(connection), "--HistoryManager.hist_file=:memory:",
                               *kernel_args], env)


if __name__ == "__main__":
    main()
