"""train/warm_start.py: a run forked from a starter that imported torch once is the run a fresh `python -m hopperlm`
process is (the same losses to the bit, the same exit codes and error lines, signals by its pid), and wherever it
cannot be one, the caller is told to start a fresh process."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hopperlm.train import warm_start
from hopperlm.train.warm_start import WarmStarter, starter_for

REPO = Path(__file__).resolve().parents[1]
RECIPE = """model:
  preset: null
  dim: 32
  n_layers: 1
  n_heads: 2
  max_seq_len: 32
data:
  path: {data}
optim:
  lr: 3.0e-3
train:
  seq_len: 32
  micro_batch: 4
  max_steps: {steps}
  eval_every: 0
  eval_windows: 2
  log_every: 2
  device: cpu
checkpoint:
  every: {every}
log:
  report: false
  tensorboard: false
"""
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def starter():
    warm, why = WarmStarter.launch(ENV)
    assert warm is not None, why
    yield warm
    warm.close()


def recipe(tmp_path, data, steps=6, every=0) -> Path:
    path = tmp_path / f"r{steps}.yaml"
    path.write_text(RECIPE.format(data=data, steps=steps, every=every))
    return path


def losses(run_dir: Path) -> list:
    return [json.loads(line).get("loss") for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_warm_run_trains_to_the_same_losses_as_a_fresh_process(starter, shakespeare_bytes, tmp_path):
    path = recipe(tmp_path, shakespeare_bytes)
    argv = [sys.executable, "-m", "hopperlm", "train", str(path), "--run.out_dir", str(tmp_path / "cold")]
    cold = subprocess.run(argv, capture_output=True, text=True, env=ENV, cwd=tmp_path)
    proc = starter.start(["train", str(path), "--run.out_dir", str(tmp_path / "warm")], ENV, str(tmp_path))
    stdout, stderr = proc.communicate(timeout=120)
    assert cold.returncode == 0 and proc.returncode == 0, stderr[-2000:]
    assert proc.cpu_s is not None and proc.cpu_s > 0  # its own CPU, as the starter's wait4 saw it
    warm_result = json.loads((tmp_path / "warm" / "result.json").read_text())
    cold_result = json.loads((tmp_path / "cold" / "result.json").read_text())
    assert (
        warm_result["val_loss"] == cold_result["val_loss"]
    )  # to the bit: the same process, minus its imports
    assert losses(tmp_path / "warm") == losses(tmp_path / "cold")
    assert "done: max_steps after 6 steps" in stdout and "done: max_steps after 6 steps" in cold.stdout
    assert same_lines(stderr, cold.stderr, tmp_path) and same_lines(stdout, cold.stdout, tmp_path)
    # it read its arguments as a fresh process does: the same config, but for the folder it was given
    warm_config = (tmp_path / "warm" / "config.yaml").read_text().replace(str(tmp_path / "warm"), "OUT")
    assert warm_config == (tmp_path / "cold" / "config.yaml").read_text().replace(
        str(tmp_path / "cold"), "OUT"
    )


def test_bad_input_exits_as_a_fresh_process_does(starter, tmp_path):
    argv = ["train", str(tmp_path / "missing.yaml")]
    cold = subprocess.run([sys.executable, "-m", "hopperlm", *argv], capture_output=True, text=True, env=ENV)
    proc = starter.start(argv, ENV, str(tmp_path))
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == cold.returncode == 2
    assert stderr.strip().splitlines()[-1] == cold.stderr.strip().splitlines()[-1]
    assert "missing.yaml" in stderr and not proc.stderr_path.exists()  # its files go once read


@pytest.mark.slow
def test_signals_reach_the_run_by_its_pid(starter, shakespeare_bytes, tmp_path):
    """SIGINT: the run saves its step and stops, as a fresh one does; SIGKILL: Popen's -9."""
    path = recipe(tmp_path, shakespeare_bytes, steps=100_000, every=10_000)
    proc = starter.start(["train", str(path), "--run.out_dir", str(tmp_path / "int")], ENV, str(tmp_path))
    wait_for(lambda: (tmp_path / "int" / "metrics.jsonl").exists())
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    result = json.loads((tmp_path / "int" / "result.json").read_text())
    assert (
        result["stopped_by"] == "signal SIGINT" and proc.returncode == 130
    )  # as `hopperlm train` exits on Ctrl-C
    killed = starter.start(["train", str(path), "--run.out_dir", str(tmp_path / "kill")], ENV, str(tmp_path))
    wait_for(lambda: (tmp_path / "kill" / "metrics.jsonl").exists())
    killed.send_signal(signal.SIGKILL)
    assert killed.wait(timeout=60) == -signal.SIGKILL


def test_another_environment_or_a_lost_starter_means_a_fresh_process(tmp_path):
    warm, why = WarmStarter.launch(ENV)
    assert warm is not None, why
    assert (
        warm.start(["--version"], {**ENV, "OMP_NUM_THREADS": "2"}) is None
    )  # torch read the other at import
    version = warm.start(["--version"], ENV)
    assert version.wait(timeout=60) == 0 and "hopperlm" in version.communicate()[0]
    warm.proc.kill()
    warm.reader.join(timeout=30)
    assert warm.start(["--version"], ENV) is None
    warm.close()


def test_a_caller_killed_without_its_clean_up_leaves_no_folder_behind(tmp_path):
    """The caller ends without closing the starter (a second Ctrl-C ends a sweep at once; here SIGKILL): the
    starter sees its requests end, exits and removes the folder of the runs' output."""
    caller = (
        "import os, sys; from hopperlm.train.warm_start import WarmStarter\n"
        "warm, why = WarmStarter.launch({**os.environ, 'OMP_NUM_THREADS': '1'})\n"
        "run = warm.start(['--version'], warm.env); run.wait(timeout=60)\n"
        "print(warm.folder, warm.proc.pid, flush=True); sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", caller], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    folder, pid = proc.stdout.readline().split()
    assert (Path(folder) / "starter.err").is_file()
    proc.kill()
    proc.wait(timeout=60)
    wait_for(lambda: not Path(folder).exists() and not warm_start.alive(int(pid)))


@pytest.mark.slow
def test_a_run_outlives_a_lost_starter_and_ends_as_failed_not_hung(shakespeare_bytes, tmp_path):
    """The starter killed mid-run: the run goes on, is watched by its pid (a zombie nobody reaps counts as
    ended), is signalled directly, and ends with status 1 (its real status died with the starter)."""
    warm, why = WarmStarter.launch(ENV)
    assert warm is not None, why
    path = recipe(tmp_path, shakespeare_bytes, steps=100_000, every=10_000)
    proc = warm.start(["train", str(path), "--run.out_dir", str(tmp_path / "run")], ENV, str(tmp_path))
    wait_for(lambda: (tmp_path / "run" / "metrics.jsonl").exists())
    warm.proc.kill()
    warm.reader.join(timeout=30)
    assert warm.gone.is_set() and proc.poll() is None and warm_start.alive(proc.pid)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.3)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == 1
    assert warm.start(["--version"], ENV) is None  # nothing asked of a starter that is gone: start fresh
    warm.close()


def test_where_runs_cannot_start_warm_one_line_says_why(monkeypatch):
    import torch

    said = []
    monkeypatch.setattr(warm_start, "_shared", {})
    monkeypatch.setenv("HOPPERLM_WARM_START", "0")
    assert starter_for(ENV, said.append) is None and starter_for(ENV, said.append) is None
    assert said == ["warm starts: off, each run starts a fresh process: HOPPERLM_WARM_START=0"]  # once
    monkeypatch.delenv("HOPPERLM_WARM_START")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "a CUDA device is present" in warm_start.cold_reason()


def same_lines(warm: str, cold: str, tmp_path: Path) -> bool:
    """The same output but for its numbers (times, speeds) and the runs' folders."""

    def norm(text: str, folder: str) -> list[str]:
        return [
            re.sub(r"[0-9][0-9.,]*", "N", line.replace(str(tmp_path / folder), "OUT"))
            for line in text.splitlines()
        ]

    return norm(warm, "warm") == norm(cold, "cold")


def wait_for(ready, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize(
    "body, code",
    [("pass", 0), ("sys.exit(3)", 3), ("sys.exit('no such file')", 1), ("raise ValueError('x')", 1),
     ("raise KeyboardInterrupt", -signal.SIGINT)],
)  # fmt: skip
def test_a_child_exits_with_the_status_the_interpreter_would_give(body, code):
    """run_and_exit, the forked child's exit, against the interpreter's own for the same body."""
    fresh = subprocess.run([sys.executable, "-c", f"import sys\n{body}"], capture_output=True, text=True)
    script = f"import sys\nfrom hopperlm.train.warm_start import run_and_exit\ndef run():\n    {body}\n"
    script += "run_and_exit(run)"
    ours = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert ours.returncode == fresh.returncode == code
    assert (ours.stderr.strip().splitlines() or [""])[-1] == (fresh.stderr.strip().splitlines() or [""])[-1]
