"""A full disk never costs a run: each checkpoint's size estimated, room checked before the first step, and
`checkpoint.on_disk_full` deciding what a failed checkpoint does (stop, continue, wait).

The Checkpointer (checkpointer.py) builds one `DiskFull` and asks it: `preflight(size)` before the first step,
`failed(error, retry)` when a save could not be written (single.py's CheckpointSaveError, raised on every rank
alike, so every rank takes the same branch) and `check_end()` after the run's last save; `watch(signalled)`
hands it the loop's preemption signal, which ends a wait for room. `checkpoint_bytes` and `checkpoint_room`
are the estimate and the pre-flight count on their own, for `hopperlm diagnose`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from hopperlm.checkpoint.layout import latest_checkpoint, list_checkpoints
from hopperlm.checkpoint.single import CheckpointSaveError
from hopperlm.config import CheckpointConfig, LoRAConfig, ModelConfig, TrainConfig
from hopperlm.config.training import last_step_known_ahead
from hopperlm.diskspace import DiskError, check_room, human_bytes
from hopperlm.files import free_bytes
from hopperlm.memory import optimizer_bytes
from hopperlm.model.lora import count_trainable
from hopperlm.model.transformer import count_params
from hopperlm.parallel.preemption import Preemption
from hopperlm.parallel.runtime import Runtime

WAKE_S = 0.1  # a signal ends a wait within this (rank 0)
FIX = "lower checkpoint.keep_last, free space there, or choose a larger disk with --run.out_dir"


def checkpoint_bytes(cfg: ModelConfig, optimizer: str, lora: LoRAConfig | None = None) -> int:
    """About how many bytes one run checkpoint takes on disk: the fp32 weights (a LoRA run: its adapters
    alone, the base is model.init_from's) and the optimizer state (memory.py's optimizer_bytes), plus 64 KB
    for config.json, state.json, rng.pt and checksums.json. The tokenizer folder it copies is the caller's to
    add."""
    if lora is not None and lora.enabled:
        trainable = count_trainable(cfg, lora)
        return 4 * trainable + optimizer_bytes(cfg, optimizer, trainable) + (64 << 10)
    return 4 * count_params(cfg)["total"] + optimizer_bytes(cfg, optimizer) + (64 << 10)


def checkpoints_at_once(
    cc: CheckpointConfig, budget: TrainConfig, *, step: int = 0, tokens_per_step: int | None = None
) -> tuple[int, str, str]:
    """How many checkpoints a run from `step` holds at once at most, why (`checkpoint.keep_last 3 + the one
    being written + 2 checkpoint.keep_every 500 milestones`), and what that leaves out ("" when nothing): the
    keep_every milestones count (kept for good) that it saves before its last keep_last + 1 saves.
    The milestones are counted when the run's last step is known ahead from its `budget` (the train
    section): train.max_steps, or train.max_tokens over `tokens_per_step`; where max_hours may end the run
    sooner, this is an upper bound. A run with train.max_hours alone has no last step known before it runs,
    so its milestones are left out (and the note says so). Milestones already in the run folder are not
    counted either: the free space shows their room. A rollback's extra save is not foreseen."""
    count, why = cc.keep_last + 1, f"checkpoint.keep_last {cc.keep_last} + the one being written"
    if not cc.keep_every:
        return count, why, ""
    last = last_step_known_ahead(budget, tokens_per_step)
    if last is None:  # max_hours alone: the last step is known only when the clock runs out
        return (
            count,
            why,
            "checkpoint.keep_every milestones left out: a max_hours run's last step is not known ahead",
        )
    every = cc.every
    saves = list(range(step + every - step % every, last, every)) if every else []
    saves.append(last)  # and one at the end
    milestones = sum(1 for s in saves[: -(cc.keep_last + 1)] if s % cc.keep_every == 0)
    if milestones:
        count += milestones
        plural = "s" if milestones > 1 else ""
        why += f" + {milestones} checkpoint.keep_every {cc.keep_every} milestone{plural}"
    return count, why, ""


def checkpoint_room(
    cc: CheckpointConfig,
    budget: TrainConfig,
    checkpoint_size: int,
    run_dir: Path,
    *,
    step: int = 0,
    tokens_per_step: int | None = None,
) -> dict:
    """The checkpoints' room in the run folder's filesystem (what `diagnose --json` shows): each one's size,
    how many at once (checkpoints_at_once), the bytes still needed beside those already there (a resumed
    run's newest checkpoint.keep_last are replaced as it goes), the free bytes and how many checkpoints fit (None
    where the OS cannot say)."""
    count, why, note = checkpoints_at_once(cc, budget, step=step, tokens_per_step=tokens_per_step)
    kept = min(len(list_checkpoints(run_dir)), cc.keep_last) if Path(run_dir).is_dir() else 0
    free = free_bytes(run_dir)
    return {
        "checkpoint_bytes": checkpoint_size,
        "at_once": count,
        "why": why,
        "note": note,
        "needed_bytes": (count - kept) * checkpoint_size,
        "free_bytes": free,
        "fit": None if free is None else free // checkpoint_size + kept,
        "run_dir": str(run_dir),
        "on_disk_full": cc.on_disk_full,
    }


def checkpoint_line(room: dict) -> str:
    """The plan's line from checkpoint_room: `checkpoints: about 1.7 MB each, up to 4 at once
    (checkpoint.keep_last 3 + the one being written); 75.9 GB free there: 44,635 fit; on a full disk: stop
    (checkpoint.on_disk_full)`."""
    free = room["free_bytes"]
    return (
        f"checkpoints: about {human_bytes(room['checkpoint_bytes'])} each, up to {room['at_once']} at once "
        f"({room['why']})"
        + ("" if free is None else f"; {human_bytes(free)} free there: {room['fit']:,} fit")
        + (f"; {room['note']}" if room["note"] else "")
        + f"; on a full disk: {room['on_disk_full']} (checkpoint.on_disk_full)"
    )


class DiskFull:
    """What a checkpoint that cannot be written does (checkpoint.on_disk_full), and the room checked before
    the first step. `collective_limit_s`: how long the ranks' collectives wait in the checkpoint phase
    (parallel.startup_timeout_s), which bounds the wait between looks for room."""

    def __init__(
        self, cc: CheckpointConfig, rt: Runtime, *, run_dir: Path, verb: str, collective_limit_s: float
    ) -> None:
        self.cc, self.rt, self.run_dir = cc, rt, Path(run_dir)
        self.resume_command = f"hopperlm {verb} {self.run_dir / 'config.yaml'} --resume"
        self.unsaved: CheckpointSaveError | None = None  # continue: the failed save not yet made good
        self.signalled: Callable[[], str | None] = lambda: None  # the loop's preemption (watch)
        self.retry_s = cc.disk_full_retry_s
        if rt.world_size > 1:  # every rank sleeps between collectives: stay well inside their limit
            self.retry_s = min(self.retry_s, collective_limit_s / 2)

    # ---- before the first step ------------------------------------------------------------------------
    def preflight(
        self, checkpoint_size: int, budget: TrainConfig, *, step: int = 0, tokens_per_step: int | None = None
    ) -> str:
        """DiskError (on every rank) when the checkpoints the run holds at once (checkpoints_at_once: the
        kept ones, the one being written, the train.keep_every milestones still to come) cannot fit beside
        those already in the run folder; a warning when they fit tightly. Returns the plan's line about it."""
        room = checkpoint_room(
            self.cc, budget, checkpoint_size, self.run_dir, step=step, tokens_per_step=tokens_per_step
        )
        error = None
        if self.rt.is_main:
            try:
                check_room(
                    what=f"{room['at_once']} checkpoints of about {human_bytes(checkpoint_size)} ({room['why']})",
                    where=self.run_dir,
                    needed=room["needed_bytes"],
                    fix=FIX,
                    warn=self.rt.log,
                )
            except DiskError as e:
                error = str(e)
        error = self.rt.broadcast_object(error)
        if error:
            raise DiskError(error)
        return checkpoint_line(room)

    # ---- when a save fails ----------------------------------------------------------------------------
    def failed(self, error: CheckpointSaveError, step: int, retry: Callable[[], Path]) -> Path | None:
        """What checkpoint.on_disk_full says to do about a save that failed: raise (stop), return None
        (continue), or wait and return the path `retry()` saved to."""
        mode = self.cc.on_disk_full
        if mode == "stop":
            raise self.stop(error, step, "checkpoint.on_disk_full stop")
        if mode == "continue":
            self.unsaved = error
            self.rt.log(
                f"warning: {error}; training goes on (checkpoint.on_disk_full continue): the steps since "
                f"{self._latest_name(error)} are unsaved until a checkpoint succeeds"
            )
            return None
        return self._wait(error, step, retry)

    def watch(self, signalled: Callable[[], str | None]) -> None:
        """The run's preemption signal (parallel/preemption.py's `requested`, None until one came): one that came
        before a wait ends it at once."""
        self.signalled = signalled

    def _wait(self, error: CheckpointSaveError, step: int, retry: Callable[[], Path]) -> Path:
        """Look for room every retry_s until checkpoint.disk_full_wait_s passes. A preemption signal (SIGTERM,
        SIGUSR1) before or during the wait ends it within WAKE_S (rank 0's; another rank's at its next look)
        with the stop line: the scheduler's grace period is too short to wait on, and the state since the
        last checkpoint cannot be saved anyway."""
        limit = self.cc.disk_full_wait_s
        self.rt.log(
            f"{error}; training paused at step {step} (checkpoint.on_disk_full wait): looking for room every "
            f"{self.retry_s:g} s for up to {limit:g} s; free space in {self.run_dir}"
        )
        start = time.monotonic()
        # the signal is recorded here while the run waits, not acted on as the loop would (stop at the next
        # micro-batch): its `requested` is what this asks
        with Preemption(lambda line: None, at_micro_batch=False) as during:

            def signalled() -> str | None:
                return during.requested or self.signalled()

            while True:
                # rank 0 decides (its clock, its view of the shared run folder); every rank acts on that
                look = None
                if self.rt.is_main:
                    left = limit - (time.monotonic() - start)
                    self._sleep(max(0.0, min(self.retry_s, left)), signalled)
                    free = free_bytes(self.run_dir)
                    roomy = free is None or error.needed is None or free >= error.needed
                    look = "try" if roomy else ("give up" if time.monotonic() - start >= limit else "wait")
                look = self.rt.broadcast_object(look)
                sig = self.rt.agree(signalled(), True)  # any rank's signal ends the wait on every rank
                if sig:
                    waited = time.monotonic() - start
                    raise self.stop(
                        error, step, f"{sig} received after {waited:.1f} s of checkpoint.on_disk_full wait"
                    )
                if look == "give up":
                    raise self.stop(error, step, f"checkpoint.on_disk_full wait: no room after {limit:g} s")
                if look == "try":
                    try:
                        path = retry()
                        self.rt.log(
                            f"disk: room again after {time.monotonic() - start:.0f} s; training resumes"
                        )
                        return path
                    except CheckpointSaveError as again:  # still too little (or something else filled it)
                        error = again
                    expired = time.monotonic() - start >= limit if self.rt.is_main else None
                    if self.rt.broadcast_object(expired):
                        raise self.stop(
                            error, step, f"checkpoint.on_disk_full wait: no room after {limit:g} s"
                        )

    @staticmethod
    def _sleep(seconds: float, signalled: Callable[[], str | None]) -> None:
        """Sleep `seconds`, waking within WAKE_S of a signal (time.sleep resumes after a handler returns)."""
        end = time.monotonic() + seconds
        while not signalled() and (left := end - time.monotonic()) > 0:
            time.sleep(min(WAKE_S, left))

    def saved(self) -> None:
        """A checkpoint succeeded: whatever failed before is made good."""
        self.unsaved = None

    # ---- the end --------------------------------------------------------------------------------------
    def check_end(self, step: int) -> None:
        """continue: a run whose last state is unsaved ends with a DiskError (exit 2), never silently."""
        if self.unsaved is not None:
            raise self.stop(
                self.unsaved, step, "its last state is unsaved (checkpoint.on_disk_full continue)"
            )

    def stop(self, error: CheckpointSaveError, step: int, why: str) -> DiskError:
        """The one line a run stops with: the failed save (it names the checkpoint that stands), why the
        run stops, and the command that goes on from there."""
        again = (
            f"resume with: {self.resume_command}"
            if latest_checkpoint(self.run_dir) or error.latest
            else f"start again with: {self.resume_command.removesuffix(' --resume')}"
        )
        return DiskError(
            f"{error}; the run stopped at step {step} ({why}); free space in {self.run_dir} (or move the folder "
            f"to a larger disk and add --run.out_dir NEW), then {again}"
        )

    def _latest_name(self, error: CheckpointSaveError) -> str:
        latest = latest_checkpoint(self.run_dir) or error.latest
        return str(latest) if latest is not None else "none (the run starts over)"
