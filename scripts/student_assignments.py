#!/usr/bin/env python3
"""The student version of every assignment, for a learner working alone.

    make student-assignments            # into assignments/ (ignored by git)
    .venv/bin/python scripts/student_assignments.py DIR [assignment ...]

Runs nbgrader's own ``generate_assignment`` (what an instructor runs before
releasing), in a scratch course directory, so the instructors' course
(notebooks/assignments/: gradebook, release/) is left as it was. Each
solution region becomes ``raise NotImplementedError()`` and the hidden tests
go; the visible checks stay, so running the notebook in JupyterLab says
whether an answer passes them. Writes DIR/<assignment>/<assignment>.ipynb and
refuses to overwrite a notebook a learner may have edited (delete it first).
"""
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "notebooks" / "assignments" / "source"


def assignments() -> list[str]:
    return sorted(p.name for p in SOURCE.iterdir() if (p / f"{p.name}.ipynb").exists())


def generate(names: list[str], out: Path) -> list[Path]:
    made = []
    # nbgrader runs the `alembic` tool from PATH: this interpreter's environment's.
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    with tempfile.TemporaryDirectory(prefix="student-") as course:
        shutil.copytree(SOURCE, Path(course) / "source")
        for name in names:
            target = out / name / f"{name}.ipynb"
            if target.exists():
                print(f"kept {target.relative_to(out.parent)} (yours; delete it for a fresh copy)")
                continue
            # From the repository root: nbgrader reads nbgrader_config.py there.
            proc = subprocess.run(
                [sys.executable, "-m", "nbgrader", "generate_assignment", name, "--force",
                 f"--CourseDirectory.root={course}", "--log-level=WARN"],
                cwd=ROOT, env=env, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"nbgrader generate_assignment {name} failed:\n{proc.stderr[-3000:]}")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(course) / "release" / name / f"{name}.ipynb", target)
            made.append(target)
            print(f"made {target}")
    return made


def main(argv) -> int:
    out = Path(argv[0] if argv else "assignments").resolve()
    names = argv[1:] or assignments()
    unknown = sorted(set(names) - set(assignments()))
    if unknown:
        sys.exit(f"no such assignment: {', '.join(unknown)} "
                 f"(there are: {', '.join(assignments())})")
    generate(names, out)
    print(f"open them in JupyterLab (make lab) under {out}; "
          "run every cell: the visible checks say whether your answer passes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
