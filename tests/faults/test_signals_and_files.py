"""Preemption signals, corrupted checkpoints and shards, unwritable output, a full disk."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from signals_in_steps import signal_inside_step  # (tests/ is on the path: its conftest)
from test_ctrl_c import records  # each logged step's loss, LR, grad norm and val loss

from hopperlm.checkpoint import layout, single
from hopperlm.checkpoint.layout import latest_checkpoint, list_checkpoints
from hopperlm.config import load_config
from hopperlm.data.loader import TokenShards
from hopperlm.errors import CheckpointError, DataError
from hopperlm.observe.metrics import read_metrics
from hopperlm.parallel.preemption import Preemption
from hopperlm.train.loop import train

REPO = Path(__file__).resolve().parents[2]
QUIET = lambda line: None  # noqa: E731


def config(data, run, *extra):
    return load_config(
        REPO / "configs" / "debug.yaml", ["--data.path", str(data), "--run.out_dir", str(run), *extra]
    )


def start(data, run, *extra):
    cmd = [
        sys.executable,
        "-m",
        "hopperlm",
        "train",
        "configs/debug.yaml",
        "--data.path",
        str(data),
        "--run.out_dir",
        str(run),
        "--train.log_every",
        "1",
        "--checkpoint.every",
        "0",
        *extra,
    ]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_step(run, step, proc, timeout=900.0):
    """Until the run has logged `step` lines; the deadline only catches a hang (a busy machine is slow, not stuck)."""
    deadline = time.time() + timeout
    path = Path(run) / "metrics.jsonl"
    while time.time() < deadline and proc.poll() is None:
        if path.exists() and len(path.read_text().splitlines()) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"run did not reach step {step}")


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 0), (signal.SIGUSR1, 124)])
def test_preemption_signal_checkpoints_and_exits(shakespeare_bytes, tmp_path, sig, code):
    run = tmp_path / "run"
    proc = start(
        shakespeare_bytes, run, "--train.max_steps", "100000", "--train.requeue_exit_code", str(code)
    )
    wait_for_step(run, 5, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == code, err
    assert f"{sig.name} received" in out and "done: signal" in out
    ckpt = latest_checkpoint(run)
    assert ckpt is not None and layout.verify_checkpoint(ckpt) is None
    stopped = int(ckpt.name.split("_")[1])
    # resume continues from there
    result = train(
        config(shakespeare_bytes, run, "--train.max_steps", str(stopped + 3), "--train.log_every", "1"),
        resume=True,
        log=QUIET,
    )
    assert result.step == stopped + 3


@pytest.mark.parametrize("stop, due", [(7, False), (9, True)])
def test_a_signal_stop_evaluates_only_what_is_due_and_resumes_exactly(
    shakespeare_bytes, tmp_path, monkeypatch, stop, due
):
    """A scheduler's warning may be shorter than a validation (or lm-eval tasks): the step a signal stops at is
    checkpointed after only what the schedule had due there, as an uninterrupted run evaluates it, so the
    resumed run's records equal that run's. The last line and result.json say where their val loss is from."""
    run, whole = tmp_path / "run", tmp_path / "whole"
    steps = ["--train.log_every", "1", "--train.eval_every", "3", "--checkpoint.every", "0"]
    signal_inside_step(stop, patch=monkeypatch.setattr)
    lines = []
    result = train(config(shakespeare_bytes, run, "--train.max_steps", "100", *steps), log=lines.append)
    assert result.stopped_by == "signal SIGTERM" and result.step == stop
    assert latest_checkpoint(run).name == f"step_{stop:06d}"
    validated = {r[0]: r[4] for r in records(run) if r[4] is not None}
    assert list(validated) == [3, 6, 9][: 2 + due]
    last = max(validated)
    done = next(line for line in lines if line.startswith("done: "))
    at = "" if due else f" at step {last}"
    assert done.endswith(f"| val loss {validated[last]:.4f}{at} (best {result.best_val_loss:.4f})"), done
    saved = json.loads((run / "result.json").read_text())
    assert saved["val_step"] == last and saved["val_loss"] == validated[last]

    monkeypatch.undo()
    train(config(shakespeare_bytes, run, "--train.max_steps", "12", *steps), resume=True, log=QUIET)
    train(config(shakespeare_bytes, whole, "--train.max_steps", "12", *steps), log=QUIET)
    assert records(run) == records(whole)  # every step's loss, LR, grad norm and val loss, bitwise


def test_a_signal_at_the_step_that_reaches_the_target_ends_the_run_there(
    shakespeare_bytes, tmp_path, monkeypatch
):
    """The target is reached at a validation the schedule had due where a signal stopped the run: the run is
    done, as it would be without the signal (a resume would train past it)."""
    signal_inside_step(3, patch=monkeypatch.setattr)
    cfg = config(shakespeare_bytes, tmp_path / "run", "--train.max_steps", "100", "--train.log_every", "1",
                 "--train.eval_every", "3", "--train.target_loss", "100")  # fmt: skip
    result = train(cfg, log=QUIET)
    assert (result.stopped_by, result.step) == ("target_loss", 3)


def test_second_signal_is_immediate(monkeypatch):
    killed = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append(sig))
    before = signal.getsignal(signal.SIGUSR1)
    with Preemption(QUIET) as p:
        signal.raise_signal(signal.SIGUSR1)
        assert p.requested == "SIGUSR1" and killed == []
        p._handle(signal.SIGUSR1, None)  # the second one: default action, now
        assert killed == [signal.SIGUSR1]
    assert signal.getsignal(signal.SIGUSR1) == before  # the handlers of the caller are back


def test_corrupt_latest_checkpoint_falls_back(shakespeare_bytes, tmp_path):
    run = tmp_path / "run"
    train(config(shakespeare_bytes, run, "--train.max_steps", "20", "--checkpoint.every", "10"), log=QUIET)
    newest = latest_checkpoint(run)
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated
    lines = []
    result = train(
        config(shakespeare_bytes, run, "--train.max_steps", "25", "--checkpoint.every", "10"),
        resume=True,
        log=lines.append,
    )
    assert any("step_000020 is corrupt (model.safetensors does not match" in line for line in lines)
    assert any("resuming from" in line and "step_000010" in line for line in lines)
    assert result.step == 25
    # everything corrupt: a clear error, nothing loaded
    for ckpt in list_checkpoints(run):
        (ckpt / "optimizer.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        train(config(shakespeare_bytes, run, "--train.max_steps", "40"), resume=True, log=QUIET)


def test_corrupted_shard_is_detected(shakespeare_bytes, tmp_path):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(shakespeare_bytes, data)
    shard = data / "train_000000.bin"
    raw = bytearray(shard.read_bytes())
    raw[1000] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="does not match its sha256"):
        train(config(data, tmp_path / "run", "--data.verify", "true"), log=QUIET)
    shard.write_bytes(bytes(raw[:-10]))  # truncated: caught even without verify
    with pytest.raises(DataError, match="truncated"):
        TokenShards(data, "train")


def test_unwritable_output_dir(shakespeare_bytes, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match="is not writable"):
        train(config(shakespeare_bytes, blocker / "run"), log=QUIET)
    assert blocker.read_text() == "not a directory"


def test_full_disk_keeps_previous_checkpoint(shakespeare_bytes, tmp_path, monkeypatch):
    run = tmp_path / "run"
    real_save = single.torch.save
    calls = [0]

    def save(obj, path, *a, **k):
        calls[0] += 1
        if "step_000020" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(single.torch, "save", save)
    lines = []
    result = train(  # (the default, stop, is tested in tests/test_disk_full.py)
        config(shakespeare_bytes, run, "--train.max_steps", "30", "--checkpoint.every", "10",
               "--checkpoint.on_disk_full", "continue"),
        log=lines.append,
    )  # fmt: skip
    assert result.step == 30
    warning = [line for line in lines if "could not write checkpoint step_000020" in line]
    assert warning and "no space left on device" in warning[0] and "step_000010 is intact" in warning[0]
    assert [c.name for c in list_checkpoints(run)] == ["step_000010", "step_000030"]
    assert not list((run / "checkpoints").glob("*.tmp-*"))
    assert json.loads((run / "checkpoints" / "step_000010" / "state.json").read_text())["step"] == 10


class Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/hopperlm-pwned",))


def test_tampered_checkpoint_never_unpickles_code(shakespeare_bytes, tmp_path):
    import torch

    run = tmp_path / "run"
    train(config(shakespeare_bytes, run, "--train.max_steps", "10", "--checkpoint.every", "10"), log=QUIET)
    ckpt = latest_checkpoint(run)
    torch.save({"optimizer": Payload()}, ckpt / "optimizer.pt")
    sums = json.loads((ckpt / "checksums.json").read_text())  # an attacker who also fixes the checksums
    sums["optimizer.pt"] = single.file_sha256(ckpt / "optimizer.pt")
    (ckpt / "checksums.json").write_text(json.dumps(sums))
    Path("/tmp/hopperlm-pwned").unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match="unreadable"):
        train(config(shakespeare_bytes, run, "--train.max_steps", "20"), resume=True, log=QUIET)
    assert not Path("/tmp/hopperlm-pwned").exists()


def test_generate_and_export_skip_a_corrupt_newest_checkpoint(shakespeare_bytes, tmp_path, capsys):
    run = tmp_path / "run"
    train(config(shakespeare_bytes, run, "--train.max_steps", "20", "--checkpoint.every", "10"), log=QUIET)
    (latest_checkpoint(run) / "rng.pt").write_bytes(b"")
    assert layout.resolve_model_dir(run).name == "step_000010"
    assert "step_000020 is corrupt" in capsys.readouterr().err
    for ckpt in list_checkpoints(run):
        (ckpt / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="every checkpoint in .* is corrupt"):
        layout.resolve_model_dir(run)


@pytest.mark.slow
def test_signal_mid_step_drops_the_partial_step_and_resumes_exactly(shakespeare_bytes, tmp_path):
    """A step of 128 micro-batches (far longer than a short preemption warning): the signal stops the run at
    the next micro-batch boundary, the last complete step is checkpointed with the stream's position, and the
    resumed run's losses equal those of a run that was never interrupted."""
    long_step = ["--train.micro_batch", "4", "--train.batch_tokens", str(4 * 64 * 128)]
    long_step += ["--data.sampling", "sequential", "--train.eval_every", "0"]
    run = tmp_path / "run"
    # the SIGTERM arrives inside step 3, once its micro-batch 1 is drawn (sent from outside, it could land in
    # the step's last micro-batch, which then completes)
    runner = [sys.executable, str(Path(__file__).with_name("kill_runner.py")), "sigterm-mid-step", "3", "--"]
    args = ["train", "configs/debug.yaml", "--data.path", shakespeare_bytes, "--run.out_dir", run,
            "--train.max_steps", "1000", "--train.log_every", "1", "--checkpoint.every", "0", *long_step]  # fmt: skip
    proc = subprocess.run([*runner, *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr
    assert "step 3 dropped after 2 of 128 micro-batches; checkpointing step 2" in out.splitlines(), out
    exit_line = [line for line in out.splitlines() if line.startswith("exit ") and "after SIGTERM" in line]
    assert exit_line, out
    stopped = int(latest_checkpoint(run).name.split("_")[1])
    assert stopped == 2
    assert read_metrics(run / "metrics.jsonl")[-1]["step"] == 2  # no partial step was counted

    steps = ["--train.log_every", "1", "--checkpoint.every", "0", *long_step]
    train(
        config(shakespeare_bytes, run, "--train.max_steps", str(stopped + 2), *steps), resume=True, log=QUIET
    )
    whole = tmp_path / "whole"
    train(config(shakespeare_bytes, whole, "--train.max_steps", str(stopped + 2), *steps), log=QUIET)
    resumed = [(r["step"], r["loss"]) for r in read_metrics(run / "metrics.jsonl")]
    uninterrupted = [(r["step"], r["loss"]) for r in read_metrics(whole / "metrics.jsonl")]
    assert resumed == uninterrupted
