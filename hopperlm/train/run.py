"""One training run, set up: `setup_run(cfg, resume, runtime)` builds the `Run` the loop steps (train/loop.py).

A `Run` holds what is built once and the loop touches (the model and the parts of its training step, the
batches, the checkpointer, the stability guard, the observer) and the `TrainState` (train/state.py): everything
that changes as the run goes, which every checkpoint saves and a resume restores. The plan never changes; what
changes while the run goes (the micro-batch after an out-of-memory error, a float8 backend that failed at
start-up) lives in the state and is logged.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from hopperlm.checkpoint import layout as ckpt_io
from hopperlm.config import Config, ModelConfig, OptimConfig, TrainConfig, save_config
from hopperlm.config.training import BUDGET_KEYS, checkpoint_budget
from hopperlm.data.batches import BatchLayout, BatchSource
from hopperlm.data.tokenizer import load_tokenizer
from hopperlm.data.train_data import default_prefetch
from hopperlm.errors import CheckpointError
from hopperlm.files import tree_bytes
from hopperlm.hardware import Hardware, detect_for
from hopperlm.memory import checkpoint_bytes
from hopperlm.model.lora import training_flops_per_token
from hopperlm.observe.observer import NullObserver, RunObserver
from hopperlm.parallel import checkpoint as dist_ckpt
from hopperlm.parallel.runtime import Clock, Runtime, unwritable_run_dir
from hopperlm.parallel.watchdog import restart_count
from hopperlm.plan import SHARDED, Plan
from hopperlm.schedule import budget_progress, lr_at
from hopperlm.train.banner import predicted_tokens_per_s, print_banner
from hopperlm.train.data_and_plan import RunData, open_run_data, plan_run, resolve_model_config
from hopperlm.train.disk_full import DiskFull
from hopperlm.train.eval_tasks import EvalTasks
from hopperlm.train.guard import Guard
from hopperlm.train.initial_model import EmbedWarmup, build_train_model
from hopperlm.train.state import TrainState
from hopperlm.train.step import StepParts, build_step

# False: a new run; True or "latest": the run's latest valid checkpoint; "auto": that if the run has any
# checkpoint, else a new run (what a requeued SLURM job passes); a path: that checkpoint (or model folder)
Resume = bool | Literal["latest", "auto"] | str | Path


def resolve_resume(resume: Resume, run_dir: Path, rt: Runtime, log: Callable[[str], None]) -> Path | None:
    """The checkpoint a run starts from (None: a new run). The one place `--resume` is interpreted. A group
    restarted by `hopperlm launch --max-restarts` continues from its latest checkpoint whatever the first
    attempt was asked (`auto`: it may have failed before its first checkpoint)."""
    if restart_count() > 0 and resume in (False, None):
        rt.log(f"restart {restart_count()} of this job: continuing from the latest checkpoint, if any")
        resume = "auto"
    if resume == "auto":
        resume = bool(ckpt_io.list_checkpoints(run_dir))
    if resume is False or resume is None:
        if ckpt_io.list_checkpoints(run_dir):
            raise CheckpointError(
                f"{run_dir} already holds checkpoints; pass --resume to continue it, or --run.out_dir NEW_DIR"
            )
        return None
    if resume is True or resume == "latest":
        found = dist_ckpt.latest_valid(run_dir, rt, log)
        if found is None:
            raise CheckpointError(
                f"--resume: {run_dir} has no valid checkpoint; drop --resume to start a new run"
            )
        return found
    return ckpt_io.resolve_model_dir(resume)


@dataclass
class Run:
    cfg: Config
    rt: Runtime
    hw: Hardware
    plan: Plan
    model_cfg: ModelConfig
    data: RunData
    model: torch.nn.Module
    parts: StepParts  # what train_step touches: the wrapped model, optimizer, scaler
    batches: BatchSource
    checkpointer: dist_ckpt.Checkpointer
    guard: Guard
    observer: RunObserver | NullObserver
    embed_warmup: EmbedWarmup | None
    state: TrainState  # everything that changes as the run goes: what a checkpoint saves (train/state.py)
    disk_full: DiskFull  # room checked before the first step; what a checkpoint that cannot be written does
    flops_per_token: int
    predicted: tuple[float, float]  # (tokens/s bound, matmul FLOP/s measured here)
    eval_tasks: EvalTasks | None = None  # lm-eval tasks during training (the eval section)

    @property
    def log(self) -> Callable[[str], None]:
        return self.rt.log

    @property
    def elapsed(self) -> Clock:
        """Seconds of training across resumes (several ranks: rank 0's, agreed on log steps)."""
        return self.state.clock

    @property
    def schedule_budget(self) -> TrainConfig:
        """The budget the LR schedule is laid over (schedule_budget below)."""
        return self.state.schedule_budget

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run.out_dir)

    @property
    def tokens_per_step(self) -> int:
        return self.plan.tokens_per_step  # an out-of-memory halving keeps the global batch


def checkpointer_for(
    cfg: Config, rt: Runtime, plan: Plan, *, model, model_cfg: ModelConfig, parts, state: TrainState
) -> dist_ckpt.Checkpointer:
    """Built once with everything a checkpoint holds (the loop then calls save(step), latest(), roll_back()),
    the format the plan's strategy calls for and train's keep policy."""
    run_dir = Path(cfg.run.out_dir)
    return dist_ckpt.Checkpointer(
        rt,
        run_dir=run_dir,
        strategy=plan.strategy,
        cfg=cfg.parallel,
        model=model,
        model_cfg=model_cfg,
        optimizer=parts.optimizer,
        scaler=parts.scaler,
        state=state,
        tokenizer_dir=run_dir / "tokenizer",  # (prepare_run_dir writes it)
        keep_last=cfg.train.keep_last,
        keep_every=cfg.train.keep_every,
    )


def setup_run(cfg: Config, resume: Resume, rt: Runtime) -> Run:
    """Everything before the first step: the checkpoint to start from, the data, the plan, the model and its
    step, the restored state, the run directory, the banner and the observer."""
    run_dir, log = Path(cfg.run.out_dir), rt.log
    resume_from = resolve_resume(resume, run_dir, rt, log)
    data = open_run_data(cfg, run_dir, log, writer=rt.is_main)
    model_cfg = resolve_model_config(cfg.model, data.manifest["vocab_size"])
    saved = ckpt_io.read_state(resume_from) if resume_from is not None else None
    kept = keep_checkpoint_batch(cfg.train, saved, rt)
    cfg = cfg if kept is cfg.train else dataclasses.replace(cfg, train=kept)
    hw = detect_for(cfg.train.device)
    cache_dir = run_dir if rt.world_size == 1 else run_dir / "ranks" / str(rt.rank)
    kept_attention = saved.get("attention") if saved is not None else None  # (older checkpoints: none)
    plan = plan_run(
        cfg, model_cfg, hw, world=rt.world, cache_dir=cache_dir, log=log, rt=rt, kept_attention=kept_attention
    )
    plan.apply_runtime_settings(log)

    model, embed_warmup = model_for_run(cfg, model_cfg, plan=plan, data=data, rt=rt, resume_from=resume_from)
    parts, fp8 = build_step(model, plan, cfg.optim, log=log, rt=rt)
    guard = Guard(cfg.guard, run_dir / "events.jsonl" if rt.is_main else Path(os.devnull), log)
    # each rank reads its block of every global micro-batch
    layout = BatchLayout(plan.micro_batch, plan.grad_accum, rt.rank, rt.world_size)
    batches = data.batches(layout, pin=plan.pin_memory, prefetch=default_prefetch(cfg.data, plan.device))
    state = TrainState(
        plan.micro_batch, plan.grad_accum, fp8, attention=plan.attention, guard=guard, batches=batches
    )
    state.run_record = {"config": cfg.to_dict(), "data_manifest_tokenizer": data.manifest["tokenizer"]}
    checkpointer = checkpointer_for(cfg, rt, plan, model=model, model_cfg=model_cfg, parts=parts, state=state)
    elapsed_before = 0.0
    if resume_from is not None:
        checkpointer.load(resume_from)  # weights, optimizer, scaler and RNGs into the parts; the state
        elapsed_before = saved["elapsed_s"]

    fpt = training_flops_per_token(model_cfg, cfg.train.seq_len, cfg.lora)  # LoRA: no frozen weight grads
    predicted = predicted_tokens_per_s(plan, fpt)
    prepare_run_dir(cfg, rt, data.data_dir)
    disk_full = DiskFull(
        cfg.train, cfg.parallel, rt, run_dir=run_dir, verb="finetune" if cfg.sft.path else "train"
    )
    # before any step: keep_last + 1 checkpoints (weights, optimizer state, the tokenizer copied) and the
    # keep_every milestones to come must fit
    room_line = disk_full.preflight(
        checkpoint_bytes(model_cfg, plan.optimizer, cfg.lora) + tree_bytes(run_dir / "tokenizer"),
        step=state.step,
        tokens_per_step=plan.tokens_per_step,
    )
    print_banner(
        log,
        run_dir=run_dir,
        resume_from=resume_from,
        step=state.step,
        hw=hw,
        plan=plan,
        model_cfg=model_cfg,
        tc=cfg.train,
        manifest=data.manifest,
        fpt=fpt,
        predicted=predicted,
    )
    log(room_line)
    state.schedule_budget = schedule_budget(
        cfg.train, cfg.optim, saved=saved, state=state, elapsed_s=elapsed_before, log=log
    )
    state.clock = rt.start_clock(elapsed_before)  # several ranks: rank 0's clock, agreed on log steps
    observer = open_observer(
        cfg,
        rt,
        hw,
        plan,
        model_cfg,
        fpt,
        predicted,
        (state.step, state.tokens, elapsed_before),
        state.schedule_budget,
    )
    return Run(
        cfg=cfg,
        rt=rt,
        hw=hw,
        plan=plan,
        model_cfg=model_cfg,
        data=data,
        model=model,
        parts=parts,
        batches=batches,
        checkpointer=checkpointer,
        guard=guard,
        observer=observer,
        embed_warmup=embed_warmup,
        state=state,
        disk_full=disk_full,
        flops_per_token=fpt,
        predicted=predicted,
        eval_tasks=EvalTasks(cfg.eval, run_dir, rt, plan.strategy, log) if cfg.eval.tasks else None,
    )


def model_for_run(
    cfg: Config,
    model_cfg: ModelConfig,
    *,
    plan: Plan,
    data: RunData,
    rt: Runtime,
    resume_from: Path | None,
) -> tuple[torch.nn.Module, EmbedWarmup | None]:
    """The model the run trains, the same on every rank: seeded, built by `build_train_model` (from scratch,
    `init_from`, LoRA) on the plan's device, and checked against the checkpoint it resumes from, whose weights
    are loaded after. (`model.transformer.build_model` builds the bare network from a ModelConfig.)"""
    torch.manual_seed(cfg.train.seed)
    model, embed_warmup = build_train_model(
        cfg,
        model_cfg,
        device=plan.device,
        compute_dtype=plan.autocast_dtype,
        data_tokenizer=data.tokenizer,
        load=resume_from is None or cfg.lora.enabled,  # a resumed full run's checkpoint holds every weight
        log=rt.log,
        sharded=plan.strategy in SHARDED,
    )
    rt.seed_per_rank(cfg.train.seed)
    if resume_from is not None and ckpt_io.read_model_config(resume_from) != model_cfg:
        raise CheckpointError(
            f"{resume_from} was trained with a different model section; resume with the run's own "
            f"config ({Path(cfg.run.out_dir) / 'config.yaml'})"
        )
    return model, embed_warmup


def open_observer(
    cfg: Config,
    rt: Runtime,
    hw: Hardware,
    plan: Plan,
    model_cfg: ModelConfig,
    fpt: int,
    predicted: tuple[float, float],
    start: tuple[int, int, float],
    budget: TrainConfig,
) -> RunObserver | NullObserver:
    """metrics.jsonl (truncated to the checkpoint's step), TensorBoard, W&B, CSV, progress, GPU monitor,
    plan.json, the loss forecast: rank 0 observes, the other ranks' observer does nothing. `start`: (step,
    tokens, elapsed); `budget`: what the LR schedule is laid over (schedule_budget), which the forecast follows."""
    if not rt.is_main:
        return NullObserver()
    step, tokens, elapsed_s = start
    return RunObserver(
        cfg,
        Path(cfg.run.out_dir),
        log=rt.log,
        hw=hw,
        plan=plan,
        model_cfg=model_cfg,
        fpt=fpt,
        predicted=predicted,
        step=step,
        tokens=tokens,
        elapsed_s=elapsed_s,
        schedule_budget=budget,
    )


def schedule_budget(
    tc: TrainConfig,
    oc: OptimConfig,
    *,
    saved: dict | None,
    state: TrainState,
    elapsed_s: float,
    log: Callable[[str], None],
) -> TrainConfig:
    """The budget the LR schedule is laid over: the run's own, or, when a resumed run changed it and
    optim.resume_horizon is keep, the checkpoint's. Says in one line how the LR changes at the resume step."""
    # the budget the checkpoint's schedule was laid over (a run resumed with keep remembers its original)
    original = checkpoint_budget(saved, tc)
    if original is None:
        return tc
    chosen = original if oc.resume_horizon == "keep" else tc

    def lr(budget: TrainConfig) -> float:
        return lr_at(
            state.step, budget_progress(state.step, state.tokens, elapsed_s, budget, oc.warmup_steps), oc
        )

    changed = ", ".join(
        f"{k} {getattr(original, k)} -> {getattr(tc, k)}"
        for k in BUDGET_KEYS
        if getattr(original, k) != getattr(tc, k)
    )
    if oc.resume_horizon == "keep":
        how, other = "the original schedule kept (its decay ends at the original budget)", "extend"
    elif oc.schedule == "wsd":
        how, other = "WSD's stable phase lengthened to the new budget", "keep"
    elif oc.schedule == "constant":
        how, other = "constant LR, nothing to re-lay", "keep"
    else:
        how, other = f"{oc.schedule} decay re-laid over the new budget", "keep"
    log(
        f"resume: budget changed ({changed}): {how}; LR at step {state.step} {lr(original):.3g} -> "
        f"{lr(chosen):.3g} (optim.resume_horizon {other} for the other choice)"
    )
    return chosen


def keep_checkpoint_batch(tc: TrainConfig, saved: dict | None, rt: Runtime) -> TrainConfig:
    """The data of step s depends on the micro-batch: keep the checkpoint's (measured, or halved after an
    out-of-memory error) rather than planning anew. It is saved for all ranks together (one global
    micro-batch per micro-step), so any world size that divides it reads the same windows. Returns `tc`
    itself when there is nothing to keep."""
    if saved is None or not saved.get("micro_batch"):
        return tc
    micro, accum = saved["micro_batch"], saved["grad_accum"]
    per_rank = micro // rt.world_size if micro % rt.world_size == 0 else None
    if (per_rank, micro * accum * tc.seq_len) != (tc.micro_batch, tc.batch_tokens):
        rt.log(f"resume: micro-batch {micro} x {accum} accumulation (all ranks) from the checkpoint")
    if per_rank is None:
        rt.log(
            f"resume: {micro} sequences per micro-step do not split over {rt.world_size} ranks; the global "
            "batch is kept but the remaining steps read other windows than an uninterrupted run would"
        )
    return dataclasses.replace(tc, micro_batch=per_rank, batch_tokens=micro * accum * tc.seq_len)


def prepare_run_dir(cfg: Config, rt: Runtime, data_dir: Path) -> None:
    """Fail at start-up, not at the first checkpoint an hour later; then the run's config and tokenizer. (Rank 0
    holds the folder's lock from the session's start on: parallel/runtime.py `hold_run_dir`.)"""
    run_dir = Path(cfg.run.out_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{socket.gethostname()}-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise unwritable_run_dir(run_dir, e) from None
    if rt.is_main:  # one writer for the run's files
        (run_dir / "events.jsonl").touch()  # the guard's events: present (empty) when nothing happened
        save_config(cfg, run_dir / "config.yaml")
        if not (run_dir / "tokenizer").exists():
            load_tokenizer(data_dir).save(run_dir / "tokenizer")
