"""Collect and autograde a class's submissions without trusting them.

``nbgrader autograde`` runs each student's notebook, student code included,
with the privileges of whoever runs it; an instructor runs it in the course
directory, next to the solutions, the hidden tests (in ``source/`` and in
``gradebook.db``) and every other student's submission. Here nbgrader still
runs as root (it must read those), but each submission's kernel runs as an
unprivileged sandbox user (deploy/sandbox_kernel.py), one submission at a
time, in a job folder holding a copy of that submission's files only, in a
network namespace of its own (no way out to the hub, a server or the
internet), with limits on memory, processes and CPU time, and a wall-clock
deadline per submission. Between submissions every process of the sandbox user is ended
and its files in /tmp, /var/tmp and /dev/shm removed, so nothing one
submission leaves behind meets the next. The course directory must be
private (mode 0700), so the sandbox user cannot read it at all, and so must
the repository's assignments and git history (private_sources.py): the
sandbox reads the repository, for labsupport.

    sudo .venv/bin/python deploy/grade_sandboxed.py collect ASSIGNMENT --course-dir DIR
    sudo .venv/bin/python deploy/grade_sandboxed.py autograde ASSIGNMENT --course-dir DIR \\
         --sandbox-user labs-sandbox [--student ID ...] [--deadline 1800] [--memory 8G]
         [--processes 1024] [--cpu-seconds 1800]

Any other option (``--Exchange.root=...``, ``--CourseDirectory.course_id=...``,
``--force``) goes to nbgrader as it is. ``collect`` is nbgrader's collect with
the owner check of deploy/nbgrader_collect.py. Exit status 1 if any submission
could not be graded (each one is listed).
"""
import argparse
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import private_sources
import uid_processes

HERE = Path(__file__).resolve().parent
KERNEL = "labs-sandbox"
UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("collect", "autograde"))
    parser.add_argument("assignment")
    parser.add_argument("--course-dir", required=True, type=Path)
    parser.add_argument("--sandbox-user", help="autograde: the user that runs student code")
    parser.add_argument("--student", action="append", default=[])
    parser.add_argument("--deadline", type=int, default=1800, help="s per submission")
    parser.add_argument("--memory", default="8G", help="address space per process")
    parser.add_argument("--processes", type=int, default=1024, help="of the sandbox user")
    parser.add_argument("--cpu-seconds", type=int, default=1800, help="per process")
    return parser.parse_known_args(argv)


def size(text):
    number, unit = text.strip().upper().rstrip("B"), ""
    if number and number[-1] in UNITS:
        number, unit = number[:-1], number[-1]
    if not number.isdigit():
        raise SystemExit(f"grade_sandboxed: --memory {text!r}: give a size such as 8G")
    return int(number) * UNITS[unit]


def nbgrader(args, extra, *command, env=None, timeout=None):
    """Run nbgrader on the course directory, from where this script was started (so
    that it reads the nbgrader_config.py there); its exit status, None at the deadline."""
    argv = [sys.executable, "-m", "nbgrader", *command, args.assignment,
            f"--CourseDirectory.root={args.course_dir}", *extra]
    proc = subprocess.Popen(argv, env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None


def collect(args, extra):
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    status = nbgrader(args, extra, "collect",
                      "--ExchangeFactory.collect=nbgrader_collect.OwnerCheckedCollect",
                      env={"PYTHONPATH": path})
    return 0 if status == 0 else 1


def refusals(args, account):
    """What makes sandboxed grading unsafe or impossible here, as sentences."""
    if os.geteuid() != 0:
        return ["run it as root: nbgrader reads the gradebook, and root drops to the "
                "sandbox user for each kernel"]
    problems = []
    if account.pw_uid == 0 or account.pw_gid == 0:
        problems.append(f"--sandbox-user {account.pw_name} is root or in root's group")
    if busy := uid_processes.pids_of(account.pw_uid):
        problems.append(f"{account.pw_name} already runs processes {busy}: another grading "
                        "run, or one left over; the sandbox user must be used for nothing else")
    if stat.S_IMODE(args.course_dir.stat().st_mode) & 0o077:
        problems.append(f"{args.course_dir} is open to other users (solutions, hidden tests, "
                        f"submissions): chmod 700 {args.course_dir}")
    found = private_sources.readable(account.pw_uid, account.pw_gid)  # None: reported below
    problems += private_sources.refusals(found or {}, f"the sandbox user {account.pw_name}")
    run = subprocess.run([sys.executable, "-c", "import ipykernel, labsupport"], cwd="/",
                         user=account.pw_uid, group=account.pw_gid, extra_groups=[],
                         capture_output=True, text=True, env=_python_env())
    if run.returncode:
        problems.append(f"{account.pw_name} cannot run {sys.executable} with ipykernel and "
                        f"labsupport: {run.stderr.strip()[-300:]}")
    return problems


def _python_env():
    return {k: v for k, v in os.environ.items() if k == "PYTHONPATH"}


def make_job(args, student, account):
    """A folder of the sandbox user's own: work/ (the submission's files but its
    notebooks, then the assignment's own files on top, as nbgrader does), home/, tmp/."""
    job = Path(tempfile.mkdtemp(prefix="grade-", dir="/tmp"))  # /tmp: the sandbox can reach it
    submitted = args.course_dir / "submitted" / student / args.assignment
    source = args.course_dir / "source" / args.assignment
    no_notebooks = shutil.ignore_patterns("*.ipynb", ".ipynb_checkpoints")
    shutil.copytree(submitted, job / "work", ignore=no_notebooks, symlinks=True)  # as links:
    if source.is_dir():  # the sandbox follows one with its own rights only
        shutil.copytree(source, job / "work", ignore=no_notebooks, dirs_exist_ok=True)
    for folder in (job / "home", job / "tmp"):
        folder.mkdir()
    for path in [job, *job.rglob("*")]:
        os.chown(path, account.pw_uid, account.pw_gid, follow_symlinks=False)
    return job


def kernel_spec(args, job, account):
    """A private folder for JUPYTER_PATH with the one kernel spec nbgrader may use."""
    specs = Path(tempfile.mkdtemp(prefix="grade-kernels-", dir="/tmp"))
    spec = specs / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, str(HERE / "sandbox_kernel.py"), "--user", account.pw_name,
            "--job", str(job), "--memory", str(size(args.memory)),
            "--processes", str(args.processes), "--cpu-seconds", str(args.cpu_seconds),
            "--", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps(
        {"argv": argv, "display_name": "Python 3 (sandboxed grading)", "language": "python"}))
    return specs


def grade_one(args, extra, student, account):
    """Autograde one student's submission in the sandbox; a line saying how it went."""
    job = specs = None
    try:
        job = make_job(args, student, account)
        specs = kernel_spec(args, job, account)
        status = nbgrader(args, extra, "autograde", "--student", student,
                          f"--Execute.kernel_name={KERNEL}", "--KernelManager.transport=ipc",
                          f"--KernelManager.ip={job / 'kernel'}",  # Unix sockets, in the job
                          env={"JUPYTER_PATH": str(specs)}, timeout=args.deadline)
    finally:
        uid_processes.end_all(account.pw_uid)
        uid_processes.remove_files_of({account.pw_uid})
        for folder in (job, specs):
            if folder:
                shutil.rmtree(folder, ignore_errors=True)
    if status is None:
        return f"{student}: NOT GRADED, stopped at the {args.deadline} s deadline"
    if status == 0:
        return f"{student}: graded"
    return f"{student}: NOT GRADED (nbgrader exit {status})"


def autograde(args, extra):
    if not args.sandbox_user:
        raise SystemExit("grade_sandboxed: autograde needs --sandbox-user")
    account = pwd.getpwnam(args.sandbox_user)
    if problems := refusals(args, account):
        raise SystemExit("grade_sandboxed: will not grade:\n"
                         + "\n".join(f"  - {p}" for p in problems))
    submitted = args.course_dir / "submitted"
    students = args.student or sorted(p.name for p in submitted.iterdir()
                                      if (p / args.assignment).is_dir())
    lines = [grade_one(args, extra, student, account) for student in students]
    print("grade_sandboxed:\n" + "\n".join(f"  {line}" for line in lines), flush=True)
    return 1 if any("NOT GRADED" in line for line in lines) else 0


def main(argv=None):
    args, extra = parse(sys.argv[1:] if argv is None else argv)
    args.course_dir = args.course_dir.resolve()
    sys.exit((collect if args.command == "collect" else autograde)(args, extra))


if __name__ == "__main__":
    main()
