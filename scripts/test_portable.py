"""nbval over every chapter under this CPU's instruction set and two others.

A chapter's stored outputs must hold on any x86-64 CPU (issue 34): MKL,
oneDNN and ATen pick their kernels by instruction set, so the last bits of a
matmul, a LayerNorm or a softmax differ from one CPU to the next. This runs
nbval (the same command as tests/test_notebooks.py) once per setting below,
each telling PyTorch, MKL and oneDNN to use fewer instructions than this CPU
has, which changes those last bits on one machine as another CPU would:

  native   what this CPU offers (AVX-512 where it has it)
  default  ATen's kernels without vector extensions, oneDNN at SSE4.1, MKL
           at SSE4.2: the oldest x86-64 code paths (on an AVX-512 AMD EPYC,
           this changes a matmul, a sum, a LayerNorm, a softmax, a GELU)
  avx2     ATen, oneDNN and MKL at AVX2: a CPU without AVX-512 (on the same
           machine, this changes a softmax and a GELU)

Every setting must give the stored outputs (after tests/nbval_sanitize.cfg).
Run it before submitting a change to a chapter: `make test-portable`, or
    .venv/bin/python scripts/test_portable.py [notebooks/NN_x.ipynb ...] \
        [--settings native,default,avx2]
It exits 1 and names each (setting, chapter, cell) that differs; nbval's
diffs for each setting are in _build/portable/<setting>.log.
"""
import argparse
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SANITIZE = ROOT / "tests" / "nbval_sanitize.cfg"
LOGS = ROOT / "_build" / "portable"

# What each setting adds to the environment of nbval, its kernels and their
# ranks (labsupport's launcher gives the ranks the kernel's environment).
SETTINGS = {
    "native": {},
    "default": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}
# Set outside, these would make "native" something else; each setting sets its own.
CLEARED = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def chapters() -> list[Path]:
    return sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def environment(setting: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(SETTINGS[setting])
    # The suite's own environment (conftest.py sets it too; kept explicit here).
    env.setdefault("LABSUPPORT_P2P", "strict")
    env.setdefault("LABSUPPORT_BACKEND", "gloo")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def failed_cells(junit: Path) -> list[tuple[str, str]]:
    """[(notebook file name, cell name)] of the cases that failed or errored."""
    if not junit.exists():
        return [("(nbval did not finish)", "")]
    bad = []
    for case in ET.parse(junit).iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            file = Path(case.get("file") or case.get("classname")).name
            bad.append((file, case.get("name")))
    return bad


def run(setting: str, paths: list[Path], logs: Path) -> list[tuple[str, str]]:
    logs.mkdir(parents=True, exist_ok=True)
    junit, log = logs / f"{setting}.xml", logs / f"{setting}.log"
    junit.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"),
           "-p", "no:cacheprovider", "--nbval", "--nbval-current-env",
           "--nbval-sanitize-with", str(SANITIZE), f"--junitxml={junit}",
           "-o", "junit_family=xunit1", *map(str, paths)]
    with open(log, "w") as out:
        subprocess.run(cmd, cwd=ROOT, env=environment(setting), stdout=out,
                       stderr=subprocess.STDOUT)
    return failed_cells(junit)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="chapters to check (default: every chapter)")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument("--log-dir", type=Path, default=LOGS,
                        help=f"where nbval's logs go (default {LOGS})")
    args = parser.parse_args(argv)
    paths = [p.resolve() for p in args.notebooks] or chapters()
    settings = args.settings.split(",")
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown setting(s) {unknown}; known: {list(SETTINGS)}")
    bad = {}
    for setting in settings:
        print(f"[{setting}] nbval over {len(paths)} notebook(s) "
              f"{SETTINGS[setting] or '(this CPU)'}", flush=True)
        bad[setting] = run(setting, paths, args.log_dir)
        for file, cell in bad[setting]:
            print(f"[{setting}] DIFFERS {file} {cell}", flush=True)
        print(f"[{setting}] {'ok' if not bad[setting] else 'FAILED'} "
              f"(log: {args.log_dir / (setting + '.log')})", flush=True)
    failed = [s for s in settings if bad[s]]
    print("portable: " + ("every setting gives the stored outputs" if not failed
                          else f"outputs differ under {', '.join(failed)}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
