"""Every process of one Unix user, found and ended: what is left of a student's
server after it stops (a detached process, a rank started with nohup), and of
a graded submission (deploy/grade_sandboxed.py); and the files such a user
left in the shared temporary folders (`remove_files_of`).

`end_all(uid)` does not walk a list of pids and signal each one: a process that
forks faster than the list is read (a fork bomb) would outrun it. It forks a
child that becomes that user and calls ``kill(-1, SIGKILL)``: the kernel then
signals, in one call, every process the user may signal (all of theirs, and
nothing of anyone else's; ``kill(2)``), and it repeats until none is left.
Root only. Standard library only (the hub imports it).
"""
import os
import pwd
import shutil
import signal
import time
from pathlib import Path

SHARED_TMP = (Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"))


def pids_of(uid):
    """Live (not zombie) processes whose real user id is uid."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines()
                          if ":" in line)
        except OSError:  # ended while we read
            continue
        if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
            found.append(int(status.parent.name))
    return found


def end_all(uid, timeout=10.0):
    """SIGKILL every process of uid until none is left; the pids that were ended.

    Raises RuntimeError if some survive ``timeout`` seconds (say, stuck in the
    kernel), and refuses uid 0: this ends a user's work, never the system's.
    """
    if uid == 0:
        raise ValueError("end_all(0) would end every process of root: refused")
    ended, deadline = set(), time.monotonic() + timeout
    while pids := pids_of(uid):
        ended.update(pids)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes of uid {uid} still alive {timeout:g} s after "
                               f"SIGKILL: {sorted(pids)}")
        _kill_all_as(uid)
        time.sleep(0.05)
    return sorted(ended)


def _kill_all_as(uid):
    """A child that becomes uid (no groups) and sends SIGKILL to all it may signal."""
    gid = pwd.getpwuid(uid).pw_gid
    child = os.fork()
    if child == 0:  # only system calls here: the parent may have threads
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(child, 0)


def remove_files_of(uids, folders=SHARED_TMP):
    """Remove what these users own at the top of the shared temporary folders
    (a whole folder when they own it, never following a symlink); the paths."""
    removed = []
    for folder in folders:
        for entry in folder.iterdir():
            try:
                if entry.lstat().st_uid not in uids:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink()
                removed.append(entry)
            except FileNotFoundError:
                pass
    return removed
