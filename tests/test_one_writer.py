"""One writer per folder (issue 48): a second `train`, `--resume` or `export` into a folder another hopperlm is
writing is refused in one line naming the holder; a killed holder frees the folder; no flock, one line.

Deterministic: the first writer is stopped (SIGSTOP) as soon as it holds its lock, so the second meets it
whatever the machine's speed, and let go (SIGCONT) once the second has been refused.
"""

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hopperlm import folder_lock
from hopperlm.config import load_config
from hopperlm.errors import FolderBusy
from hopperlm.folder_lock import LOCK_NAME, hold_folder
from hopperlm.observe.metrics import read_metrics
from hopperlm.parallel.runtime import Runtime
from hopperlm.plan import World
from hopperlm.train.loop import train

REPO = Path(__file__).resolve().parents[1]
DEBUG = REPO / "configs" / "debug.yaml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
QUIET = lambda line: None  # noqa: E731


def train_args(data: Path, run: Path, *extra: str) -> list[str]:
    return ["train", str(DEBUG), "--data.path", str(data), "--run.out_dir", str(run), *extra]


def hopperlm(*args: str) -> list[str]:
    return [sys.executable, "-m", "hopperlm", *args]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(hopperlm(*args), capture_output=True, text=True, cwd=REPO, env=ENV, timeout=120)


def stopped_holding(command: list[str], lock: Path) -> subprocess.Popen:
    """Start a writer and stop it (SIGSTOP) as soon as it has written its line into its lock."""
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=ENV
    )
    deadline = time.monotonic() + 90
    while not (lock.is_file() and lock.stat().st_size):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the first writer never took its lock"
        time.sleep(0.01)
    proc.send_signal(signal.SIGSTOP)
    assert lock.is_file()  # stopped while it still holds it (it removes the file only as it lets go)
    return proc


def refusal(result: subprocess.CompletedProcess, folder: Path, pid: int, fix: str) -> str:
    """The refused writer's one stderr line (exit 2), naming the folder, the holder's pid and what to do."""
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {folder} is being written by another hopperlm (pid {pid} on "), lines[
        0
    ]
    assert lines[0].endswith(f"; wait for it to end or choose another {fix}"), lines[0]
    return lines[0]


def steps(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run / "metrics.jsonl")]


@pytest.mark.slow  # starts hopperlm processes
def test_two_trainings_into_one_folder_one_runs_and_one_is_refused(shakespeare_bytes, tmp_path):
    run = tmp_path / "same"
    args = train_args(shakespeare_bytes, run, "--train.max_steps", "30", "--train.eval_windows", "8")
    first = stopped_holding(hopperlm(*args), run / LOCK_NAME)
    try:
        second = run_cli(*args)
    finally:
        first.send_signal(signal.SIGCONT)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    line = refusal(second, run, first.pid, "--run.out_dir")
    assert f"`hopperlm train {DEBUG}" in line  # the holder's command, as typed
    assert steps(run) == list(range(2, 31, 2))  # one run's records, once: no interleave (30 steps: every 2)
    assert "done: max_steps after 30 steps" in out and not (run / LOCK_NAME).exists()


@pytest.mark.slow  # starts hopperlm processes
def test_two_resumes_of_one_run_one_continues_and_one_is_refused(shakespeare_bytes, tmp_path):
    run = tmp_path / "run"
    train(load_config(DEBUG, train_args(shakespeare_bytes, run, "--train.max_steps", "10")[2:]), log=QUIET)
    args = [*train_args(shakespeare_bytes, run, "--train.max_steps", "30", "--train.eval_windows", "8")]
    first = stopped_holding(hopperlm(*args, "--resume"), run / LOCK_NAME)  # e.g. a requeue while it lives
    try:
        second = run_cli(*args, "--resume")
    finally:
        first.send_signal(signal.SIGCONT)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    refusal(second, run, first.pid, "--run.out_dir")
    assert steps(run) == [*range(1, 11), *range(12, 31, 2)]  # 10 steps (every 1), then on to 30 (every 2)


@pytest.mark.slow  # starts hopperlm processes
def test_a_killed_holder_frees_the_folder(shakespeare_bytes, tmp_path):
    run = tmp_path / "run"
    args = train_args(shakespeare_bytes, run, "--train.max_steps", "10")
    killed = stopped_holding(hopperlm(*args), run / LOCK_NAME)
    killed.kill()  # SIGKILL: no clean-up of any kind
    killed.communicate(timeout=30)
    assert (run / LOCK_NAME).is_file()  # left behind, yet free: the kernel dropped the flock with the process
    result = train(load_config(DEBUG, args[2:]), resume="auto", log=QUIET)
    assert result.step == 10 and not (run / LOCK_NAME).exists()


@pytest.mark.slow  # starts hopperlm processes
@pytest.mark.parametrize("verb", ["export", "merge", "import"])
def test_an_output_another_writer_holds_is_refused(verb, tmp_path):
    out = tmp_path / "out"
    with hold_folder(out, what="OUT", beside=True):
        result = run_cli(verb, str(tmp_path / "source"), str(out))  # refused before the source is read
    refusal(result, out, os.getpid(), "OUT")
    assert list(tmp_path.iterdir()) == []  # no output, no lock left


@pytest.mark.slow  # starts hopperlm
def test_a_tokenizer_output_another_writer_holds_is_refused(tmp_path):
    out, corpus = tmp_path / "tok", tmp_path / "corpus.txt"
    corpus.write_text("some text to learn pieces from\n" * 50)
    with hold_folder(out, what="--out", beside=True):
        result = run_cli("tokenizer", "train", str(corpus), "--vocab-size", "300", "--out", str(out))
    refusal(result, out, os.getpid(), "--out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]


@pytest.mark.slow  # starts hopperlm
def test_a_sweep_folder_another_sweep_holds_is_refused(shakespeare_bytes, tmp_path):
    out = tmp_path / "sweep"
    with hold_folder(out, what="--out"):  # a sweep into it has started and holds it (nothing written yet)
        args = ["sweep", str(DEBUG), "--data.path", str(shakespeare_bytes), "--lr", "1e-3,2e-3,4e-3"]
        args += ["--model.parametrization", "mup", "--model.base_dim", "32"]
        result = run_cli(*args, "--max-steps", "2", "--out", str(out))
    refusal(result, out, os.getpid(), "--out")
    # the second wrote nothing; the holder's lock, and the folder it made, went with it
    assert not out.exists()


@pytest.mark.slow  # starts torchrun: 2 processes
def test_under_torchrun_every_rank_stops_with_the_same_line_and_writes_nothing(shakespeare_bytes, tmp_path):
    run = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"]
    command += ["hopperlm", *train_args(shakespeare_bytes, run, "--train.device", "cpu")]
    with hold_folder(run, what="--run.out_dir"):
        result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=ENV, timeout=150)
        assert [p.name for p in run.iterdir()] == [LOCK_NAME]  # no heartbeats, config or metrics
    errors = {line for line in result.stderr.splitlines() if line.startswith("error: ")}
    assert result.returncode != 0 and "exitcode  : 2" in result.stderr, result.stderr[-3000:]
    assert len(errors) == 1, result.stderr[-3000:]  # (torchrun may stop rank 0 before it prints its copy)
    assert f"is being written by another hopperlm (pid {os.getpid()} on " in errors.pop()
    assert "stopping:" not in result.stderr  # no rank blames another


@pytest.mark.slow  # starts hopperlm
def test_a_second_launch_is_refused_before_it_writes_anything(shakespeare_bytes, tmp_path):
    """`hopperlm launch` holds the run folder itself, before launch.log: a second launch into a folder another
    hopperlm writes leaves nothing in it, no launch.log, no failure.json."""
    run = tmp_path / "run"
    with hold_folder(run, what="--run.out_dir"):
        result = run_cli(
            "launch", str(DEBUG), "--nproc-per-node", "2", *train_args(shakespeare_bytes, run)[2:]
        )
        assert [p.name for p in run.iterdir()] == [LOCK_NAME]
    refusal(result, run, os.getpid(), "--run.out_dir")


def test_the_ranks_of_a_launch_write_under_its_lock(tmp_path, monkeypatch):
    """A process whose launcher holds the folder and says so ($HOPPERLM_FOLDER_HELD_BY, its pid) writes under
    that lock; any other holder still refuses it."""
    run = tmp_path / "run"
    with hold_folder(run, what="--run.out_dir"):  # this process plays the launcher
        with pytest.raises(FolderBusy), hold_folder(run, what="--run.out_dir"):
            pass
        monkeypatch.setenv(folder_lock.HELD_FOR_CHILDREN_ENV, str(os.getpid() + 1))  # another process's word
        with pytest.raises(FolderBusy), hold_folder(run, what="--run.out_dir"):
            pass
        monkeypatch.setenv(folder_lock.HELD_FOR_CHILDREN_ENV, str(os.getpid()))
        with hold_folder(run, what="--run.out_dir"):
            assert (run / LOCK_NAME).is_file()
        assert (run / LOCK_NAME).is_file()  # the rank's end leaves the launcher's lock in place
    assert not (run / LOCK_NAME).exists()


def test_every_rank_stops_with_rank_0s_line(tmp_path, monkeypatch):
    """Rank 0 tries the lock and broadcasts its answer; the other ranks never touch the lock file."""
    run, said = tmp_path / "run", []
    monkeypatch.setattr(Runtime, "broadcast_object", lambda self, obj: said.append(obj) or obj)
    with (
        hold_folder(run, what="--run.out_dir"),
        pytest.raises(FolderBusy) as at_rank_0,
        Runtime(0, 0, World(2, 2)).hold_run_dir(run),
    ):
        pass
    monkeypatch.setattr(Runtime, "broadcast_object", lambda self, obj: said[0])  # rank 0's word
    with pytest.raises(FolderBusy) as at_rank_1, Runtime(1, 1, World(2, 2)).hold_run_dir(run):
        pass
    assert str(at_rank_1.value) == str(at_rank_0.value)
    monkeypatch.setattr(Runtime, "broadcast_object", lambda self, obj: None)  # rank 0 holds it
    with Runtime(1, 1, World(2, 2)).hold_run_dir(run):
        assert not (run / LOCK_NAME).exists()


def test_without_flock_one_line_says_so_and_the_writer_goes_on(tmp_path, monkeypatch):
    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(folder_lock.fcntl, "flock", no_flock)
    monkeypatch.setattr(folder_lock, "_said_no_flock", False)
    lines = []
    with (
        hold_folder(tmp_path / "a", what="--run.out_dir", log=lines.append),
        hold_folder(tmp_path / "a", what="--run.out_dir", log=lines.append),  # not refused: no lock
    ):
        pass
    with hold_folder(tmp_path / "b", what="OUT", beside=True, log=lines.append):
        pass
    assert lines == [
        f"{tmp_path / 'a'}: no flock on this filesystem (No locks available); a second writer is not refused"
    ]
