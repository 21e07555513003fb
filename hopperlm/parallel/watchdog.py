"""Two limits for a collective, and a heartbeat per rank that `hopperlm launch` watches (parallel/supervise.py).

A collective that waits for a rank that will never come (a stopped or dead process, a lost node, a hung read)
must end the job, not hang it. How long to wait depends on the phase: start-up (loading, data checks, compile,
the first steps) and the long phases after it (evaluation, checkpoint saves) may keep one rank busy for minutes
while the others wait, so they get `parallel.startup_timeout_s` (600 s); a training step never takes long, so
from the first log step on, collectives get `parallel.step_timeout_s`, by default the larger of 60 s and 10x the
slowest step measured so far (torchtitan does the same with a fixed 100 s after its first step). The limit is
the process group's own timeout (`_set_pg_timeout`): gloo raises when it passes, NCCL's watchdog aborts the
communicator (TORCH_NCCL_ASYNC_ERROR_HANDLING, set by the launcher).

The heartbeat: a daemon thread writes RUN_DIR/heartbeats/rank-R.json every second (the rank's pid and host, the
last step it finished, its phase and current limit). A rank whose file stops changing for longer than its limit
is frozen (SIGSTOP, a dead node, a system call that never returns): the launcher names it and kills it, so the
job ends within the limit, and says so in one line. A rank stuck in a collective keeps beating (its thread
runs) with a step that no longer moves: the collective's own timeout ends that.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from pathlib import Path

from hopperlm.config.run import STEP_LIMIT_FACTOR, STEP_LIMIT_FLOOR_S

HEARTBEAT_DIR = "heartbeats"
SUPERVISED_ENV = "HOPPERLM_SUPERVISED"
"""Set to 1 by `hopperlm launch` for its ranks: they record their errors for it and print none themselves."""
BEAT_EVERY_S = 1.0
BEAT_BYTES = 512  # a heartbeat file's fixed size (JSON padded with spaces)


def supervised() -> bool:
    return os.environ.get(SUPERVISED_ENV) == "1"


def restart_count() -> int:
    """Which attempt of the job this is: torchrun's elastic agent counts its restarts (--max-restarts)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def step_limit(configured: float | None, slowest_step_s: float) -> tuple[float, str]:
    """The collective limit once training runs, and why."""
    if configured is not None:
        return configured, "parallel.step_timeout_s"
    auto = max(STEP_LIMIT_FLOOR_S, STEP_LIMIT_FACTOR * slowest_step_s)
    return (
        auto,
        f"max({STEP_LIMIT_FLOOR_S:.0f} s, {STEP_LIMIT_FACTOR:.0f} x the slowest step {slowest_step_s:.2f} s)",
    )


def set_group_timeout(seconds: float) -> None:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout

    if dist.is_initialized():
        _set_pg_timeout(timedelta(seconds=seconds))


class Watchdog:
    """One rank's limits and heartbeat. `beat(step)` after every step costs an attribute write; the thread
    does the file writes. `long_phase(name)` widens the limit to the start-up one while a rank evaluates or
    saves; `measured(step_time_s)` on log steps sets the step limit."""

    def __init__(self, rank: int, run_dir: Path, startup_s: float, step_s: float | None, log=print) -> None:
        self.rank, self.startup_s, self.configured_step_s = rank, startup_s, step_s
        self.path = Path(run_dir) / HEARTBEAT_DIR / f"rank-{rank}.json"
        self.log = log
        self.step, self.phase, self.limit_s = 0, "startup", startup_s
        self.step_limit_s: float | None = None  # set at the first log step
        self.slowest_s = 0.0
        self.attempt = restart_count()
        self._fd: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hopperlm-heartbeat", daemon=True)

    # ---- the training loop's side ----------------------------------------------------------------------
    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write()
        self._thread.start()

    def beat(self, step: int) -> None:
        self.step = step

    def measured(self, step_time_s: float) -> None:
        """A log step: the slowest step so far sets the step limit (applied at once unless in a long phase)."""
        self.slowest_s = max(self.slowest_s, step_time_s)
        limit, why = step_limit(self.configured_step_s, self.slowest_s)
        first = self.step_limit_s is None
        if first or abs(limit - self.step_limit_s) > 0.05 * self.step_limit_s:
            self.step_limit_s = limit
            if self.phase == "train" or first:
                self._set(limit, "train")
            if first:
                self.log(
                    f"collective limit: {limit:.0f} s per step from now on ({why}); start-up, evaluation and "
                    f"checkpoints keep {self.startup_s:.0f} s (parallel.startup_timeout_s)"
                )

    @contextmanager
    def long_phase(self, name: str) -> Iterator[None]:
        """Evaluation, a checkpoint save, the end of the run: the start-up limit while it lasts."""
        before = self.phase
        self._set(self.startup_s, name)
        try:
            yield
        finally:
            if self.step_limit_s is not None:
                self._set(self.step_limit_s, "train")
            else:
                self._set(self.startup_s, before)

    def close(self, phase: str = "done") -> None:
        """The rank leaves (finished or failed): the launcher stops watching it."""
        self.phase = phase
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * BEAT_EVERY_S)
        with suppress(OSError):
            self._write()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # ---- inside --------------------------------------------------------------------------------------
    def _set(self, limit_s: float, phase: str) -> None:
        if limit_s != self.limit_s:
            set_group_timeout(limit_s)
        self.limit_s, self.phase = limit_s, phase

    def _write(self) -> None:
        """Overwrite the file in place, padded to a fixed size: no new disk block is needed, so a full disk
        (which training survives: a failed checkpoint save is only a warning) does not silence the heartbeat.
        A reader that catches a write half-way fails to parse it and reads again half a second later."""
        beat = {
            "rank": self.rank,
            "attempt": self.attempt,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "step": self.step,
            "phase": self.phase,
            "limit_s": self.limit_s,
            "time": time.time(),
        }
        data = json.dumps(beat).encode().ljust(BEAT_BYTES)
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self._fd, data, 0)

    def _run(self) -> None:
        while not self._stop.wait(BEAT_EVERY_S):
            with suppress(OSError):  # a full or unreachable disk: the collective limits still hold
                self._write()
