"""One training run, set up: `build_run(cfg, resume, runtime)` builds the `Run` the loop steps (train/loop.py) and
`start_run(run)` announces and starts it.

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

import torch

from hopperlm.checkpoint.checkpointer import Checkpointer, Resume, ResumePoint, find_resume
from hopperlm.checkpoint.single import Parts
from hopperlm.config import Config, ModelConfig, ScheduleConfig, TrainConfig, config_yaml
from hopperlm.config.training import BUDGET_KEYS, budget_as
from hopperlm.data.batches import BatchLayout, BatchSource
from hopperlm.data.tokenizer import load_tokenizer
from hopperlm.data.train_data import default_prefetch
from hopperlm.files import write_atomic
from hopperlm.hardware import Hardware, detect_for
from hopperlm.model.lora import training_flops_per_token
from hopperlm.observe.observer import NullObserver, RunObserver
from hopperlm.parallel.runtime import Clock, Runtime, unwritable_run_dir
from hopperlm.plan import SHARDED, Plan
from hopperlm.schedule import budget_progress, counted_warmup_steps, lr_at
from hopperlm.train.banner import predicted_tokens_per_s, print_banner
from hopperlm.train.clock_budget import ClockBudget
from hopperlm.train.data_and_plan import RunData, open_run_data, plan_run, resolve_model_config
from hopperlm.train.eval_tasks import EvalTasks
from hopperlm.train.guard import Guard
from hopperlm.train.initial_model import EmbedWarmup, build_train_model
from hopperlm.train.state import TrainState
from hopperlm.train.step import StepParts, build_step


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
    checkpointer: Checkpointer  # saves, keeps, resumes; what a full disk does (checkpoint/checkpointer.py)
    guard: Guard
    embed_warmup: EmbedWarmup | None
    state: TrainState  # everything that changes as the run goes: what a checkpoint saves (train/state.py)
    resumed_from: Path | None = None  # the checkpoint the run started from
    # start_run's: what the banner, the forecast and the metrics read
    observer: RunObserver | NullObserver = dataclasses.field(default_factory=NullObserver)
    flops_per_token: int = 0
    predicted: tuple[float, float] = (0.0, 0.0)  # (tokens/s bound, matmul FLOP/s measured here)
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
    def schedule(self) -> ScheduleConfig:
        """The schedule the LR follows: the recipe's, with the warm-up a wall-clock budget laid on the clock
        where it laid one (train/clock_budget.py; the recipe's section itself never changes)."""
        return self.state.clock_budget.laid(self.cfg.schedule)

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run.out_dir)

    @property
    def tokens_per_step(self) -> int:
        return self.plan.tokens_per_step  # an out-of-memory halving keeps the global batch


def build_run(cfg: Config, resume: Resume, rt: Runtime) -> Run:
    """The checkpoint to start from, the data, the plan, the model and its step, the restored state and the run
    directory."""
    run_dir, log = Path(cfg.run.out_dir), rt.log
    start = find_resume(resume, run_dir, rt)  # (the micro-batch, attention kernel and NS precision are kept)
    kept = keep_checkpoint_threads(keep_checkpoint_batch(cfg.train, start, rt), start, rt)
    cfg = cfg if kept is cfg.train else dataclasses.replace(cfg, train=kept)
    hw = detect_for(cfg.train.device)

    data = open_run_data(cfg, run_dir, log, writer=rt.is_main)
    model_cfg = resolve_model_config(cfg.model, data.manifest["vocab_size"])
    plan = plan_run(
        cfg,
        model_cfg,
        hw,
        world=rt.world,
        cache_dir=run_dir if rt.world_size == 1 else run_dir / "ranks" / str(rt.rank),
        log=log,
        rt=rt,
        kept_attention=start.attention if start is not None else None,
        kept_muon_ns=checkpoint_muon_ns(start, hw.device.type, cfg.optim.name, log),
    )
    plan.apply_runtime_settings(log)

    torch.manual_seed(cfg.train.seed)  # the same model on every rank (`build_model` builds the bare network)
    model, embed_warmup = build_train_model(
        cfg,
        model_cfg,
        device=plan.device,
        compute_dtype=plan.autocast_dtype,
        data_tokenizer=data.tokenizer,
        load=start is None or cfg.lora.enabled,  # a resumed full run's checkpoint holds every weight
        log=log,
        sharded=plan.strategy in SHARDED,
    )
    rt.seed_per_rank(cfg.train.seed)
    parts, fp8 = build_step(model, plan, cfg.optim, muon=cfg.muon, log=log, rt=rt)
    guard = Guard(cfg.guard, run_dir / "events.jsonl" if rt.is_main else Path(os.devnull), log)
    # each rank reads its block of every global micro-batch
    layout = BatchLayout(plan.micro_batch, plan.grad_accum, rt.rank, rt.world_size)
    batches = data.batches(layout, pin=plan.pin_memory, prefetch=default_prefetch(cfg.data, plan.device))
    state = TrainState(
        plan.micro_batch,
        plan.grad_accum,
        fp8,
        attention=plan.attention,
        muon_ns=plan.muon_ns,
        device_type=plan.device.type,
        guard=guard,
        batches=batches,
        clock_budget=ClockBudget.for_run(cfg.train),
        threads=torch.get_num_threads() if plan.device.type == "cpu" else None,  # (the plan has set them)
    )
    state.run_record = {"config": cfg.to_dict(), "data_manifest_tokenizer": data.manifest["tokenizer"]}

    checkpointer = Checkpointer(
        cfg.checkpoint,
        rt,
        Parts(model, model_cfg, parts.optimizer, parts.scaler, tokenizer_dir=run_dir / "tokenizer"),
        state,
        run_dir=run_dir,
        strategy=plan.strategy,
        verb="finetune" if cfg.sft.path else "train",
        collective_limit_s=cfg.parallel.startup_timeout_s,
        rollback_base=cfg.guard.policy == "rollback",
    )
    if start is not None:  # weights, optimizer, scaler and RNGs into the parts; the state (its clock too)
        checkpointer.load(start)
    prepare_run_dir(run_dir, rt, data.data_dir, config_yaml(cfg))
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
        embed_warmup=embed_warmup,
        state=state,
        resumed_from=start.path if start is not None else None,
    )


def start_run(run: Run) -> None:
    """Announce and start a built run: the room its checkpoints need, the banner, the budget the LR is laid
    over, the clock, the observer (metrics, sinks, plan.json, the forecast) and lm-eval's tasks."""
    cfg, state, log = run.cfg, run.state, run.log
    # before any step: keep_last + 1 checkpoints (weights, optimizer state, the tokenizer copied) and the
    # keep_every milestones to come must fit
    room_line = run.checkpointer.check_room(
        cfg.train, optimizer=run.plan.optimizer, lora=cfg.lora, tokens_per_step=run.plan.tokens_per_step
    )
    run.flops_per_token = training_flops_per_token(run.model_cfg, cfg.train.seq_len, cfg.lora)  # LoRA: fewer
    run.predicted = predicted_tokens_per_s(run.plan, run.flops_per_token)
    print_banner(
        log,
        run_dir=run.run_dir,
        resume_from=run.resumed_from,
        step=state.step,
        hw=run.hw,
        plan=run.plan,
        model_cfg=run.model_cfg,
        tc=cfg.train,
        manifest=run.data.manifest,
        fpt=run.flops_per_token,
        predicted=run.predicted,
        data=cfg.data,
    )
    log(room_line)
    state.schedule_budget = schedule_budget(cfg.train, run.schedule, cfg.optim.lr, state=state, log=log)
    state.clock = run.rt.start_clock(
        state.elapsed_before
    )  # several ranks: rank 0's clock, agreed on log steps
    if (
        run.rt.is_main
    ):  # metrics.jsonl (truncated to the checkpoint's step), the sinks, plan.json, the forecast
        run.observer = RunObserver(
            cfg,
            run.run_dir,
            log=log,
            hw=run.hw,
            plan=run.plan,
            model_cfg=run.model_cfg,
            fpt=run.flops_per_token,
            predicted=run.predicted,
            step=state.step,
            tokens=state.tokens,
            elapsed_s=state.elapsed_before,
            schedule_budget=state.schedule_budget,  # the forecast follows what the LR is laid over
        )
    if cfg.eval.tasks:
        run.eval_tasks = EvalTasks(cfg.eval, run.run_dir, run.rt, run.plan.strategy, log)


def schedule_budget(
    tc: TrainConfig, sc: ScheduleConfig, peak: float, *, state: TrainState, log: Callable[[str], None]
) -> TrainConfig:
    """The budget the LR schedule (`sc`, peaking at `peak`) is laid over: the run's own, or, when a resumed run
    changed it and schedule.resume_horizon is keep, the checkpoint's (the state's `saved_budget`). Says in one
    line how the LR changes at the resume step."""
    original = budget_as(state.saved_budget or {}, tc)
    elapsed_s = state.elapsed_before
    if original is None:
        return tc
    chosen = original if sc.resume_horizon == "keep" else tc

    def lr(budget: TrainConfig) -> float:
        progress = budget_progress(state.step, state.tokens, elapsed_s, budget, counted_warmup_steps(sc))
        return lr_at(state.step, progress, sc, peak)

    changed = ", ".join(
        f"{k} {getattr(original, k)} -> {getattr(tc, k)}"
        for k in BUDGET_KEYS
        if getattr(original, k) != getattr(tc, k)
    )
    if sc.resume_horizon == "keep":
        how, other = "the original schedule kept (its decay ends at the original budget)", "extend"
    elif sc.name == "wsd":
        how, other = "WSD's stable phase lengthened to the new budget", "keep"
    elif sc.name == "constant":
        how, other = "constant LR, nothing to re-lay", "keep"
    else:
        how, other = f"{sc.name} decay re-laid over the new budget", "keep"
    log(
        f"resume: budget changed ({changed}): {how}; LR at step {state.step} {lr(original):.3g} -> "
        f"{lr(chosen):.3g} (schedule.resume_horizon {other} for the other choice)"
    )
    return chosen


def checkpoint_muon_ns(start: ResumePoint | None, device_type: str, optimizer: str, log) -> str | None:
    """The checkpoint's Newton–Schulz precision where it trained on this kind of device (or does not say: older
    checkpoints, bf16 on every device), so the resume rounds as the run did. From another kind of device no
    resume is bitwise, so none is kept and the plan picks this device's (a GPU's bf16 on a CPU runs 30-90x
    slower than its fp32)."""
    if start is None or start.device_type in (None, device_type):
        return start.muon_ns if start is not None else None
    if optimizer == "muon":
        log(f"resume: the checkpoint trained on {start.device_type} (Newton–Schulz in {start.muon_ns}); on "
            f"{device_type} no resume is bitwise, so Muon's Newton–Schulz runs in this device's precision")  # fmt: skip
    return None


def keep_checkpoint_batch(tc: TrainConfig, start: ResumePoint | None, rt: Runtime) -> TrainConfig:
    """The data of step s depends on the micro-batch: keep the checkpoint's (measured, or halved after an
    out-of-memory error) rather than planning anew. It is saved for all ranks together (one global
    micro-batch per micro-step), so any world size that divides it reads the same windows. Returns `tc`
    itself when there is nothing to keep."""
    if start is None or start.micro_batch is None:
        return tc
    micro, accum = start.micro_batch
    per_rank = micro // rt.world_size if micro % rt.world_size == 0 else None
    if (per_rank, micro * accum * tc.seq_len) != (tc.micro_batch, tc.batch_tokens):
        rt.log(f"resume: micro-batch {micro} x {accum} accumulation (all ranks) from the checkpoint")
    if per_rank is None:
        rt.log(
            f"resume: {micro} sequences per micro-step do not split over {rt.world_size} ranks; the global "
            "batch is kept but the remaining steps read other windows than an uninterrupted run would"
        )
    return dataclasses.replace(tc, micro_batch=per_rank, batch_tokens=micro * accum * tc.seq_len)


def keep_checkpoint_threads(tc: TrainConfig, start: ResumePoint | None, rt: Runtime) -> TrainConfig:
    """The CPU threads the checkpoint trained with, where train.threads does not say: the plan may choose them
    from the machine's load, and another count sums floats in another order, so a resume would not continue
    exactly. Returns `tc` itself when there is nothing to keep."""
    if start is None or start.threads is None or tc.threads is not None or tc.device.startswith("cuda"):
        return tc
    if start.threads != torch.get_num_threads():
        rt.log(
            f"resume: {start.threads} CPU threads, as the checkpoint trained (train.threads to choose others)"
        )
    return dataclasses.replace(tc, threads=start.threads)


def prepare_run_dir(run_dir: Path, rt: Runtime, data_dir: Path, config_text: str) -> None:
    """Fail at start-up, not at the first checkpoint an hour later; then the run's config.yaml (`config_text`)
    and tokenizer. (Rank 0 holds the folder's lock from the session's start on: parallel/runtime.py
    `hold_run_dir`.)"""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{socket.gethostname()}-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise unwritable_run_dir(run_dir, e) from None
    if rt.is_main:  # one writer for the run's files
        (run_dir / "events.jsonl").touch()  # the guard's events: present (empty) when nothing happened
        write_atomic(run_dir / "config.yaml", config_text)
        if not (run_dir / "tokenizer").exists():
            load_tokenizer(data_dir).save(run_dir / "tokenizer")
