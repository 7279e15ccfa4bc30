"""A temporary class on this machine for the hub tests (tests/test_jupyterhub.py)
and the hub's load benchmark (python -m labsupport.bench hub): Unix groups and users
with names no other run uses, their homes under a fresh folder of /home, the
course's Python made reachable for them; all of it removed afterwards.

Root only (CI runs as root). Every name starts with a prefix made of 6 random
hex digits (``lh3fa9c2alice``), so two runs never collide, and removal touches
only what this run created: its users (their processes ended first, then
``userdel``), its groups, its folder, the files its users left in /tmp,
/var/tmp and /dev/shm, and the access it granted on the course's Python.

That access: the project's interpreter may live where other users cannot
reach it (pyenv under /root, mode 0700, on this project's machine). For the
duration of the tests, POSIX ACL entries let this run's own groups (and no
one else) traverse such a folder (``x``, not list it); removal takes exactly
those entries out again, and the ACL with them when nothing else is left in
it (the plain mode back). Entries of another run are left alone, so two runs
at once, or one after a run that was killed, work.
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

ROOT = Path(__file__).resolve().parent.parent  # the repository
sys.path.insert(0, str(ROOT / "deploy"))
import private_sources  # noqa: E402
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
        self.accounts, self.groups, self._acl_dirs, self._modes = {}, [], [], {}

    def create(self, students, instructors, outsiders=(), sandbox=None):
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
        if sandbox:
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
        """Let the students' and the python group traverse (x) every folder on the way
        to the interpreter and the repository that others may not."""
        import grp
        gids = {grp.getgrnam(g).gr_gid for g in (self.students_group, self.python_group)}
        targets = [Path(os.path.realpath(sys.executable)), Path(sys.base_prefix), ROOT]
        for folder in sorted({p for t in targets for p in [t, *t.parents] if p.is_dir()}):
            if not os.stat(folder).st_mode & 0o001:
                entries = read_acl(folder)
                write_acl(folder, entries + [(ACL_GROUP, 1, gid) for gid in sorted(gids)])
                self._acl_dirs.append((folder, gids))

    def close_sources(self):
        """What the one-node guide closes, and the class hub refuses to start without:
        the instructors' assignments and the git history (it holds them too),
        go-rwx until remove() puts their modes back."""
        for path in [private_sources.ASSIGNMENTS, *private_sources.git_folders()]:
            self._modes.setdefault(path, stat.S_IMODE(path.stat().st_mode))
            os.chmod(path, self._modes[path] & ~0o077)

    def remove(self):
        """Everything this run created, in an order that works after any failure."""
        problems = []
        for path, mode in self._modes.items():
            os.chmod(path, mode)
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
        for folder, gids in self._acl_dirs:  # only this run's entries: another run's stay
            write_acl(folder, [e for e in read_acl(folder) if not (e[0] == ACL_GROUP
                                                                    and e[2] in gids)])
        shutil.rmtree(self.base, ignore_errors=True)
        uid_processes.remove_files_of(uids)
        if problems:
            raise RuntimeError("; ".join(problems))


# POSIX ACLs as the kernel stores them in the xattr (acl_ea.h): a version, then
# (tag, permissions, id) entries sorted by tag and id.
ACL_USER_OBJ, ACL_USER, ACL_GROUP_OBJ, ACL_GROUP, ACL_MASK, ACL_OTHER = 1, 2, 4, 8, 0x10, 0x20
NO_ID = 0xFFFFFFFF


def read_acl(folder):
    """The folder's ACL entries: its stored ACL, or the three its mode stands for."""
    try:
        data = os.getxattr(folder, ACL_XATTR)
    except OSError:
        mode = stat.S_IMODE(os.stat(folder).st_mode)
        return [(ACL_USER_OBJ, mode >> 6 & 7, NO_ID), (ACL_GROUP_OBJ, mode >> 3 & 7, NO_ID),
                (ACL_OTHER, mode & 7, NO_ID)]
    return [struct.unpack_from("<HHI", data, 4 + 8 * i) for i in range((len(data) - 4) // 8)]


def write_acl(folder, entries):
    """Store entries (a mask computed here); with no named entry, the plain mode."""
    base = {tag: perm for tag, perm, _ in entries if tag in (ACL_USER_OBJ, ACL_GROUP_OBJ,
                                                             ACL_OTHER)}
    named = sorted({e for e in entries if e[0] in (ACL_USER, ACL_GROUP)}, key=lambda e: e[::2])
    if not named:
        try:
            os.removexattr(folder, ACL_XATTR)
        except OSError:
            pass
        os.chmod(folder, base[ACL_USER_OBJ] << 6 | base[ACL_GROUP_OBJ] << 3 | base[ACL_OTHER])
        return
    mask = base[ACL_GROUP_OBJ]
    for _, perm, _ in named:
        mask |= perm
    ordered = sorted([(tag, perm, NO_ID) for tag, perm in base.items()] + named
                     + [(ACL_MASK, mask, NO_ID)], key=lambda e: (e[0], e[2]))
    os.setxattr(folder, ACL_XATTR, struct.pack("<I", 2)
                + b"".join(struct.pack("<HHI", *e) for e in ordered))
