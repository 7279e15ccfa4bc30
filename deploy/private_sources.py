"""What students must not read on the hub's node: the instructors' assignments
(``notebooks/assignments``: solutions, hidden tests, submissions) and the
repository's git history, which holds every version of
``notebooks/assignments/source`` (``git show HEAD:notebooks/assignments/source/...``
prints a solution to anyone who can read the objects, whatever the mode of
the working tree's folder).

`folders()` lists them, `readable(uid, gid)` says which of them that Unix
identity can read a file of (asked as that identity), and `refusals(found)`
says what to do about each, as sentences.
Used by the class hub (hub_settings.py, a stand-in student) and by the
grading sandbox (grade_sandboxed.py, the sandbox user). Standard library only.
"""
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository
ASSIGNMENTS = ROOT / "notebooks" / "assignments"

# Run as the identity under test, given one path a line: the first it may read.
# A shell, not the course's Python: the stand-in may not reach the latter.
PROBE = 'while IFS= read -r f; do if [ -r "$f" ]; then echo "$f"; exit 0; fi; done'


def git_folders(root=ROOT):
    """Where the history lives: .git; for a worktree (.git a file naming its folder),
    that folder and the main repository's (``commondir``, where the objects are);
    any other object store the repository borrows from (``objects/info/alternates``)."""
    dot = root / ".git"
    if dot.is_file():
        pointer = dot.read_text().strip()
        if not pointer.startswith("gitdir:"):
            return []
        found = [(root / pointer.removeprefix("gitdir:").strip()).resolve()]
    elif dot.is_dir():
        found = [dot.resolve()]
    else:
        return []  # a copy without history
    if (found[0] / "commondir").is_file():
        found.append((found[0] / (found[0] / "commondir").read_text().strip()).resolve())
    alternates = found[-1] / "objects" / "info" / "alternates"
    if alternates.is_file():
        found += [(found[-1] / "objects" / line).resolve()
                  for line in alternates.read_text().splitlines() if line and line[0] != "#"]
    return list(dict.fromkeys(found))


def folders(root=ROOT):
    return [f for f in [root / "notebooks" / "assignments", *git_folders(root)] if f.exists()]


def readable(uid, gid, root=ROOT):
    """{folder: a file in it that uid (in group gid and no other) may read}, or None
    if the check could not run (not root). The kernel decides, as for a student:
    modes, groups and ACLs all count, and a file in a folder that may be crossed
    but not listed is found by its name."""
    found = {}
    for folder in folders(root):
        files = "".join(f"{p}\n" for p in sorted(folder.rglob("*")) if p.is_file())
        try:
            run = subprocess.run(["/bin/sh", "-c", PROBE], input=files, user=uid, group=gid,
                                 extra_groups=[], capture_output=True, text=True, cwd="/",
                                 timeout=120, env={"PATH": "/usr/bin:/bin"})
        except (OSError, subprocess.SubprocessError):
            return None
        if run.returncode:
            return None
        if run.stdout.strip():
            found[str(folder)] = run.stdout.strip()
    return found


def open_to_all(root=ROOT):
    """The fallback where the probe cannot run: folders whose mode lets anyone in."""
    return {str(f): str(f) for f in folders(root) if os.stat(f).st_mode & 0o007}


def refusals(found, who):
    """A sentence per folder of found (readable's answer) saying what to do."""
    problems = []
    for folder, example in found.items():
        if Path(folder).parts[-2:] == ("notebooks", "assignments"):
            problems.append(f"{folder} (solutions, hidden tests, submissions) can be read by "
                            f"{who} ({example}): chmod -R go-rwx {folder}")
        else:
            problems.append(
                f"the repository's git history in {folder} can be read by {who} ({example}): "
                "it holds every version of notebooks/assignments/source (solutions, hidden "
                f"tests), which `git show` prints. chmod 700 {folder} (git keeps working for "
                "its owner), or serve the course from a copy without the sources and their "
                "history (book/jupyterhub.md, 'A class on one node')")
    return problems
