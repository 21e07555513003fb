"""A full disk never costs a run: room checked before the first step, and `train.on_disk_full` deciding what a
failed checkpoint does (stop, continue, wait).

`DiskFull` is built once per run with what it needs (the train and parallel sections, the runtime, the run
folder) and asked twice: `preflight(size)` before the first step, `failed(error, retry)` when a save could not
be written (checkpoint/single.py's CheckpointSaveError, raised on every rank alike by parallel/checkpoint.py, so
every rank takes the same branch), and `check_end()` after the run's last save.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from hopperlm.checkpoint.layout import latest_checkpoint, list_checkpoints
from hopperlm.checkpoint.single import CheckpointSaveError
from hopperlm.config import ParallelConfig, TrainConfig
from hopperlm.diskspace import DiskError, check_room, free_bytes, human_bytes
from hopperlm.parallel.runtime import Runtime

FIX = "lower train.keep_last, free space there, or choose a larger disk with --run.out_dir"


class DiskFull:
    def __init__(
        self,
        tc: TrainConfig,
        parallel: ParallelConfig,
        rt: Runtime,
        *,
        run_dir: Path,
        verb: str,
    ) -> None:
        self.tc, self.rt, self.run_dir = tc, rt, Path(run_dir)
        self.resume_command = f"hopperlm {verb} {self.run_dir / 'config.yaml'} --resume"
        self.unsaved: CheckpointSaveError | None = None  # continue: the failed save not yet made good
        self.retry_s = tc.disk_full_retry_s
        if rt.world_size > 1:  # every rank sleeps between collectives: stay well inside their limit
            self.retry_s = min(self.retry_s, parallel.startup_timeout_s / 2)

    # ---- before the first step ------------------------------------------------------------------------
    def preflight(self, checkpoint_size: int) -> str:
        """DiskError (on every rank) when `keep_last + 1` checkpoints (the kept ones and the one being
        written) cannot fit beside those already in the run folder; a warning when they fit tightly. Returns
        the plan's line about it."""
        kept = min(len(list_checkpoints(self.run_dir)), self.tc.keep_last)
        count = self.tc.keep_last + 1
        needed = (count - kept) * checkpoint_size
        error = None
        if self.rt.is_main:
            try:
                check_room(
                    what=f"train.keep_last {self.tc.keep_last} + 1 checkpoints of about "
                    f"{human_bytes(checkpoint_size)}",
                    where=self.run_dir,
                    needed=needed,
                    fix=FIX,
                    warn=self.rt.log,
                )
            except DiskError as e:
                error = str(e)
        error = self.rt.broadcast_object(error)
        if error:
            raise DiskError(error)
        free = free_bytes(self.run_dir)
        fits = (
            ""
            if free is None
            else f"; {human_bytes(free)} free there: {(free // checkpoint_size) + kept} fit"
        )
        return (
            f"checkpoints: about {human_bytes(checkpoint_size)} each, up to {count} at once (train.keep_last "
            f"{self.tc.keep_last} + the one being written){fits}; on a full disk: {self.tc.on_disk_full} "
            "(train.on_disk_full)"
        )

    # ---- when a save fails ----------------------------------------------------------------------------
    def failed(self, error: CheckpointSaveError, step: int, retry: Callable[[], Path]) -> Path | None:
        """What train.on_disk_full says to do about a save that failed: raise (stop), return None (continue),
        or wait and return the path `retry()` saved to."""
        mode = self.tc.on_disk_full
        if mode == "stop":
            raise self.stop(error, step, "train.on_disk_full stop")
        if mode == "continue":
            self.unsaved = error
            self.rt.log(
                f"warning: {error}; training goes on (train.on_disk_full continue): the steps since "
                f"{self._latest_name(error)} are unsaved until a checkpoint succeeds"
            )
            return None
        return self._wait(error, step, retry)

    def _wait(self, error: CheckpointSaveError, step: int, retry: Callable[[], Path]) -> Path:
        limit = self.tc.disk_full_wait_s
        self.rt.log(
            f"{error}; training paused at step {step} (train.on_disk_full wait): looking for room every "
            f"{self.retry_s:g} s for up to {limit:g} s; free space in {self.run_dir}"
        )
        start = time.monotonic()
        while True:
            # rank 0 decides (its clock, its view of the shared run folder); every rank acts on that
            look = None
            if self.rt.is_main:
                left = limit - (time.monotonic() - start)
                time.sleep(max(0.0, min(self.retry_s, left)))
                free = free_bytes(self.run_dir)
                roomy = free is None or error.needed is None or free >= error.needed
                look = "try" if roomy else ("give up" if time.monotonic() - start >= limit else "wait")
            look = self.rt.broadcast_object(look)
            if look == "give up":
                raise self.stop(error, step, f"train.on_disk_full wait: no room after {limit:g} s")
            if look == "try":
                try:
                    path = retry()
                    self.rt.log(f"disk: room again after {time.monotonic() - start:.0f} s; training resumes")
                    return path
                except CheckpointSaveError as again:  # still too little (or something else filled it)
                    error = again
                expired = time.monotonic() - start >= limit if self.rt.is_main else None
                if self.rt.broadcast_object(expired):
                    raise self.stop(error, step, f"train.on_disk_full wait: no room after {limit:g} s")

    def saved(self) -> None:
        """A checkpoint succeeded: whatever failed before is made good."""
        self.unsaved = None

    # ---- the end --------------------------------------------------------------------------------------
    def check_end(self, step: int) -> None:
        """continue: a run whose last state is unsaved ends with a DiskError (exit 2), never silently."""
        if self.unsaved is not None:
            raise self.stop(self.unsaved, step, "its last state is unsaved (train.on_disk_full continue)")

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
