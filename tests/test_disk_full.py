"""A full disk never costs a run (issue 37): room checked before the work, one line when a write fails, the
run's checkpoint.on_disk_full choice (stop / continue / wait), and no partial file or folder left behind.

The disk fills in two ways here: small tmpfs mounts (root only: CI runs as root; skipped with the reason where
mounting is refused), and ENOSPC injected at the file layer, as torch.save reports it (a RuntimeError from its
zip writer, no errno) or as Python's writes do (OSError errno 28)."""

import errno
import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import torch

from hopperlm.checkpoint.layout import list_checkpoints, verify_checkpoint
from hopperlm.cli import main
from hopperlm.config import load_config
from hopperlm.diskspace import DiskError, write_failure
from hopperlm.files import append_line
from hopperlm.observe.metrics import read_metrics
from hopperlm.train.loop import train

REPO = Path(__file__).resolve().parents[1]
DEBUG = REPO / "configs" / "debug.yaml"
QUIET = lambda line: None  # noqa: E731
# what torch.save raised when the 3 MB run folder filled (the cause chained under it)
TORCH_FULL = "[enforce fail at inline_container.cc:672] . unexpected pos 698432 vs 698324"
# 8 steps, a checkpoint every 2: the third checkpoint is step 6
SHORT = [
    "--train.max_steps",
    "8",
    "--checkpoint.every",
    "2",
    "--train.log_every",
    "2",
    "--checkpoint.keep_last",
    "5",
]


@pytest.fixture
def small_disk(tmp_path):
    """mount(size) -> a fresh tmpfs of that size, unmounted after the test."""
    mounts = []

    def mount(size: str) -> Path:
        where = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
        where.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
        )
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip() or 'not root'})")
        mounts.append(where)
        return where

    yield mount
    for where in mounts:
        subprocess.run(["umount", str(where)], check=False)


def fill_at(monkeypatch, step: int, times: int = 10**9) -> list[int]:
    """torch.save into checkpoint `step` fails as on a full disk, the first `times` attempts."""
    real, attempts = torch.save, []

    def save(obj, f, *args, **kwargs):
        if f"step_{step:06d}.tmp" in str(f) and len(attempts) < times:
            attempts.append(step)
            raise RuntimeError(TORCH_FULL)
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    return attempts


def debug_config(data_dir, run_dir, *overrides):
    return load_config(
        DEBUG, ["--data.path", str(data_dir), "--run.out_dir", str(run_dir), *SHORT, *overrides]
    )


def steps_of(run_dir: Path) -> list[int]:
    return [int(p.name.split("_")[1]) for p in list_checkpoints(run_dir)]


def no_partial_left(root: Path) -> None:
    assert not [p for p in root.rglob("*") if ".tmp-" in p.name or p.suffix == ".tmp"], list(root.rglob("*"))


# ---- the helpers every writer uses ---------------------------------------------------------------------------


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EIO])
def test_disk_errors_are_recognised_and_others_are_not(code):
    assert write_failure(OSError(code, "x")) is not None
    wrapped = RuntimeError(TORCH_FULL)
    wrapped.__context__ = RuntimeError("basic_ios::clear: iostream error")
    assert write_failure(wrapped).startswith("write failed (torch: ")
    assert write_failure(OSError(errno.ENOENT, "x")) is None
    assert write_failure(RuntimeError("shape mismatch")) is None
    assert write_failure(Exception(f"I/O error: x (os error {code})")) is not None  # safetensors (Rust)


def test_a_log_line_is_appended_whole_or_not_at_all(small_disk):
    disk = small_disk("64k")
    log = disk / "metrics.jsonl"
    append_line(log, json.dumps({"step": 1}))
    before = log.read_bytes()
    with pytest.raises(OSError) as e:
        append_line(log, "x" * (200 << 10))  # more than the disk holds
    assert e.value.errno == errno.ENOSPC
    assert log.read_bytes() == before  # no torn record: the file stopped growing


# ---- checkpoints ---------------------------------------------------------------------------------------------


@pytest.mark.slow  # trains
def test_a_real_full_disk_under_torch_save_is_one_line_and_leaves_no_partial_checkpoint(
    shakespeare_bytes, small_disk, capsys
):
    """The issue's case, in one process: the run folder on a tmpfs where the pre-flight check passes, then
    another writer (a filler file at step 3) leaves too little for the step-4 checkpoint, which fails inside
    torch.save (its RuntimeError, no errno) and inside safetensors."""
    disk = small_disk("3600k")
    run = disk / "run"
    lines = []
    with pytest.raises(DiskError) as e:
        train(
            debug_config(
                shakespeare_bytes,
                run,
                "--checkpoint.keep_last",
                "1",
                "--train.max_steps",
                "4",
                "--log.tensorboard",
                "false",
            ),
            log=lines.append,
            on_step=lambda step: step == 3 and (disk / "filler").write_bytes(b"\0" * (1500 << 10)),
        )
    line = str(e.value)
    assert "\n" not in line and "could not write checkpoint step_000004" in line
    assert "the previous checkpoint step_000002 is intact" in line and "free" in line
    assert f"resume with: hopperlm train {run / 'config.yaml'} --resume" in line
    assert steps_of(run) == [2] and verify_checkpoint(run / "checkpoints" / "step_000002") is None
    no_partial_left(run)
    assert any("little room to spare" in x or "checkpoints: about" in x for x in lines)


@pytest.mark.slow  # trains
def test_stop_at_the_third_checkpoint_then_resume_equals_an_uninterrupted_run(
    shakespeare_bytes, tmp_path, monkeypatch
):
    full = tmp_path / "full"
    train(debug_config(shakespeare_bytes, full), log=QUIET)

    cut = tmp_path / "cut"
    attempts = fill_at(monkeypatch, 6)
    with pytest.raises(DiskError) as e:
        train(debug_config(shakespeare_bytes, cut), log=QUIET)
    assert attempts == [6]
    line = str(e.value)
    assert "could not write checkpoint step_000006" in line and "step_000004 is intact" in line
    assert "checkpoint.on_disk_full stop" in line and "--resume" in line and "\n" not in line
    assert steps_of(cut) == [2, 4]
    no_partial_left(cut)

    monkeypatch.undo()  # room again
    train(debug_config(shakespeare_bytes, cut), resume=True, log=QUIET)
    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(cut / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 9))  # 8 steps: every step logged (observe/log_cadence.py)
    assert [(r["loss"], r.get("val_loss")) for r in a] == [(r["loss"], r.get("val_loss")) for r in b]


@pytest.mark.slow  # trains
def test_continue_trains_on_and_ends_non_zero_only_when_the_last_state_is_unsaved(
    shakespeare_bytes, tmp_path, monkeypatch
):
    lines = []
    fill_at(monkeypatch, 6)
    result = train(
        debug_config(shakespeare_bytes, tmp_path / "a", "--checkpoint.on_disk_full", "continue"),
        log=lines.append,
    )
    assert result.step == 8 and steps_of(tmp_path / "a") == [2, 4, 8]  # step 8 saved: nothing lost
    assert sum("training goes on (checkpoint.on_disk_full continue)" in x for x in lines) == 1

    fill_at(monkeypatch, 8)  # the last save fails too
    with pytest.raises(DiskError) as e:
        train(
            debug_config(shakespeare_bytes, tmp_path / "b", "--checkpoint.on_disk_full", "continue"),
            log=QUIET,
        )
    assert "its last state is unsaved" in str(e.value) and "step 8" in str(e.value)
    assert steps_of(tmp_path / "b") == [2, 4]
    assert [r["step"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl")] == list(range(1, 9))
    no_partial_left(tmp_path / "b")


@pytest.mark.slow  # trains
def test_wait_pauses_until_there_is_room_or_the_limit_passes(shakespeare_bytes, tmp_path, monkeypatch):
    lines = []
    attempts = fill_at(monkeypatch, 6, times=2)  # room comes back on the third attempt
    wait = ["--checkpoint.on_disk_full", "wait", "--checkpoint.disk_full_retry_s", "0.01"]
    result = train(debug_config(shakespeare_bytes, tmp_path / "a", *wait), log=lines.append)
    assert attempts == [6, 6] and result.step == 8 and steps_of(tmp_path / "a") == [2, 4, 6, 8]
    assert any("training paused at step 6 (checkpoint.on_disk_full wait)" in x for x in lines)
    assert any("room again" in x for x in lines)

    fill_at(monkeypatch, 6)  # never room
    with pytest.raises(DiskError) as e:
        train(
            debug_config(shakespeare_bytes, tmp_path / "b", *wait, "--checkpoint.disk_full_wait_s", "0.05"),
            log=QUIET,
        )
    assert "no room after 0.05 s" in str(e.value) and steps_of(tmp_path / "b") == [2, 4]
    no_partial_left(tmp_path / "b")


@pytest.mark.slow  # trains
def test_an_async_sharded_checkpoint_that_fails_in_the_background(shakespeare_bytes, tmp_path, monkeypatch):
    from torch.distributed.checkpoint import filesystem

    real = filesystem._write_files_from_queue

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    run = tmp_path / "run"
    async_save = ["--checkpoint.format", "sharded", "--checkpoint.async_save", "true"]
    monkeypatch.setattr(filesystem, "_write_files_from_queue", full)
    lines = []
    with pytest.raises(DiskError) as e:
        train(debug_config(shakespeare_bytes, run, *async_save, "--train.max_steps", "2"), log=lines.append)
    assert "could not write checkpoint step_000002" in str(e.value) and "no earlier checkpoint" in str(
        e.value
    )
    assert "start again with" in str(e.value)
    assert list_checkpoints(run) == []
    no_partial_left(run)
    monkeypatch.setattr(filesystem, "_write_files_from_queue", real)


def test_preflight_refuses_a_run_whose_checkpoints_cannot_fit_before_any_step(
    shakespeare_bytes, small_disk, capsys
):
    disk = small_disk("3m")
    run = disk / "run"
    with pytest.raises(SystemExit) as e:
        main(["train", str(DEBUG), "--data.path", str(shakespeare_bytes), "--run.out_dir", str(run)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: not enough room for 4 checkpoints of about") and "\n" not in err
    assert "(checkpoint.keep_last 3 + the one being written)" in err
    assert "checkpoint.keep_last" in err and "--run.out_dir" in err
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()


@pytest.mark.slow  # trains
def test_a_preemption_signal_ends_a_wait_for_room_promptly(shakespeare_bytes, tmp_path, monkeypatch):
    """SIGTERM while checkpoint.on_disk_full wait sleeps (a 60 s look, a 600 s limit): the stop line within a
    second, not at the next look."""
    import os
    import signal
    import threading
    import time

    fill_at(monkeypatch, 2)  # never room
    wait = [
        "--checkpoint.on_disk_full",
        "wait",
        "--checkpoint.disk_full_retry_s",
        "60",
        "--checkpoint.disk_full_wait_s",
        "600",
    ]
    sent = []

    def log(line: str) -> None:
        if "training paused" in line:  # the wait began: the scheduler's warning comes 0.2 s later
            sent.append(time.monotonic())
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()

    with pytest.raises(DiskError) as e:
        train(debug_config(shakespeare_bytes, tmp_path / "run", *wait), log=log)
    # the wait was for 600 s: the signal ended it, busy or not
    assert sent and time.monotonic() - sent[0] < 60
    line = str(e.value)
    assert "SIGTERM received after" in line and "checkpoint.on_disk_full wait" in line and "\n" not in line
    assert "could not write checkpoint step_000002" in line and "start again with: hopperlm train" in line
    assert steps_of(tmp_path / "run") == []
    no_partial_left(tmp_path / "run")


def test_the_preflight_counts_the_keep_every_milestones_a_run_keeps():
    from hopperlm.checkpoint.disk import checkpoints_at_once
    from hopperlm.config import CheckpointConfig, TrainConfig

    def split(kw):  # the budget is the train section's, the rest the checkpoint section's
        budget = {k: kw.pop(k) for k in ("max_steps", "max_tokens", "max_hours") if k in kw}
        every = kw.pop("ckpt_every")
        return CheckpointConfig(every=every, **kw), TrainConfig(**budget)

    def at_once(**kw):
        return checkpoints_at_once(*split(kw), tokens_per_step=1000)

    assert at_once(max_steps=100, ckpt_every=10)[:2] == (4, "checkpoint.keep_last 3 + the one being written")
    # saves at 10..100; the last 4 (70-100) are the kept ones; 20, 40, 60 are milestones kept besides
    assert at_once(max_steps=100, ckpt_every=10, keep_every=20)[:2] == (
        7,
        "checkpoint.keep_last 3 + the one being written + 3 checkpoint.keep_every 20 milestones",
    )
    assert at_once(max_tokens=100_000, ckpt_every=10, keep_every=20)[0] == 7  # 100 steps of 1000 tokens
    assert (
        checkpoints_at_once(*split(dict(max_steps=100, ckpt_every=10, keep_every=20)), step=50)[0] == 5
    )  # 60
    count, _, note = at_once(max_hours=1.0, ckpt_every=10, keep_every=20)
    assert count == 4 and "a max_hours run's last step is not known ahead" in note


def test_diagnose_shows_the_checkpoint_size_and_how_many_fit(shakespeare_bytes, small_disk, capsys):
    from hopperlm.checkpoint.disk import checkpoint_bytes

    disk = small_disk("8m")
    args = ["diagnose", "debug", "--no-selftest", "--data.path", str(shakespeare_bytes), "--run.out_dir"]
    main([*args, str(disk / "run"), "--checkpoint.keep_every", "20", "--checkpoint.every", "10"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("checkpoints: "))
    assert (
        "up to 7 at once (checkpoint.keep_last 3 + the one being written + 3 checkpoint.keep_every 20" in line
    )
    assert "8.4 MB free there: 4 fit" in line
    main([*args, str(disk / "run"), "--json"])
    room = json.loads(capsys.readouterr().out)["checkpoints"]
    from hopperlm.train.data_and_plan import resolve_model_config

    model_cfg = resolve_model_config(load_config(DEBUG, []).model, 257)  # as `train` builds it (bytes + EOS)
    size = checkpoint_bytes(model_cfg, "adamw")
    assert room["checkpoint_bytes"] == size and room["at_once"] == 4
    assert room["free_bytes"] == 8 << 20 and room["fit"] == (8 << 20) // size


# ---- prepare and export --------------------------------------------------------------------------------------


def test_prepare_filling_mid_shard_keeps_its_work_and_resumes_to_identical_shards(
    data_dir, tmp_path, monkeypatch, capsys
):
    from hopperlm.data import shards
    from hopperlm.data.prepare import PrepareOptions, prepare

    source = [data_dir / "tinyshakespeare" / "input.txt"]
    options = PrepareOptions(tokenizer="byte", shard_tokens=300_000)
    whole = prepare(source, tmp_path / "whole", options, progress=False, log=QUIET)

    real, calls = shards.ShardWriter.write, []

    def write(self, tokens, doc_starts=None):
        calls.append(len(tokens))
        if sum(calls) > 450_000:  # half-way into the second shard
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, tokens, doc_starts)

    monkeypatch.setattr(shards.ShardWriter, "write", write)
    out = tmp_path / "cut"
    with pytest.raises(DiskError) as e:
        prepare(source, out, options, progress=False, log=QUIET)
    assert "could not write prepared shards" in str(e.value) and "run the same command again" in str(e.value)
    assert (tmp_path / "cut.partial").is_dir() and not out.exists()

    monkeypatch.setattr(shards.ShardWriter, "write", real)
    again = prepare(source, out, options, progress=False, log=QUIET)
    assert again["shards"] == whole["shards"]
    for name in (p.name for p in (tmp_path / "whole").iterdir() if p.suffix in (".bin", ".idx")):
        assert (out / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()


def test_prepare_into_a_disk_too_small_is_one_line_before_the_work(data_dir, small_disk, capsys):
    disk = small_disk("700k")
    with pytest.raises(SystemExit) as e:
        main(["prepare", str(data_dir / "tinyshakespeare" / "input.txt"), "--out", str(disk / "sb")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: not enough room for the shards") and "--out" in err and "\n" not in err
    assert list(disk.iterdir()) == []


@pytest.mark.slow  # trains
def test_export_filling_mid_file_leaves_no_half_folder(shakespeare_bytes, tmp_path, small_disk, capsys):
    run = tmp_path / "run"
    train(debug_config(shakespeare_bytes, run, "--train.max_steps", "2"), log=QUIET)
    disk = small_disk("700k")  # the config and tokenizer fit, the weights (560 KB) fit, the copy of both not
    (disk / "filler").write_bytes(b"\0" * (400 << 10))
    (disk / "model").mkdir()
    (disk / "model" / "old.txt").write_text("kept")
    with pytest.raises(SystemExit) as e:
        main(["export", str(run), str(disk / "model"), "--format", "hopperlm", "--overwrite"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "the exported model" in err
    assert {p.name for p in disk.iterdir()} == {"filler", "model"}  # no model.tmp-PID left
    assert (disk / "model" / "old.txt").read_text() == "kept"  # what was there before is untouched
    shutil.rmtree(run)


# ---- every other writer: metric sinks, the report and plots, --json files, tokenizers, merge, import ----------


class FullFiles:
    """ENOSPC at the file layer for the files whose names `match`, once `on`: a write writes half of what it
    was given (as a real full disk does mid-record) and raises OSError(ENOSPC) without a file name. Catches
    Python's open() and pathlib's (io.open), as metrics.jsonl, metrics.csv and TensorBoard's event file use."""

    def __init__(self, monkeypatch, match) -> None:
        import builtins
        import io

        self.match, self.on, self.failed = match, False, set()
        real = io.open

        def patched(file, mode="r", *args, **kwargs):
            f = real(file, mode, *args, **kwargs)
            name = Path(os.fsdecode(file)).name if isinstance(file, (str, bytes, Path)) else ""  # (TB: bytes)
            if self.on and any(c in mode for c in "wax") and self.match(name):
                return FullFile(f, lambda: self.failed.add(name))
            return f

        monkeypatch.setattr(builtins, "open", patched)
        monkeypatch.setattr(io, "open", patched)


class FullFile:
    def __init__(self, f, failed) -> None:
        self.f, self.failed = f, failed

    def write(self, data):
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        self.failed()
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def fill(disk: Path) -> None:
    """Take every free byte of the tmpfs at `disk`: the next file written there fails."""
    free = shutil.disk_usage(disk).free
    with open(disk / "filler", "wb") as f:
        f.truncate(0)
        f.write(b"\0" * free)


def one_line_exit_2(call, capsys) -> str:
    capsys.readouterr()  # (what the test printed before)
    with pytest.raises(SystemExit) as e:
        main(call)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: could not write") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def trained(shakespeare_bytes, tmp_path_factory) -> Path:
    """One tiny run for the writers that read a run: 12 steps, a validation loss every 2 (a forecast fits)."""
    run = tmp_path_factory.mktemp("trained") / "run"
    cfg = load_config(
        DEBUG,
        [
            *("--data.path", str(shakespeare_bytes), "--run.out_dir", str(run)),
            *("--train.max_steps", "12", "--train.eval_every", "2", "--train.eval_windows", "4"),
            *("--train.log_every", "2", "--checkpoint.every", "0", "--schedule.warmup_steps", "2"),
            *("--log.report", "false", "--log.tensorboard", "false"),
        ],
    )
    train(cfg, log=QUIET)
    return run


@pytest.mark.slow  # trains
def test_a_metric_sink_that_fills_warns_once_and_the_run_goes_on(
    shakespeare_bytes, tmp_path, monkeypatch, capfd
):
    """metrics.jsonl, metrics.csv and TensorBoard's event file (written by its background thread) fill after
    step 2: each warns once, stays whole up to its last record, and the run trains on and saves its end."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks = {"metrics.jsonl", "metrics.csv"}
    full = FullFiles(monkeypatch, lambda name: name in sinks or name.startswith("events.out.tfevents"))
    run, lines = tmp_path / "run", []
    cfg = debug_config(
        shakespeare_bytes,
        run,
        *("--train.max_steps", "5", "--train.log_every", "1", "--checkpoint.every", "0"),
        *("--log.csv", "true", "--log.tensorboard", "true", "--log.report", "false"),
    )
    result = train(cfg, log=lines.append, on_step=lambda step: setattr(full, "on", step >= 2))
    assert result.step == 5 and steps_of(run) == [5]  # trained on; its end saved
    assert full.failed >= sinks and any(n.startswith("events.out") for n in full.failed)
    for name in ("metrics.jsonl", "metrics.csv", "tensorboard"):
        warned = [x for x in lines if x.startswith("warning: could not write") and f"; {name} stops" in x]
        assert len(warned) == 1, (name, lines)
        assert str(run) in warned[0] and "no space left on device" in warned[0]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]  # no torn record
    csv_lines = (run / "metrics.csv").read_text().splitlines()
    assert len(csv_lines) == 3 and csv_lines[-1].startswith("2,")
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss/train")] in ([1], [1, 2])  # (its thread may lag the run)
    assert "Traceback" not in capfd.readouterr().err  # not even from TensorBoard's writer thread
    no_partial_left(run)


@pytest.mark.slow  # uses a trained run
def test_the_report_and_plots_on_a_full_disk_keep_the_last_ones(trained, small_disk, capsys):
    disk = small_disk("1m")
    run = disk / "run"
    run.mkdir()
    for name in ("metrics.jsonl", "config.yaml", "plan.json", "result.json"):
        shutil.copy(trained / name, run / name)
    main(["report", str(run)])
    before = {p: p.read_bytes() for p in [run / "report.md", run / "report.html", *(run / "plots").iterdir()]}
    fill(disk)
    err = one_line_exit_2(["report", str(run)], capsys)
    assert ".png" in err and f"in {run / 'plots'}" in err
    err = one_line_exit_2(["plot", str(run)], capsys)
    assert {p: p.read_bytes() for p in before} == before  # the last complete ones, untouched
    no_partial_left(disk)


@pytest.mark.slow  # uses a trained run
@pytest.mark.parametrize("verb", ["eval", "forecast"])
def test_a_json_output_on_a_full_disk_keeps_the_last_one(
    verb, trained, data_dir, tmp_path, small_disk, capsys
):
    disk = small_disk("64k")
    out = disk / f"{verb}.json"
    out.write_text('{"complete": true}\n')
    fill(disk)
    if verb == "eval":
        text = tmp_path / "heldout.txt"
        text.write_text((data_dir / "tinyshakespeare" / "input.txt").read_text()[:3000])
        call = ["eval", str(trained), "--data", str(text), "--json", str(out)]
    else:
        call = ["forecast", str(trained), "--json", str(out)]
    err = one_line_exit_2(call, capsys)
    assert f"could not write {out.name} in {disk}" in err
    assert out.read_text() == '{"complete": true}\n'
    no_partial_left(disk)


@pytest.mark.parametrize("action", ["train", "extend"])
def test_a_tokenizer_on_a_full_disk_leaves_the_last_one(action, data_dir, tmp_path, small_disk, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((data_dir / "tinyshakespeare" / "input.txt").read_text()[:20_000])
    disk = small_disk("64k")
    out = disk / "tok"
    out.mkdir()
    (out / "tokenizer.json").write_text("complete")
    fill(disk)
    if action == "train":
        call = ["tokenizer", "train", str(corpus), "--vocab-size", "300"]
    else:
        base = data_dir / "tokenizers" / "tinyllama-1.1b-chat-v1.0"
        call = ["tokenizer", "extend", str(base), str(corpus), "--add", "8"]
    err = one_line_exit_2([*call, "--out", str(out), "--overwrite"], capsys)
    assert "the tokenizer" in err or "the extended tokenizer" in err
    assert {p.name for p in disk.iterdir()} == {"tok", "filler"}  # no tok.tmp-PID left
    assert [p.name for p in out.iterdir()] == ["tokenizer.json"] and (out / "tokenizer.json").read_text() == (
        "complete"
    )


def safetensors_fill(monkeypatch, module) -> None:
    """`module`'s save_safetensors writes half a file and fails as safetensors does on a full disk."""

    def save(tensors, path, metadata=None):
        Path(path).write_bytes(b"\0" * 1000)
        raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(module, "save_safetensors", save)


@pytest.mark.slow  # trains a LoRA run
def test_merge_filling_mid_file_leaves_no_half_folder(
    trained, shakespeare_bytes, tmp_path, monkeypatch, capsys
):
    from hopperlm.interop import hf_convert

    lora = tmp_path / "lora"
    cfg = load_config(
        DEBUG,
        [
            *("--data.path", str(shakespeare_bytes), "--run.out_dir", str(lora), "--model.preset", "null"),
            *("--model.init_from", str(trained), "--lora.rank", "2", "--lora.targets", "all-linear"),
            *("--train.max_steps", "1", "--train.eval_every", "0", "--log.report", "false"),
        ],
    )
    from hopperlm.interop.init_from import resolve_init_from

    train(resolve_init_from(cfg), log=QUIET)
    out = tmp_path / "merged"
    out.mkdir()
    (out / "old.txt").write_text("kept")
    safetensors_fill(monkeypatch, hf_convert)
    for fmt in ("hopperlm", "hf"):
        err = one_line_exit_2(["merge", str(lora), str(out), "--format", fmt, "--overwrite"], capsys)
        assert "the merged model" in err or "the exported model" in err
        assert [p.name for p in out.iterdir()] == ["old.txt"] and (out / "old.txt").read_text() == "kept"
        no_partial_left(tmp_path)


def test_import_filling_mid_file_leaves_no_half_folder(tinyllama_hf, tmp_path, monkeypatch, capsys):
    from hopperlm.interop import hf_convert

    out = tmp_path / "imported"
    out.mkdir()
    (out / "old.txt").write_text("kept")
    safetensors_fill(monkeypatch, hf_convert)
    err = one_line_exit_2(["import", str(tinyllama_hf), str(out), "--overwrite"], capsys)
    assert "the imported model" in err and "no space left on device" in err
    assert [p.name for p in out.iterdir()] == ["old.txt"]
    no_partial_left(tmp_path)
