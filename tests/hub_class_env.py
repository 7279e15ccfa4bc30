"""A temporary class on this machine for the hub tests: Unix groups and users
with names no other run uses, their homes under a fresh folder of /home, the
course's Python made reachable for them; all of it removed afterwards.

Root only (CI runs as root). Every name starts with a prefix made of 6 random
hex digits (``lh3fa9c2alice``), so two runs never collide, and removal touches
only what this run created: its users (their processes ended first, then
``userdel``), its groups, its folder, the files its users left in /tmp,
/var/tmp and /dev/shm, and the access it granted on the course's Python.

That access: the project's interpreter may live where other users cannot
reach it (pyenv under /root, mode 0700, on this project's machine). For the
duration of the tests, a POSIX ACL entry lets this run's own group (and no
one else) traverse such a folder (``x``, not list it); removal restores the
folder's mode and drops the ACL. A folder that already carries an ACL is left
alone, and the tests then skip saying why.
"""
import os
import pwd
import secrets
import shutil
import stat
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "deploy"))
import uid_processes  # noqa: E402

ACL_XATTR = "system.posix_acl_access"


@dataclass
class Account:
    name: str
    password: str
    uid: int
    home: Path


def run(*command, stdin=None):
    done = subprocess.run(command, input=stdin, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")


class TemporaryClass:
    """Groups (students, instructors, python), accounts, a folder; see module docstring."""

    def __init__(self):
        self.prefix = "lh" + secrets.token_hex(3)
        self.base = Path("/home") / f"{self.prefix}-class"
        self.students_group = f"{self.prefix}-students"
        self.instructors_group = f"{self.prefix}-instructors"
        self.python_group = f"{self.prefix}-python"  # all but the outsider: the interpreter
        self.accounts, self.groups, self._acl_dirs = {}, [], []

    def create(self, students, instructors, outsiders, sandbox):
        """Each role: a list of short names (alice ...). The sandbox is a system user."""
        self.base.mkdir(mode=0o755)
        os.chmod(self.base, 0o755)
        (self.base / "homes").mkdir(mode=0o755)
        for group in (self.students_group, self.instructors_group, self.python_group):
            run("groupadd", group)
            self.groups.append(group)
        for short, group in ([(s, self.students_group) for s in students]
                             + [(i, self.instructors_group) for i in instructors]
                             + [(o, None) for o in outsiders]):
            self._add_person(short, group)
        self._add_sandbox(sandbox)

    def _add_person(self, short, group):
        name, password = self.prefix + short, secrets.token_urlsafe(12)
        home = self.base / "homes" / short
        groups = ",".join(g for g in (group, self.python_group) if g)
        # HOME_MODE 0755: the hub's spawner must make it 0700 itself.
        run("useradd", "--create-home", "--home-dir", str(home), "--groups", groups,
            "--shell", "/bin/bash", "-K", "HOME_MODE=0755", name)
        self.accounts[short] = Account(name, password, pwd.getpwnam(name).pw_uid, home)
        run("chpasswd", stdin=f"{name}:{password}\n")

    def _add_sandbox(self, short):
        name = self.prefix + short
        # Its primary group reaches the interpreter: the sandbox drops every other group.
        run("useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
            "--shell", "/usr/sbin/nologin", "--gid", self.python_group, name)
        self.accounts[short] = Account(name, "", pwd.getpwnam(name).pw_uid, Path("/nonexistent"))

    def grant_python(self):
        """Let the students' and the python group traverse every folder on the way to
        the interpreter and the repository that others may not. None, or why not."""
        import grp
        gids = sorted(grp.getgrnam(g).gr_gid for g in (self.students_group, self.python_group))
        targets = [Path(os.path.realpath(sys.executable)), Path(sys.base_prefix), ROOT]
        for folder in sorted({p for t in targets for p in [t, *t.parents] if p.is_dir()}):
            mode = stat.S_IMODE(os.stat(folder).st_mode)
            if mode & 0o001:
                continue
            try:
                os.getxattr(folder, ACL_XATTR)
                return f"{folder} already has an ACL, which this test will not change"
            except OSError:
                pass
            os.setxattr(folder, ACL_XATTR, posix_acl(mode, gids))
            self._acl_dirs.append((folder, mode))
        return None

    def remove(self):
        """Everything this run created, in an order that works after any failure."""
        problems = []
        for account in self.accounts.values():
            try:
                uid_processes.end_all(account.uid)
            except Exception as e:  # keep removing the rest
                problems.append(str(e))
        uids = {a.uid for a in self.accounts.values()}
        for account in self.accounts.values():
            subprocess.run(["userdel", account.name], capture_output=True)
        for group in self.groups:
            subprocess.run(["groupdel", group], capture_output=True)
        for folder, mode in self._acl_dirs:
            os.removexattr(folder, ACL_XATTR)
            os.chmod(folder, mode)
        shutil.rmtree(self.base, ignore_errors=True)
        uid_processes.remove_files_of(uids)
        if problems:
            raise RuntimeError("; ".join(problems))


def posix_acl(mode, gids):
    """The binary ACL (version 2) of a folder with mode, plus x for the groups gids."""
    undefined = 0xFFFFFFFF
    entries = [(0x01, (mode >> 6) & 7, undefined), (0x04, (mode >> 3) & 7, undefined),
               *[(0x08, 1, gid) for gid in gids], (0x10, ((mode >> 3) & 7) | 1, undefined),
               (0x20, mode & 7, undefined)]
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)
