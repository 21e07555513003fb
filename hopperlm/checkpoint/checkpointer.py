"""The run's one owner of checkpoints: when to save, in which format, what is kept, what a full disk does, and
resuming every part in one call.

    set-up   start = find_resume(resume, run_dir, rt)            which checkpoint a run starts from (or None)
             checkpointer = Checkpointer(cfg.checkpoint, rt, Parts(...), state, run_dir=..., ...)
             checkpointer.check_room(...)                         before the first step: the checkpoints fit
             checkpointer.load(start)                             weights, optimizer, scaler, RNGs, TrainState
    loop     checkpointer.step(step, last=...)                    the loop's one call: saves when one is due
             checkpointer.latest() / roll_back(path, bad_step)    the stability guard's rollback
             checkpointer.close(step); checkpointer.check_end(step)   the run's end

A save is due every checkpoint.every steps (the loop calls `step` on the steps the stability guard has
reviewed), at the run's last step (a budget, a target, a preemption signal, a guard stop), and before the first
step of a run whose guard rolls back when none exists yet. The formats are single.py's (one process, DDP: rank
0 writes while the others wait) and sharded.py's (FSDP: every rank writes its shards, optionally in the
background); either loads at any world size. A save that cannot be written goes to disk.py's policy
(checkpoint.on_disk_full).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch

from hopperlm.checkpoint.disk import DiskFull, checkpoint_bytes
from hopperlm.checkpoint.layout import (
    RNG_FILE,
    checkpoint_dir,
    is_sharded,
    latest_valid_checkpoint,
    list_checkpoints,
    read_model_config,
    read_state,
    resolve_model_dir,
    verify_checkpoint,
)
from hopperlm.checkpoint.sharded import (
    Pending,
    finish_pending,
    load_sharded,
    load_single_into_shards,
    save_sharded,
)
from hopperlm.checkpoint.single import (
    CheckpointSaveError,
    Parts,
    load_model_weights,
    load_training_state,
    rng_state,
    save_checkpoint,
)
from hopperlm.config import CheckpointConfig, LoRAConfig, TrainConfig
from hopperlm.errors import CheckpointError
from hopperlm.files import tree_bytes
from hopperlm.parallel.runtime import Runtime
from hopperlm.parallel.watchdog import restart_count
from hopperlm.plan.strategy import SHARDED

# False: a new run; True or "latest": the run's latest valid checkpoint; "auto": that if the run has any
# checkpoint, else a new run (what a requeued SLURM job passes); a path: that checkpoint (or model folder)
Resume = bool | Literal["latest", "auto"] | str | Path


@dataclass
class ResumePoint:
    """The checkpoint a run starts from and its state.json. The plan is made before the model exists, so the
    things it keeps from the checkpoint are read here: the micro-batch (the data of step s depends on it), the
    attention kernel and Muon's Newton–Schulz precision (each pair rounds differently). Everything else is
    restored by `load`."""

    path: Path
    saved: dict[str, Any]

    @property
    def micro_batch(self) -> tuple[int, int] | None:
        """(micro-batch for all ranks together, accumulation), or None for a checkpoint that has none."""
        micro = self.saved.get("micro_batch")
        return (micro, self.saved["grad_accum"]) if micro else None

    @property
    def attention(self) -> str | None:
        return self.saved.get("attention")  # (older checkpoints: none)

    @property
    def muon_ns(self) -> str:
        """Muon's Newton–Schulz precision: older checkpoints have none and trained bf16 on every device."""
        return self.saved.get("muon_ns", "bf16")

    @property
    def device_type(self) -> str | None:
        """The kind of device the run trained on ("cuda", "cpu"; older checkpoints: none)."""
        return self.saved.get("device_type")

    @property
    def threads(self) -> int | None:
        """torch's CPU threads the run trained with (older checkpoints: none)."""
        return self.saved.get("threads")


def find_resume(resume: Resume, run_dir: Path, rt: Runtime) -> ResumePoint | None:
    """The checkpoint a run starts from (None: a new run). The one place `--resume` is interpreted. A group
    restarted by `hopperlm launch --max-restarts` continues from its latest checkpoint whatever the first
    attempt was asked (`auto`: it may have failed before its first checkpoint)."""
    if restart_count() > 0 and resume in (False, None):
        rt.log(f"restart {restart_count()} of this job: continuing from the latest checkpoint, if any")
        resume = "auto"
    if resume == "auto":
        resume = bool(list_checkpoints(run_dir))
    if resume is False or resume is None:
        if list_checkpoints(run_dir):
            raise CheckpointError(
                f"{run_dir} already holds checkpoints; pass --resume to continue it, or --run.out_dir NEW_DIR"
            )
        return None
    if resume is True or resume == "latest":
        path = latest_valid(run_dir, rt)
        if path is None:
            raise CheckpointError(
                f"--resume: {run_dir} has no valid checkpoint; drop --resume to start a new run"
            )
    else:
        path = resolve_model_dir(resume)
    return ResumePoint(path, read_state(path))


def latest_valid(run_dir: Path, rt: Runtime) -> Path | None:
    """The newest checkpoint whose files verify; with several ranks each verifies a share of the files and
    all agree on the answer (rank 0's listing decides which checkpoints there are)."""
    if rt.world_size == 1:
        return latest_valid_checkpoint(run_dir, rt.log)
    found = rt.broadcast_object([str(p) for p in list_checkpoints(run_dir)] if rt.is_main else None)
    for name in reversed(found):
        ckpt = Path(name)
        problems = [p for p in rt.all_gather_object(verify_checkpoint(ckpt, (rt.rank, rt.world_size))) if p]
        if not problems:
            return ckpt
        rt.log(f"warning: checkpoint {ckpt} is corrupt ({problems[0]}); falling back to the one before it")
    return None


class RunState(Protocol):
    """What a run changes as it goes, saved as state.json: train/state.py's TrainState (a layer above this
    one, so named here by the three calls the checkpointer makes on it)."""

    def state_dict(self, world_size: int) -> dict[str, Any]: ...

    def load_state_dict(self, saved: dict[str, Any]) -> None: ...

    def roll_back(self, saved: dict[str, Any], bad_step: int) -> None: ...


class Checkpointer:
    """A run's checkpoints, built once from the checkpoint section and every part a checkpoint holds: the
    loop's `step(step)` saves when one is due, `load` resumes, `roll_back` returns to a good checkpoint."""

    def __init__(
        self,
        cc: CheckpointConfig,
        rt: Runtime,
        parts: Parts,
        state: RunState,
        *,
        run_dir: Path,
        strategy: str,
        verb: str = "train",
        collective_limit_s: float = 600.0,
        rollback_base: bool = False,
    ) -> None:
        """`strategy`: the plan's (the format follows it: checkpoint.format auto); `verb`: the command a stop
        line tells to resume with; `collective_limit_s`: parallel.startup_timeout_s, which bounds a wait for
        room; `rollback_base`: the guard rolls back, so a run with no checkpoint saves one before its first
        step."""
        self.cc, self.rt, self.parts, self.state = cc, rt, parts, state
        self.run_dir, self.strategy, self.log = Path(run_dir), strategy, rt.log
        self.keep = (cc.keep_last, cc.keep_every)
        if cc.format != "auto":
            self.format = cc.format
        else:
            self.format = "sharded" if strategy in SHARDED or cc.async_save else "single"
        self.disk = DiskFull(cc, rt, run_dir=self.run_dir, verb=verb, collective_limit_s=collective_limit_s)
        self.rollback_base = rollback_base
        self.saved_step: int | None = None  # the step the newest checkpoint holds (saved, or loaded)
        self._pending: Pending | None = None  # a background save
        self._group = None  # async: the background writer's process group (None: the default one)
        if cc.async_save:
            if not rt.active:  # the background writer would say so on every save
                warnings.filterwarnings(
                    "ignore", message="torch.distributed is disabled, unavailable or uninit"
                )
            elif rt.backend == "nccl":
                import torch.distributed as dist

                # the background writer's collectives go over gloo, never beside training's NCCL ones
                self._group = dist.new_group(backend="gloo")

    # ---- before the first step -------------------------------------------------------------------------------
    def check_room(
        self, budget: TrainConfig, *, optimizer: str, lora: LoRAConfig | None, tokens_per_step: int
    ) -> str:
        """DiskError on every rank when the checkpoints the run holds at once (keep_last, the one being
        written, the keep_every milestones its `budget` will reach) cannot fit; returns the plan's line
        about it. `optimizer`: the plan's (its state's size)."""
        size = checkpoint_bytes(self.parts.model_cfg, optimizer, lora)
        if self.parts.tokenizer_dir is not None:
            size += tree_bytes(self.parts.tokenizer_dir)
        step = self.saved_step or 0
        return self.disk.preflight(size, budget, step=step, tokens_per_step=tokens_per_step)

    def watch(self, signalled: Callable[[], str | None]) -> None:
        """The loop's preemption signal (None until one came): it ends a wait for room (on_disk_full wait)."""
        self.disk.watch(signalled)

    # ---- the loop's one call ---------------------------------------------------------------------------------
    def step(self, step: int, *, last: bool = False) -> Path | None:
        """Save when a checkpoint is due at `step`: every checkpoint.every steps, at the run's `last` step,
        or before the first step of a rollback-guarded run that has none. A step already saved (or resumed
        from) is not saved again. Returns the checkpoint written, or None."""
        first_of_rollback_run = (
            self.rollback_base and self.saved_step is None and not list_checkpoints(self.run_dir)
        )
        self.rollback_base = False  # asked once: a failed save (on_disk_full continue) is not retried
        due = last or first_of_rollback_run or bool(self.cc.every and step and step % self.cc.every == 0)
        if not due or step == self.saved_step:
            return None
        try:
            path = self.save(step)
        except CheckpointSaveError as e:
            path = self.disk.failed(e, step, retry=lambda: self.save(step))
            if path is None:  # on_disk_full continue: the run trains on without it
                return None
        self.disk.saved()
        self.log(f"checkpoint: {path}")
        return path

    # ---- saving ----------------------------------------------------------------------------------------------
    def save(self, step: int, *, wait: bool = False) -> Path:
        """A checkpoint of the run as it stands, as step `step`; every rank calls it. CheckpointSaveError on
        every rank when any rank could not write its part (the previous checkpoints are untouched). An async
        save returns once the state is copied and completes at the next save, `finish()` or `latest()`;
        `wait`: complete it before returning."""
        with self.rt.long_phase("checkpoint"):  # collectives get the start-up limit while it writes
            record = self.state.state_dict(self.rt.world_size)  # (read before a background save completes)
            self.finish()
            rank_rng = self.rt.all_gather_object(rng_state()[1]) if self.rt.world_size > 1 else None
            if self.format == "single":
                path = self._save_single(step, record, rank_rng)
            else:
                saved = save_sharded(
                    self.rt, self.run_dir, step, self.parts, record, keep=self.keep, rank_rng=rank_rng,
                    background=self.cc.async_save,
                    group=self._group,
                )  # fmt: skip
                if isinstance(saved, Pending):
                    self._pending, path = saved, saved.final
                else:
                    path = saved
            if wait:
                self.finish()
        self.saved_step = step
        return path

    def _save_single(self, step: int, record: dict[str, Any], rank_rng: list | None) -> Path:
        """Rank 0 holds the whole state (one process, DDP) and writes it; the others wait for its word."""
        error = None
        if self.rt.is_main:
            try:
                save_checkpoint(self.run_dir, step, self.parts, record, keep=self.keep, rank_rng=rank_rng)
            except CheckpointSaveError as e:
                error = (str(e), e.latest, e.needed)
        error = self.rt.broadcast_object(error)
        if error:
            message, latest, needed = error
            raise CheckpointSaveError(message, latest=latest, needed=needed)
        return checkpoint_dir(self.run_dir, step)

    def finish(self) -> None:
        """Complete a background save (waits for its files); every rank calls it at the same point."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        finish_pending(self.rt, self.run_dir, pending, self.keep)
        self.log(f"checkpoint: {pending.final} complete (written in the background)")

    # ---- the run's end ---------------------------------------------------------------------------------------
    def close(self, step: int) -> None:
        """A background checkpoint completes before the run ends; one that failed goes to the disk policy."""
        try:
            with self.rt.long_phase("finishing"):
                self.finish()
        except CheckpointSaveError as e:
            if self.disk.failed(e, step, retry=lambda: self.save(step, wait=True)) is not None:
                self.disk.saved()

    def check_end(self, step: int) -> None:
        """on_disk_full continue: a run whose last state is unsaved ends with a DiskError, never silently."""
        self.disk.check_end(step)

    # ---- loading ---------------------------------------------------------------------------------------------
    def latest(self) -> Path | None:
        """The newest complete checkpoint of the run whose files verify (None: there is none); a background
        save completes first. Every rank calls it and gets the same answer."""
        self.finish()
        return latest_valid(self.run_dir, self.rt)

    def load(self, start: ResumePoint | Path) -> dict[str, Any]:
        """Resume from a checkpoint (either format, any world size): weights, optimizer, scaler and RNG states
        into the run's parts, and state.json into its state (`load_state_dict`: step, tokens, clock, guard,
        data position, the schedule's budget). Returns state.json."""
        path = start.path if isinstance(start, ResumePoint) else Path(start)
        if read_model_config(path) != self.parts.model_cfg:
            raise CheckpointError(
                f"{path} was trained with a different model section; resume with the run's own config "
                f"({self.run_dir / 'config.yaml'})"
            )
        saved = self._load_parts(path)
        self.state.load_state_dict(saved)
        self.saved_step = saved["step"]
        return saved

    def roll_back(self, path: Path, bad_step: int) -> dict[str, Any]:
        """Back to the checkpoint `path` after divergence at `bad_step`: the parts as `load` restores them,
        the state through its `roll_back` (the guard's counters and the data stream go on). Returns
        state.json."""
        saved = self._load_parts(path)
        self.state.roll_back(saved, bad_step)
        self.saved_step = saved["step"]
        return saved

    def _load_parts(self, ckpt: Path) -> dict[str, Any]:
        """Weights, optimizer, scaler and RNG states from either format into this run's (possibly sharded)
        model; returns state.json."""
        if is_sharded(ckpt):
            state = load_sharded(self.rt, ckpt, self.parts)
        elif self.strategy in SHARDED:
            state = load_single_into_shards(ckpt, self.parts)
        else:
            load_model_weights(ckpt, self.parts.model)
            state = load_training_state(ckpt, self.parts.optimizer, self.parts.scaler)
        self._restore_rank_rng(ckpt, state)
        return state

    def _restore_rank_rng(self, ckpt: Path, state: dict[str, Any]) -> None:
        """Each rank continues its own RNG stream (dropout) when the checkpoint has one for it; ranks beyond
        the checkpoint's world size get a fresh stream from (step, rank)."""
        rt = self.rt
        if rt.world_size == 1:
            return  # rank 0's streams, restored with the rest of the state
        saved = torch.load(ckpt / RNG_FILE, map_location="cpu", weights_only=True).get("ranks") or []
        if rt.rank < len(saved):
            torch.set_rng_state(saved[rt.rank]["torch"])
            if "cuda" in saved[rt.rank] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(saved[rt.rank]["cuda"])
        elif saved or rt.rank > 0:  # (rank 0 keeps a one-process checkpoint's stream, restored already)
            torch.manual_seed(
                int(np.random.SeedSequence([state["step"], rt.rank, 0x5EED]).generate_state(1)[0])
            )
        if len(saved) != rt.world_size:
            self.log(
                f"resume: the checkpoint holds RNG streams for {len(saved) or 1} rank(s), this run has "
                f"{rt.world_size}; the others start new streams (dropout masks differ from an uninterrupted run)"
            )
