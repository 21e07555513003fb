"""`hopperlm launch` without hung jobs: torchrun's elastic agent runs in this process (what the `torchrun`
command runs, with the same options), and a thread watches the ranks' heartbeats (parallel/watchdog.py).

- A rank whose heartbeat stops for longer than its collective limit (stopped, hung in a system call, its node
  lost) is named and killed, so the job ends (or restarts) within that limit instead of waiting on it.
- When the job fails, one line says what happened, at which step, which rank, the latest complete checkpoint
  and the command that resumes; RUN_DIR/failure.json keeps every rank's error and traceback, RUN_DIR/launch.log
  the agent's own messages (on several nodes each node's launcher writes its own, failure-HOST-PID.json and
  launch-HOST-PID.log, so launchers sharing a run folder on a shared filesystem do not overwrite each other).
  The ranks stay quiet (the launcher speaks for them); `--debug` shows everything.
- `--max-restarts N`: the agent restarts the whole group after a failure, up to N times; a restarted rank
  resumes from the latest checkpoint by itself (TORCHELASTIC_RESTART_COUNT, checkpoint/checkpointer.py `find_resume`).
- On GPUs the workers get NCCL's flight recorder (dumped into RUN_DIR/flight-recorder on a timeout) and
  asynchronous error handling (a timed-out NCCL call aborts its process instead of hanging it).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from hopperlm.parallel.watchdog import HEARTBEAT_DIR, SUPERVISED_ENV

GRACE_S = 2.0  # past a rank's limit before it counts as frozen (its thread writes every second)
POLL_S = 0.5
ENDED_PHASES = ("done", "failed")


def nccl_environment(run_dir: Path) -> dict[str, str]:
    """What every worker gets unless the user set it: the flight recorder (the last 2000 collectives of each
    rank, dumped on a timeout) and async error handling 3 (a timed-out NCCL call aborts the process)."""
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_FR_BUFFER_SIZE": "2000",  # (the names torch 2.13 reads; its TORCH_NCCL_* ones are deprecated)
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(run_dir / "flight-recorder" / "nccl_trace_rank_"),
    }


def read_beats(run_dir: Path) -> list[dict]:
    beats = []
    for path in sorted((run_dir / HEARTBEAT_DIR).glob("rank-*.json")):
        try:
            beats.append(json.loads(path.read_text()))
        except (OSError, ValueError):  # being replaced right now: read it next time
            continue
    return beats


@dataclass
class Frozen:
    rank: int
    step: int
    silent_s: float
    limit_s: float
    killed: bool


class HeartbeatWatcher:
    """Reads the heartbeat files every half second; kills a frozen rank of this host (SIGKILL: a stopped
    process ignores SIGTERM until continued, and would hold the agent's shutdown for 30 s)."""

    def __init__(self, run_dir: Path, started: float, max_restarts: int, say=print) -> None:
        self.run_dir, self.started, self.max_restarts, self.say = run_dir, started, max_restarts, say
        self.host = socket.gethostname()
        self.frozen: Frozen | None = None
        self.attempt = 0
        self.handled: set[tuple[int, int]] = set()  # (attempt, rank) already named and killed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hopperlm-watcher", daemon=True)

    def __enter__(self) -> HeartbeatWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def current(self) -> list[dict]:
        """The beats of the newest attempt (files of an earlier attempt are stale by construction)."""
        beats = [b for b in read_beats(self.run_dir) if b.get("time", 0) >= self.started]
        if not beats:
            return []
        attempt = max(b.get("attempt", 0) for b in beats)
        return [b for b in beats if b.get("attempt", 0) == attempt]

    def check(self, now: float | None = None) -> Frozen | None:
        now = time.time() if now is None else now
        beats = self.current()
        if not beats:
            return None
        attempt = beats[0].get("attempt", 0)
        if attempt > self.attempt:
            self.attempt, self.frozen = attempt, None
            self.say(
                f"launch: restart {attempt} of {self.max_restarts}: every rank resumes from the latest checkpoint"
            )
        for b in beats:
            silent = now - b["time"]
            if b["phase"] in ENDED_PHASES or silent <= b["limit_s"] + GRACE_S:
                continue
            if (attempt, b["rank"]) in self.handled:
                continue
            self.handled.add((attempt, b["rank"]))
            killed = b.get("host") == self.host and _kill(b["pid"])
            # the others wait in the step the frozen rank never joined (its own file may be a second old)
            step = max(other["step"] for other in beats)
            self.frozen = Frozen(b["rank"], step, silent, b["limit_s"], killed)
            if self.attempt < self.max_restarts:  # the group restarts: say why now
                self.say(f"launch: {describe_frozen(self.frozen)}")
            return self.frozen
        return self.frozen

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.check()
            except Exception:  # noqa: BLE001 (watching must never take the launcher down)
                continue


def _kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def describe_frozen(f: Frozen) -> str:
    return (
        f"rank {f.rank} stopped answering at step {f.step + 1}: no heartbeat for {f.silent_s:.0f} s "
        f"(limit {f.limit_s:.0f} s): the process was stopped, hung in a system call, or its node was lost"
        + ("; it was killed" if f.killed else "")
    )


def describe_failure(failures: dict, frozen: Frozen | None, beats: list[dict]) -> str:
    """What happened, in one clause. A frozen rank first (the others' timeouts follow from it); then a rank
    killed by a signal other than the agent's SIGTERM (the others' SIGTERM is the agent stopping them after
    it); then the earliest recorded error (our ranks record a one-line message: parallel/runtime.py)."""
    if frozen is not None:
        return describe_frozen(frozen)
    steps = {b["rank"]: b["step"] for b in beats}

    def at(rank: int) -> str:
        if not steps:  # no rank got as far as its process group: the failure is in start-up
            return "during start-up"
        return f"at step {steps.get(rank, max(steps.values())) + 1}"

    if not failures:
        return f"the job failed {at(0)}"

    def order(item):
        rank, f = item
        agent_stopped = f.exitcode == -signal.SIGTERM
        return (agent_stopped, f.exitcode >= 0, not f.error_file_data, f.timestamp, rank)

    rank, failure = min(failures.items(), key=order)
    if failure.exitcode < 0:
        number = -failure.exitcode
        name = signal.Signals(number).name if number in signal.valid_signals() else f"signal {number}"
        return f"rank {rank} was killed by {name} {at(rank)} (the OOM killer, or an operator)"
    message = failure.message.get("message", "") if isinstance(failure.message, dict) else failure.message
    message = str(message).strip().splitlines()[0] if message else ""
    if "To enable traceback" in message or not message:
        message = f"exit code {failure.exitcode}"
    if not message.startswith("rank "):
        message = f"rank {rank}: {message}"
    return f"{message} ({at(rank)})"


def node_file(run_dir: Path, stem: str, suffix: str, node: str | None) -> Path:
    """RUN_DIR/STEM.SUFFIX, or STEM-NODE.SUFFIX for one node of several (each node's launcher writes its own)."""
    return run_dir / (f"{stem}-{node}{suffix}" if node else f"{stem}{suffix}")


@contextmanager
def native_stderr_to(path: Path):
    """The process's file descriptor 2 appends to `path` while inside: what torch's C++ code writes there
    (c10d's TCPStore warnings when another node's launcher, which hosts the rendezvous store, goes away) and
    the ranks' stderr (they inherit it) go to the agent's log, not the console. Python's sys.stderr writes to
    the same descriptor, so it is flushed at both ends."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "ab") as log:
            os.dup2(log.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def describe_agent_error(e: Exception, beats: list[dict]) -> str:
    """The agent itself failed (no rank did first): on several nodes, mostly the rendezvous lost because the
    launcher hosting its store ended (its own ranks failed) or cannot be reached."""
    from torch.distributed import DistError
    from torch.distributed.elastic.rendezvous import RendezvousError

    at = f" at step {max(b['step'] for b in beats) + 1}" if beats else " during start-up"
    text = str(e).strip().splitlines()[0] if str(e).strip() else "no message"
    why = ""
    if isinstance(e, RendezvousError | DistError):
        why = " (the rendezvous was lost: another node's launcher ended, or its endpoint cannot be reached)"
    return f"the launcher's agent stopped{at}: {type(e).__name__}: {text}{why}"


def write_failure(
    run_dir: Path,
    line: str,
    failures: dict,
    beats: list[dict],
    node: str | None = None,
    agent_error: str | None = None,
) -> Path:
    path = node_file(run_dir, "failure", ".json", node)
    ranks = {
        str(rank): {
            "exitcode": f.exitcode,
            "pid": f.pid,
            "message": f.message,
            "error_file": f.error_file_data,
        }
        for rank, f in failures.items()
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"summary": line, "ranks": ranks, "heartbeats": beats}
    if agent_error:
        record["agent_error"] = agent_error  # the launcher's own traceback
    path.write_text(json.dumps(record, indent=2, default=str))
    return path


def supervise(
    torchrun_argv: list[str],
    run_dir: Path,
    *,
    resume_command: list[str],
    where_to_go_on: Callable[[], str],
    debug: bool = False,
    quiet=None,
    node: str | None = None,
) -> int:
    """Run the job; the exit code for `hopperlm launch` (0: every rank finished). `quiet`: a context manager
    that keeps the agent's log lines off the console while it runs (the CLI's, writing RUN_DIR/launch.log).
    `node`: this launcher's name when the job spans several nodes (its failure file is failure-NODE.json).
    `where_to_go_on()`: the failure line's end, the run's latest checkpoint and the command that goes on from it
    (the CLI's: this layer reads no checkpoint)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(torchrun_argv)
    run_dir.mkdir(parents=True, exist_ok=True)
    for key, value in nccl_environment(run_dir).items():
        os.environ.setdefault(key, value)
    import torch

    if torch.cuda.is_available():
        (run_dir / "flight-recorder").mkdir(exist_ok=True)
    os.environ[SUPERVISED_ENV] = "0" if debug else "1"
    if not debug:  # torch's C++ log lines (gloo's retries, NCCL's watchdog) stay off the console
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    started = time.time()
    say = lambda line: print(line, flush=True)  # noqa: E731
    watcher = HeartbeatWatcher(run_dir, started, args.max_restarts, say)

    def _failed(what: str, failures: dict, beats: list[dict], agent_error: str | None) -> int:
        after = f"the job stopped {time.time() - started:.0f} s after launch"
        where = where_to_go_on()
        line = f"{what}; {after}; {where}"
        details = write_failure(run_dir, line, failures, beats, node, agent_error)
        print(f"error: {line} (details: {details})", file=sys.stderr, flush=True)
        return 1

    # the agent's C++ messages and the ranks' stderr go to its log (the launcher speaks for the ranks)
    native = nullcontext() if debug else native_stderr_to(node_file(run_dir, "launch", ".log", node))
    try:
        with watcher, quiet or nullcontext(), native:
            run(args)
        return 0
    except ChildFailedError as e:
        frozen = watcher.frozen or watcher.check()  # (the final check also kills what is frozen)
        beats = watcher.current()
        what = describe_failure(e.failures, frozen, beats)
        return _failed(what, e.failures, beats, None)
    except SignalException as e:
        print(
            f"launch: stopped by {e.sigval.name} (each rank checkpointed at its next log step, then exited); "
            f"resume with: {shlex.join(resume_command)}",
            file=sys.stderr,
            flush=True,
        )
        return 128 + int(e.sigval)
    except Exception as e:  # noqa: BLE001 (the agent itself failed: one line, like a rank's failure)
        if debug:
            raise
        beats = watcher.current()
        return _failed(describe_agent_error(e, beats), {}, beats, traceback.format_exc())
    finally:
        os.environ.pop(SUPERVISED_ENV, None)  # the ranks' setting: this process is the launcher, not a rank
