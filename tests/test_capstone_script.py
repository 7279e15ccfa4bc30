# Run: PYTHONPATH=$PWD .venv/bin/python -m pytest tests/test_capstone_script.py (~80 s)
"""The capstone as a script under torchrun (``python -m labsupport.capstone.run``).

Four ranks train at dp, tp, pp, cp = 2, 1, 2, 1 for 4 steps, saving every 2;
four ranks resume from the newest checkpoint at 1, 2, 2, 1 up to step 6. The
log holds the command, the machine, a progress line per step (loss, bits per
byte, tokens/s, MFU, ETA) and the saves, and its losses are one process's
(``trainer.reference``) within the parity tolerance. Arguments that cannot
work stop every rank with one message, before any process group is made. The
recorded long run the chapter reads back is this script's: its first command,
re-run for 10 steps, prints the loss its log printed at step 10.
"""
import os
import re
import subprocess
import sys

import pytest

from labsupport.capstone import checkpoint, compare, run, trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"step +(\d+)/(\d+) \| loss (\d+\.\d{6}) \| (\d+\.\d{4}) bits/byte \| "
                  r"([\d,]+) tok/s \| MFU (\d+\.\d\d)% \| ETA (\d+:\d\d:\d\d)"
                  r"( \| saved (\S+))?$")


def torchrun(nproc, *args, cwd):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={nproc}", "-m", "labsupport.capstone.run", *args],
        capture_output=True, text=True, timeout=240, cwd=cwd, env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The log of a run saved at 2x1x2x1 and resumed at 1x2x2x1."""
    cwd = tmp_path_factory.mktemp("script")
    common = ["--checkpoint-every", "2", "--checkpoint-dir", "ckpt",
              "--log-file", "run.log"]
    first = torchrun(4, "--dp", "2", "--pp", "2", "--steps", "4", *common, cwd=cwd)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    second = torchrun(4, "--tp", "2", "--pp", "2", "--steps", "6", "--resume", *common,
                      cwd=cwd)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    return cwd, (cwd / "run.log").read_text().splitlines(), first.stdout + second.stdout


def test_the_log_says_what_ran_and_a_line_per_step(runs):
    cwd, log, stdout = runs
    assert log[0] == ("# torchrun --nproc-per-node 4 -m labsupport.capstone.run --dp 2 "
                      "--pp 2 --steps 4 --checkpoint-every 2 --checkpoint-dir ckpt "
                      "--log-file run.log")
    assert re.match(r"# \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC \| .+ \| torch .+, gloo",
                    log[1])
    assert "layout dp=2 tp=1 pp=2 cp=1 (4 ranks)" in log[2]
    assert "peak: measured float32" in log[3]
    assert ("# resuming from ckpt/step000004: step 4, saved at dp, tp, pp, cp = "
            "(2, 1, 2, 1)") in log
    steps = [LINE.match(line) for line in log if line.startswith("step")]
    assert all(steps), [line for line in log if line.startswith("step")]
    assert [(int(m[1]), int(m[2])) for m in steps] == [(1, 4), (2, 4), (3, 4), (4, 4),
                                                        (5, 6), (6, 6)]
    assert [m[9] for m in steps] == [None, "ckpt/step000002", None, "ckpt/step000004",
                                     None, "ckpt/step000006"]
    for m in steps:
        bits = trainer.bits_per_byte(float(m[3]))
        assert float(m[4]) == pytest.approx(bits, abs=1e-4)
        assert int(m[5].replace(",", "")) > 0 and float(m[6]) > 0
    assert sum(line.startswith("# done") for line in log) == 2
    assert all(line in stdout for line in log)                      # printed, too
    assert sorted(os.listdir(cwd / "ckpt")) == ["step000002", "step000004",
                                                "step000006"]


def test_the_resumed_losses_are_one_process_losses(runs):
    log = runs[1]
    got = [float(LINE.match(line)[3]) for line in log if line.startswith("step")]
    want = trainer.reference(6)["losses"]
    for k, (a, b) in enumerate(zip(got, want)):
        # the tolerance, plus the printed 6 decimals' rounding
        assert abs(a - b) <= compare.LOSS_RTOL * abs(b) + 5e-7, (k, got, want)


def test_the_wrong_world_size_stops_every_rank_with_one_message(tmp_path):
    proc = torchrun(2, "--dp", "2", "--tp", "2", "--steps", "2", cwd=tmp_path)
    assert proc.returncode != 0
    assert ("error: dp x tp x pp x cp = 2 x 2 x 1 x 1 needs 4 ranks, and 2 were "
            "started: run torchrun --nproc-per-node 4") in proc.stderr
    assert proc.stderr.count("needs 4 ranks") == 1                 # said by rank 0 only


@pytest.mark.parametrize("argv, message", [
    (["--heads", "3"], "hidden=32 must be divisible by heads=3"),
    (["--tp", "3"], "divisible"),
    (["--pp", "3"], "cannot split 2 blocks into 3 pipeline stages"),
    (["--dp", "3"], "--batch 8 does not split over dp=3"),
    (["--micro-batches", "3"],
     "8 sequences per replica do not split into --micro-batches 3"),
    (["--cp", "3"], "cp=3 must divide it"),
    (["--checkpoint-every", "2"], "need --checkpoint-dir"),
    (["--dp", "0"], "every degree must be >= 1"),
])
def test_arguments_that_cannot_work_are_named(argv, message):
    args = run.parser().parse_args(argv)
    world = max(args.dp, 1) * args.tp * args.pp * args.cp
    found = run.problems(args, world)
    assert any(message in p for p in found), found


def test_a_resume_of_another_run_is_refused_before_starting(runs):
    cwd = runs[0]
    args = run.parser().parse_args(["--steps", "8", "--batch", "4", "--hidden", "16",
                                    "--resume", "--checkpoint-dir", str(cwd / "ckpt")])
    found = " ".join(run.problems(args, 1))
    assert "batch=8 saved, 4 here" in found and "hidden=32 saved, 16 here" in found
    args = run.parser().parse_args(["--steps", "6", "--resume", "--checkpoint-dir",
                                    str(cwd / "ckpt")])
    assert "at step 6: --steps 6 leaves nothing to train" in " ".join(
        run.problems(args, 1))
    assert checkpoint.latest(str(cwd / "ckpt")).endswith("step000006")


RECORDED = os.path.join(ROOT, "notebooks", "recorded",
                        "capstone_run_2x2x2x1_2026-11-28.log")


def test_the_recorded_longer_run_is_a_log_of_this_script():
    """The chapter shows this log (made by the command at its top, on this course's
    2-core machine): each segment's header, a line per 10 steps, the saves, a
    falling loss, and the resumed segment continuing from the last save."""
    with open(RECORDED) as f:
        log = f.read().splitlines()
    commands = [line for line in log if line.startswith("# torchrun")]
    assert log[0] == commands[0] and len(commands) == 2
    assert "--dp 2 --tp 2 --pp 2 --cp 1 --steps 1500" in commands[0]
    assert "--dp 4 --tp 1 --pp 2 --cp 1 --steps 1800" in commands[1]
    assert "--resume" in commands[1]
    steps = [LINE.match(line) for line in log if line.startswith("step")]
    assert all(steps)
    assert [int(m[1]) for m in steps] == list(range(10, 1801, 10))
    assert [m[9] for m in steps if m[9]] == [f"/tmp/capstone_ckpt/step{k:06d}"
                                             for k in (500, 1000, 1500)]
    assert ("# resuming from /tmp/capstone_ckpt/step001500: step 1500, saved at "
            "dp, tp, pp, cp = (2, 2, 2, 1)") in log
    losses = [float(m[3]) for m in steps]
    assert losses[0] > 3.0 and max(losses[-10:]) < 1.6      # nats per byte


def test_the_recorded_run_is_reproduced_by_this_code(tmp_path):
    """The log is this code's: its first command, re-run for its first 10 steps
    (the same layout, decoder, batch, micro-batches, learning rate and seeds; only
    --steps, where the log and the checkpoints go changed), prints the loss the
    log printed at step 10, within the parity tolerance and the printed 6
    decimals. Sequence parallelism is on in both (tp = 2 here)."""
    with open(RECORDED) as f:
        log = f.read().splitlines()
    argv = log[0].split(" -m labsupport.capstone.run ")[1].split()
    nproc = int(log[0].split("--nproc-per-node ")[1].split()[0])
    changed = {"--steps": "10", "--log-file": "again.log", "--checkpoint-dir": "ckpt",
               "--checkpoint-every": "0"}
    for flag, value in changed.items():
        argv[argv.index(flag) + 1] = value
    proc = torchrun(nproc, *argv, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    again = [LINE.match(line) for line in (tmp_path / "again.log").read_text()
             .splitlines() if line.startswith("step")]
    logged = next(LINE.match(line) for line in log if line.startswith("step"))
    assert int(logged[1]) == int(again[-1][1]) == 10
    want, got = float(logged[3]), float(again[-1][3])
    assert abs(got - want) <= compare.LOSS_RTOL * abs(want) + 5e-7, (got, want)
