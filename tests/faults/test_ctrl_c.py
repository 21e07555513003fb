"""Ctrl-C (SIGINT) costs no work: `train` and `sweep` save, write the report, say how to resume and exit 130; the
resumed run equals an uninterrupted one bitwise; a second Ctrl-C exits at once, saying what it throws away."""

import json
import math
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_mixture_sweep import SWEEP, tiny  # noqa: F401 - the mixture sweep's tiny base, data and recipe (a fixture)
from test_sweep import RECIPE  # the sweep tests' tiny μP recipe (tests/ is on the path: its conftest)

from hopperlm.checkpoint.layout import checkpoint_dir, latest_checkpoint, list_checkpoints
from hopperlm.config import load_config
from hopperlm.observe.metrics import read_metrics
from hopperlm.train.loop import train

REPO = Path(__file__).resolve().parents[2]
QUIET = lambda line: None  # noqa: E731
# 16 micro-batches a step: the Ctrl-C lands mid-step, whose partial work is dropped (and redone on resume)
LONG_STEP = ["--train.micro_batch", "4", "--train.batch_tokens", str(4 * 64 * 16)]


def popen(*args) -> subprocess.Popen:
    """`hopperlm ARGS` as a user types it (`hopperlm` is this Python's module)."""
    cmd = [sys.executable, "-m", "hopperlm", *map(str, args)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_lines(root: Path, lines: int, proc: subprocess.Popen, timeout: float = 900.0) -> None:
    """Until a metrics.jsonl under `root` (the run, or a sweep's run) has `lines` records; the deadline only
    catches a hang."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        found = sorted(root.glob("**/metrics.jsonl"))
        if found and len(found[0].read_text().splitlines()) >= lines:
            return
        time.sleep(0.05)
    raise AssertionError(f"no metrics.jsonl under {root} reached {lines} records; {proc.poll()=}")


def records(run: Path) -> list[tuple]:
    return [
        (r["step"], r["loss"], r["lr"], r["grad_norm"], r.get("val_loss"))
        for r in read_metrics(run / "metrics.jsonl")
    ]


@pytest.mark.slow
def test_ctrl_c_saves_says_how_to_resume_and_the_resume_is_exact(shakespeare_bytes, tmp_path):
    run = tmp_path / "run"
    args = ["train", "configs/debug.yaml", "--data.path", str(shakespeare_bytes), "--run.out_dir", str(run),
            "--train.max_steps", "30", "--train.log_every", "1", "--checkpoint.every", "0", *LONG_STEP]  # fmt: skip
    proc = popen(*args)
    wait_for_lines(run, 4, proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err
    assert "Ctrl-C: stopping at the next micro-batch boundary" in out
    saved = int(latest_checkpoint(run).name.split("_")[1])
    assert 4 <= saved < 30 and [c.name for c in list_checkpoints(run)] == [latest_checkpoint(run).name]
    command = shlex.join(["hopperlm", *args, "--resume"])  # the user's own command line, with --resume
    line = f"saved step {saved} to {checkpoint_dir(run, saved)}; resume with: {command}"
    assert out.splitlines()[-1] == line
    assert json.loads((run / "result.json").read_text())["stopped_by"] == "signal SIGINT"
    assert (run / "report.md").is_file()  # the report too (a scheduler's preemption skips it)

    # the printed command, run as printed, goes on to the end
    again = shlex.split(command)
    resumed = popen(*again[1:])
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    assert f"resuming from {checkpoint_dir(run, saved)}" in out
    whole = tmp_path / "whole"
    overrides = args[2:]
    overrides[overrides.index(str(run))] = str(whole)
    train(load_config(REPO / "configs" / "debug.yaml", overrides), log=QUIET)
    assert records(run) == records(whole)  # every step's loss, LR, grad norm and val loss, bitwise
    ours, theirs = (load_file(checkpoint_dir(r, 30) / "model.safetensors") for r in (run, whole))
    assert ours.keys() == theirs.keys() and all(ours[k].equal(theirs[k]) for k in ours)


@pytest.mark.slow
def test_a_second_ctrl_c_exits_at_once_saying_what_is_lost(shakespeare_bytes, tmp_path):
    run = tmp_path / "run"
    # Ctrl-C while step 5 trains (the runner presses it, so the stop is always after step 5, never at a save);
    # writing the stop's checkpoint then takes a minute, and the second Ctrl-C (the test's) is pressed once it has
    # begun: it lands in the save, however loaded the machine
    args = ["train", "configs/debug.yaml", "--data.path", shakespeare_bytes, "--run.out_dir", run,
            "--train.max_steps", "400", "--train.log_every", "1", "--checkpoint.every", "3",
            "--train.eval_every", "0"]  # fmt: skip
    runner = [sys.executable, str(Path(__file__).with_name("kill_runner.py")), "ctrl-c", "5", "--"]
    proc = subprocess.Popen([*runner, *map(str, args)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    for line in proc.stdout:  # (the run flushes every line)
        if line.startswith("kill_runner: the stop's checkpoint sleeps"):
            break
    else:
        raise AssertionError(f"the stop's checkpoint never began; exit {proc.wait()}: {proc.stderr.read()}")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == -signal.SIGINT, err  # ended by the signal itself: a shell sees 130
    # steps 4 and 5 trained since the checkpoint of step 3
    assert (
        out.splitlines()[-1]
        == "second Ctrl-C: exiting without saving; steps 4-5 are lost (last checkpoint: step 3)"
    )
    assert latest_checkpoint(run).name == checkpoint_dir(run, 3).name  # the one cut short is not listed
    # step 5 is logged, unvalidated: a signal's stop saves first
    last = read_metrics(run / "metrics.jsonl")[-1]
    assert last["step"] == 5 and "val_loss" not in last
    assert not (run / "result.json").exists() and not (run / "report.md").exists()


@pytest.mark.slow
def test_ctrl_c_stops_a_sweep_with_its_runs_saved_and_its_resume_finishes_it(shakespeare_bytes, tmp_path):
    recipe, out = tmp_path / "tiny-mup.yaml", tmp_path / "sweep"
    recipe.write_text(RECIPE.format(data=shakespeare_bytes))
    # steps of 8 micro-batches: the 51 steps left after the third line take long enough that the forwarded
    # Ctrl-C surely lands in the run (it stops at the next micro-batch boundary), however loaded the machine
    args = ["sweep", str(recipe), "--lr", "3e-4,3e-3,1e-2", "--dim", "32", "--max-steps", "60",
            "--train.batch_tokens", str(8 * 64 * 8), "--out", str(out)]  # fmt: skip
    proc = popen(*args)
    wait_for_lines(out, 3, proc)
    proc.send_signal(signal.SIGINT)  # to the sweep alone: it forwards it to its run, once
    stdout, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err
    first = out / "lr-0.0003-seed-1337"
    saved = latest_checkpoint(first)
    assert saved is not None
    assert json.loads((first / "result.json").read_text())["stopped_by"] == "signal SIGINT"
    assert sorted(p.name for p in out.glob("lr-*")) == [first.name]  # no run started after the Ctrl-C
    step = int(saved.name.split("_")[1])
    command = shlex.join(["hopperlm", *args, "--resume"])
    assert stdout.splitlines()[-1] == (
        f"sweep: stopped by Ctrl-C: 0 of 3 runs finished, 1 saved mid-run (lr 0.0003 seed 1337 at step {step}), "
        f"2 not started; resume with: {command}"
    )

    resumed = popen(*shlex.split(command)[1:])
    stdout, err = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, err
    assert f"resuming from {saved}" in (first / "sweep.log").read_text()
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    assert [(r["stopped_by"], r["final_val_loss"] is not None) for r in rows] == [("max_steps", True)] * 3


@pytest.mark.slow
def test_ctrl_c_stops_a_mixture_sweep_with_its_runs_saved_and_its_resume_finishes_it(tiny, tmp_path):  # noqa: F811
    """`sweep --mixture`, stopped while continuing its proxies' bases: the run in progress saves its step, none
    starts after it, one line gives the sweep's own command with --resume, and that command resumes the run from
    its checkpoint and finishes the sweep (the law fitted, mixture.json written)."""
    out = tmp_path / "sweep"
    # continued runs of 120 steps, so the Ctrl-C lands in one (the bases stay the tiny ones: a few steps each)
    args = ["sweep", tiny["recipe"], *SWEEP, "--out", out, "--train.max_tokens", str(120 * 128)]
    proc = popen(*args)
    deadline = time.time() + 600
    while proc.poll() is None and time.time() < deadline:
        found = sorted(out.glob("width-*/ratio-*/seed-*/metrics.jsonl"))
        if found and len(found[0].read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)  # to the sweep alone: it forwards it to its run, once
    stdout, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err
    interrupted = [p.parent for p in out.glob("width-*/ratio-*/seed-*/result.json")
                   if json.loads(p.read_text())["stopped_by"] == "signal SIGINT"]  # fmt: skip
    assert len(interrupted) == 1
    saved = latest_checkpoint(interrupted[0])
    assert saved is not None and 3 <= int(saved.name.split("_")[1]) < 120
    assert len(list(out.glob("width-*/ratio-*/seed-*"))) == 1  # no run started after the Ctrl-C
    command = shlex.join(["hopperlm", *map(str, args), "--resume"])
    last = stdout.splitlines()[-1]
    assert last.startswith(
        "sweep: stopped by Ctrl-C: 0 of 9 runs finished, 1 saved mid-run ("
    ) and last.endswith(f", 8 not started; resume with: {command}"), last
    assert not (out / "mixture.json").exists()

    resumed = popen(*shlex.split(command)[1:])
    stdout, err = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, err
    assert f"resuming from {saved}" in (interrupted[0] / "sweep.log").read_text()
    rows = json.loads((out / "mixture.json").read_text())["rows"]
    assert len(rows) == 9 and all(math.isfinite(r["target_loss"]) for r in rows)
