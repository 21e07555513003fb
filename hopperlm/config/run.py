"""Where a run writes (run), what it reports (log) and how it spreads over GPUs (parallel)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hopperlm.errors import ConfigError


@dataclass
class LogConfig:
    progress: Literal["auto", "rich", "plain"] = "auto"
    """Console progress: auto = a live rich display when stdout is a terminal, plain lines otherwise (CI, SLURM);
    both show the ETA of whichever stopping rule ends the run first."""
    tensorboard: bool = True
    """Write TensorBoard event files to RUN_DIR/tensorboard (view with `tensorboard --logdir RUN_DIR`)."""
    wandb: bool = False
    """Also log to Weights & Biases (`pip install wandb`); the run id is kept in RUN_DIR so resumes continue it."""
    wandb_project: str = "hopperlm"
    """W&B project name."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """offline writes RUN_DIR/wandb/ for a later `wandb sync`; online needs `wandb login`."""
    csv: bool = False
    """Also write RUN_DIR/metrics.csv: the metrics.jsonl fields as columns, one row per log step."""
    gpu_monitor: bool = True
    """On CUDA, sample GPU utilisation, power, temperature and memory with NVML (`pip install nvidia-ml-py`)."""
    report: bool = True
    """At the end of training write RUN_DIR/report.md and report.html (summary, plan, events, plots)."""


@dataclass
class EvalConfig:
    tasks: str | None = None
    """lm-evaluation-harness tasks to run during training, comma-separated (e.g. hellaswag,arc_easy; needs
    pip install 'hopperlm[eval]'); each metric goes to metrics.jsonl (`tasks`), TensorBoard/W&B (tasks/...)
    and the report. null = none."""
    every: int = 0
    """Steps between task evaluations (taken at the next log step); 0 = once, at the end of the run."""
    limit: int | None = None
    """Only the first N examples of each task (null = all): tasks during training are usually a quick check."""
    num_fewshot: int | None = None
    """Examples in each prompt; null = each task's own default."""
    include_path: str | None = None
    """A folder of task YAMLs of your own (e.g. on local files: dataset_path json with data_files)."""
    batch: int = 8
    """Requests per forward pass."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ConfigError(f"eval.every={self.every} must be >= 0 (0: once, at the end)")
        if self.batch < 1 or (self.limit is not None and self.limit < 1):
            raise ConfigError(f"eval.batch={self.batch} and eval.limit={self.limit} must be >= 1")
        if self.tasks is not None and not [t for t in self.tasks.split(",") if t.strip()]:
            raise ConfigError("eval.tasks is empty; name tasks (e.g. hellaswag,arc_easy) or set it to null")


# parallel.step_timeout_s null: the collective limit per step is max(floor, factor x the slowest step so far)
STEP_LIMIT_FLOOR_S = 60.0
STEP_LIMIT_FACTOR = 10.0


@dataclass
class ParallelConfig:
    strategy: Literal["auto", "ddp", "fsdp", "hsdp", "none"] = "auto"
    """Data parallelism under torchrun: ddp (a replica per rank), fsdp (FSDP2: parameters, gradients and
    optimizer state sharded over all ranks), hsdp (sharded within groups of shard_size ranks, replicated
    across them); auto = none for one process, else ddp when the model and its AdamW state fit one GPU,
    fsdp otherwise."""
    shard_size: int | None = None
    """hsdp: ranks that share one copy of the model; null = the processes of one node (LOCAL_WORLD_SIZE)."""
    startup_timeout_s: float = 600.0
    """Seconds a collective may wait for the other ranks through start-up (loading, data checks, compile, the
    first log step) and in the long phases after it (evaluation, checkpoint saves): generous, since one rank
    may be slower there for good reasons."""
    step_timeout_s: float | None = None
    """Seconds a collective may wait once training runs; past it the job stops with one line naming the rank
    that stopped answering (parallel/watchdog.py). null = the larger of 60 s and 10x the slowest step so far
    (measured on log steps)."""

    def __post_init__(self) -> None:
        if self.shard_size is not None and self.shard_size < 1:
            raise ConfigError(f"parallel.shard_size={self.shard_size} must be >= 1 (or null)")
        for key in ("startup_timeout_s", "step_timeout_s"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ConfigError(f"parallel.{key}={value} must be positive")


@dataclass
class CheckpointConfig:
    """Every checkpoint setting: when a run saves, what it keeps, in which format, and what a full disk does.
    hopperlm/checkpoint/ reads this section alone."""

    every: int = 1000
    """Checkpoint every this many steps (on log steps, after the stability guard has reviewed them), and at
    the end; 0 = only at the end."""
    keep_last: int = 3
    """Checkpoints kept on disk; older ones are deleted after a newer one is complete."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this (milestones); 0 = none."""
    format: Literal["auto", "single", "sharded"] = "auto"
    """single: model.safetensors + optimizer.pt, written by rank 0; sharded: every rank writes its part through
    torch.distributed.checkpoint; auto = sharded for fsdp/hsdp (and async saves), single otherwise. Both load
    at any world size."""
    async_save: bool = False
    """Sharded checkpoints: copy the state to CPU memory and write the files in a background thread while
    training goes on; the checkpoint is completed (checksums, rename) at the next save or at the end."""
    on_disk_full: Literal["stop", "continue", "wait"] = "stop"
    """When a checkpoint cannot be written (a full disk, a quota, a read-only or failing filesystem; the
    previous checkpoint is always kept): `stop` exits at once (code 2) naming the latest complete checkpoint
    and the resume command; `continue` warns once per failed checkpoint and trains on, and exits non-zero if
    the run ends with its last state unsaved; `wait` pauses before the next step and retries every
    disk_full_retry_s until there is room or disk_full_wait_s pass, then stops. Default stop: a full disk
    seldom empties by itself, a stopped run loses at most the steps since its last checkpoint (as a
    preemption does) and frees its GPUs at once, where `continue` risks hours of unsaved work and `wait`
    holds idle GPUs; choose wait where a person or a clean-up job frees space."""
    disk_full_retry_s: float = 60.0
    """on_disk_full wait: seconds between looks for free space (several ranks: at most half of
    parallel.startup_timeout_s, the collective limit of the checkpoint phase)."""
    disk_full_wait_s: float = 1800.0
    """on_disk_full wait: seconds to wait for space before stopping as `stop` does."""

    def __post_init__(self) -> None:
        if self.keep_last <= 0:
            raise ConfigError(f"checkpoint.keep_last={self.keep_last} must be positive")
        for name in ("every", "keep_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"checkpoint.{name}={getattr(self, name)} must be >= 0")
        if self.disk_full_retry_s <= 0 or self.disk_full_wait_s < 0:
            raise ConfigError(
                "checkpoint.disk_full_retry_s must be positive and checkpoint.disk_full_wait_s >= 0"
            )
        if self.async_save and self.format == "single":
            raise ConfigError(
                "checkpoint.async_save needs the sharded format; set checkpoint.format sharded or auto"
            )


@dataclass
class RunConfig:
    out_dir: str = "runs/default"
    """Run directory: config.yaml, metrics.jsonl, tokenizer and checkpoints/ go here."""
