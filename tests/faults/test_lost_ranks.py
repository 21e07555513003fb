"""A lost or stalled rank never hangs `hopperlm launch`: 2 gloo ranks on the CPU, one of them killed (SIGKILL) or
frozen (SIGSTOP: what a hung NCCL call, a dead link or a stuck read look like from outside) mid-run. The job
ends promptly with one line naming the rank, the step and the resume command, leaves no process behind and
keeps its latest checkpoint; with --max-restarts it restarts itself and finishes with an uninterrupted run's
losses."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hopperlm.checkpoint.layout import latest_checkpoint, verify_checkpoint
from hopperlm.observe.metrics import read_metrics
from hopperlm.parallel.supervise import Frozen, describe_agent_error, describe_failure
from hopperlm.parallel.watchdog import HEARTBEAT_DIR, step_limit

REPO = Path(__file__).resolve().parents[2]


def launch(run_dir: Path, data: Path, steps: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hopperlm",
        "launch",
        "configs/debug.yaml",
        "--nproc-per-node",
        "2",
        *extra,
        "--data.path",
        str(data),
        "--run.out_dir",
        str(run_dir),
        "--train.max_steps",
        str(steps),
        "--train.log_every",
        "5",
        "--train.eval_every",
        "0",
        "--checkpoint.every",
        "20",
        "--train.device",
        "cpu",
    ]


def heartbeat(run_dir: Path, rank: int) -> dict | None:
    try:
        return json.loads((run_dir / HEARTBEAT_DIR / f"rank-{rank}.json").read_text())
    except (OSError, ValueError):
        return None


def logged_step(run_dir: Path) -> int:
    """The last step in metrics.jsonl (rank 0 appends it as each log step ends; a torn last line is skipped)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [0]
    for line in lines:
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return max(steps)


def run_with_fault(
    command: list[str], run_dir: Path, sig: signal.Signals, at_step: int, timeout: float, logged: bool = False
):
    """Start the job; when rank 1 has finished `at_step` steps, send it `sig`. (seconds from the signal to
    the launcher's exit, the finished process, every pid the heartbeats named, rank 1's environment).
    `logged`: the steps counted from metrics.jsonl rather than rank 1's heartbeat, which is written once a
    second (a debug run does 30 to 50 steps a second): for a signal that must land before a short run ends."""
    job = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sent, pids, deadline = None, set(), time.time() + timeout
    while job.poll() is None and time.time() < deadline:
        for rank in (0, 1):
            beat = heartbeat(run_dir, rank)
            if beat is not None:
                pids.add(beat["pid"])
        beat = heartbeat(run_dir, 1)
        if logged:  # rank 0 logged it, so rank 1 finished it too (the step's all-reduce): it trains on
            due = beat is not None and logged_step(run_dir) >= at_step
        else:
            due = beat is not None and beat["step"] >= at_step and beat["phase"] == "train"
        if sent is None and due:
            environ = Path(f"/proc/{beat['pid']}/environ").read_bytes().split(b"\0")
            os.kill(beat["pid"], sig)
            sent = time.time()
        time.sleep(0.05)
    if job.poll() is None:
        job.kill()
    out, err = job.communicate()
    assert sent is not None, f"rank 1 never reached step {at_step}:\n{out[-2000:]}\n{err[-2000:]}"
    env = dict(item.decode().split("=", 1) for item in environ if b"=" in item)
    return time.time() - sent, subprocess.CompletedProcess(command, job.returncode, out, err), pids, env


def assert_one_line_and_clean(done: subprocess.CompletedProcess, pids: set[int], run_dir: Path) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, (done.stdout[-2000:], done.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    for pid in pids:  # no rank left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and verify_checkpoint(ckpt) is None  # the latest complete checkpoint is intact
    assert f"latest checkpoint {ckpt.name}" in lines[0] and "--resume" in lines[0]
    assert json.loads((run_dir / "failure.json").read_text())["summary"] in lines[0]
    return lines[0]


@pytest.mark.slow
def test_a_killed_rank_ends_the_job_within_seconds(shakespeare_bytes, tmp_path):
    run_dir = tmp_path / "killed"
    seconds, done, pids, env = run_with_fault(
        launch(run_dir, shakespeare_bytes, 2000), run_dir, signal.SIGKILL, at_step=45, timeout=900
    )
    line = assert_one_line_and_clean(done, pids, run_dir)
    assert seconds < 10, seconds
    assert "rank 1 was killed by SIGKILL at step" in line, line
    # what the launcher gave its ranks: quiet errors (it speaks for them), NCCL's abort and flight recorder
    assert env["HOPPERLM_SUPERVISED"] == "1" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(run_dir.resolve() / "flight-recorder" / "nccl_trace_rank_")
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(env["TORCH_FR_BUFFER_SIZE"]) > 0


@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_within_its_step_limit(shakespeare_bytes, tmp_path):
    run_dir = tmp_path / "stopped"
    command = launch(run_dir, shakespeare_bytes, 100_000, "--parallel.step_timeout_s", "10")
    seconds, done, pids, _ = run_with_fault(command, run_dir, signal.SIGSTOP, at_step=25, timeout=900)
    line = assert_one_line_and_clean(done, pids, run_dir)  # the checkpoint of step 20 kept
    assert seconds < 25, seconds
    assert "rank 1 stopped answering at step" in line and "limit 10 s" in line, line


@pytest.mark.slow
def test_max_restarts_resumes_to_the_uninterrupted_losses(shakespeare_bytes, tmp_path):
    # 100 steps: the 75 left after step 25 (about 2 s) keep rank 1 alive until the kill lands, however loaded
    # the machine (after 50, rank 1 could end first, and the test would find no process to kill)
    whole = subprocess.run(
        launch(tmp_path / "whole", shakespeare_bytes, 100),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert whole.returncode == 0, whole.stderr[-2000:]
    run_dir = tmp_path / "restarted"
    command = launch(run_dir, shakespeare_bytes, 100, "--max-restarts", "1")
    _, done, *_ = run_with_fault(command, run_dir, signal.SIGKILL, at_step=25, timeout=900, logged=True)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    assert "launch: restart 1 of 1" in done.stdout
    assert "restart 1 of this job: continuing from the latest checkpoint" in done.stdout
    want = [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "whole" / "metrics.jsonl")]
    got = [(r["step"], r["loss"]) for r in read_metrics(run_dir / "metrics.jsonl")]
    assert got == want  # every logged step, bitwise
    assert json.loads((run_dir / "result.json").read_text())["stopped_by"] == "max_steps"


def test_the_step_limit_and_the_failure_line():
    assert step_limit(None, 0.2) == (60.0, step_limit(None, 0.2)[1])  # the floor
    assert step_limit(None, 9.0)[0] == 90.0  # 10x the slowest step
    assert step_limit(30.0, 9.0) == (30.0, "parallel.step_timeout_s")
    frozen = Frozen(rank=3, step=56, silent_s=31.4, limit_s=30.0, killed=True)
    assert describe_failure({}, frozen, []).startswith(
        "rank 3 stopped answering at step 57: no heartbeat for 31 s"
    )
    # the agent itself failed: on one node of several, the other node's launcher (the store's host) ended
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    lost = describe_agent_error(RendezvousConnectionError("The connection to the C10d store has failed."), [])
    assert lost == (
        "the launcher's agent stopped during start-up: RendezvousConnectionError: The connection to the C10d "
        "store has failed. (the rendezvous was lost: another node's launcher ended, or its endpoint cannot be "
        "reached)"
    )
    other = describe_agent_error(ValueError("bad\nsecond line"), [{"step": 4}, {"step": 6}])
    assert other == "the launcher's agent stopped at step 7: ValueError: bad"


def test_the_watcher_kills_a_frozen_rank_once_and_says_it_once(tmp_path):
    from hopperlm.parallel.supervise import HeartbeatWatcher

    frozen = subprocess.Popen(["sleep", "60"])
    beats = tmp_path / HEARTBEAT_DIR
    beats.mkdir()
    now = time.time()
    for rank, (pid, age, phase) in enumerate([(os.getpid(), 0.5, "train"), (frozen.pid, 40.0, "train")]):
        beat = {"rank": rank, "attempt": 0, "pid": pid, "host": os.uname().nodename, "step": 56 + rank,
                "phase": phase, "limit_s": 30.0, "time": now - age}  # fmt: skip
        (beats / f"rank-{rank}.json").write_text(json.dumps(beat))
    said = []
    watcher = HeartbeatWatcher(tmp_path, started=now - 100, max_restarts=1, say=said.append)
    first = watcher.check(now)
    assert (first.rank, first.step, first.killed) == (1, 57, True)
    assert frozen.wait(timeout=5) == -signal.SIGKILL
    assert watcher.check(now + 1) is first and len(said) == 1  # named once (a restart follows: said now)
    assert "rank 1 stopped answering at step 58" in said[0]


@pytest.mark.slow
def test_two_node_launchers_sharing_a_run_folder_each_keep_their_failure(shakespeare_bytes, tmp_path):
    """Two `hopperlm launch --nnodes 2` on this machine (one rank each, a c10d rendezvous on localhost), as two
    nodes writing into one shared run folder: when a rank is killed, both launchers fail in one line and each
    keeps its own failure file and agent log; neither overwrites the other's. The other node's line is its own
    rank's lost connection, or, when the killed rank's launcher (the rendezvous store's host) ends first, its
    agent's lost rendezvous: either way one line and a failure file."""
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    run_dir = tmp_path / "two-nodes"
    command = launch(
        run_dir, shakespeare_bytes, 2000, "--nnodes", "2", "--rdzv-endpoint", f"localhost:{port}"
    )
    command[command.index("--nproc-per-node") + 1] = "1"
    nodes = [
        subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    deadline, sent = time.time() + 900, False  # only a hang reaches it
    while not sent and time.time() < deadline and all(n.poll() is None for n in nodes):
        beat = heartbeat(run_dir, 1)
        if beat is not None and beat["step"] >= 25 and beat["phase"] == "train":
            os.kill(beat["pid"], signal.SIGKILL)
            sent = True
        time.sleep(0.05)
    outputs = [n.communicate(timeout=600) for n in nodes]
    assert sent, outputs
    failures = sorted(run_dir.glob("failure-*.json"))
    assert [n.returncode for n in nodes] == [1, 1] and len(failures) == 2, outputs
    assert not (run_dir / "failure.json").exists() and len(list(run_dir.glob("launch-*.log"))) == 2
    for (_, err), node in zip(outputs, nodes, strict=True):
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and f"-{node.pid}.json)" in lines[0], err
    summaries = {json.loads(f.read_text())["summary"] for f in failures}
    assert any("rank 1 was killed by SIGKILL" in s for s in summaries), summaries
