"""The pretraining loop, readable top to bottom: set up, then step, log, evaluate, checkpoint until a budget ends.

Nothing in the step waits on the host: the loss and grad norm stay on the device and are read (`.item()`)
only on log steps. The data for step s is a pure function of (seed, s), so resuming needs only the step.
Under torchrun every rank runs this loop (dist/): each reads its block of the global batch, the model is
wrapped by DDP or sharded by FSDP2 after the speed-ups, losses are averaged over ranks on log steps, and rank 0
logs and writes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hopperlm.config import Config, ModelConfig, save_config
from hopperlm.data.sft import open_sft_data
from hopperlm.data.tokenizer import load_tokenizer
from hopperlm.data.train_data import (
    TrainBatches,
    combined_val_loss,
    default_prefetch,
    open_train_shards,
    open_val_sets,
    resolve_datasets,
)
from hopperlm.dist import checkpoint as dist_ckpt
from hopperlm.dist.parallelize import parallelize
from hopperlm.dist.runtime import Runtime, session
from hopperlm.errors import CheckpointError, ConfigError, DataError, HopperError
from hopperlm.hardware import detect_for
from hopperlm.model.lora import training_flops_per_token
from hopperlm.observe.observer import NullObserver, RunObserver
from hopperlm.plan import Plan, make_plan
from hopperlm.speed import apply_speedups
from hopperlm.speed.compile import uses_cuda_graphs
from hopperlm.train import checkpoint as ckpt_io
from hopperlm.train.banner import predicted_tokens_per_s, print_banner, print_preflight_check
from hopperlm.train.batch_finder import make_gpu_finder
from hopperlm.train.checkpoint import CheckpointSaveError
from hopperlm.train.evaluate import evaluate
from hopperlm.train.guard import Guard, GuardStop
from hopperlm.train.metrics import Interval, human_count, mfu, peak_memory_gb
from hopperlm.train.model_setup import build_train_model
from hopperlm.train.optim import budget_progress, build_optimizer, lr_at, set_lr
from hopperlm.train.preemption import Preemption


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    tokens: int
    elapsed_s: float
    val_loss: float | None
    best_val_loss: float | None
    stopped_by: str


def resolve_model_config(cfg: ModelConfig, data_vocab: int) -> ModelConfig:
    """Take the vocabulary from the data when the model leaves it open (rounded up to 64 for fast matmuls)."""
    if cfg.vocab_size is None:
        return dataclasses.replace(cfg, vocab_size=64 * math.ceil(data_vocab / 64))
    if cfg.vocab_size < data_vocab:
        if cfg.init_from:  # a tokenizer extended with new pieces: new rows (model/resize.py)
            return dataclasses.replace(cfg, vocab_size=64 * math.ceil(data_vocab / 64))
        raise ConfigError(
            f"model.vocab_size={cfg.vocab_size} is smaller than the data's vocabulary ({data_vocab}); "
            "set model.vocab_size to null (take it from the data) or re-prepare with a smaller tokenizer"
        )
    return cfg


def check_tokenizer(spec: str | None, manifest: dict, data_dir: Path) -> None:
    if spec is None:
        return
    ours = load_tokenizer(spec).identity()["sha256"]
    if ours != manifest["tokenizer"]["sha256"]:
        raise DataError(
            f"data.tokenizer={spec} does not match the tokenizer {data_dir} was prepared with "
            f"({manifest['tokenizer'].get('name') or manifest['tokenizer']['kind']}); "
            "re-run `hopperlm prepare` with this tokenizer or drop data.tokenizer"
        )


class OutOfMemory(HopperError):
    """Out of memory even at micro-batch 1."""


def train(
    cfg: Config,
    resume: bool | str = False,
    log: Callable[[str], None] = print,
    on_step: Callable[[int], None] | None = None,
) -> TrainResult:
    """Train from `cfg`, fresh or from a checkpoint, until a budget ends. Under torchrun every rank calls this
    (dist/runtime.py starts the process group and makes every rank stop when one fails). `on_step(steps_done)`
    runs before every step (the profiler's step marks)."""
    with session(cfg, log) as rt:
        return _train(cfg, resume, rt.log, rt, on_step)


def _train(
    cfg: Config,
    resume: bool | str,
    log: Callable[[str], None],
    rt: Runtime,
    on_step: Callable[[int], None] | None,
) -> TrainResult:
    run_dir = Path(cfg.run.out_dir)
    # ---- where we start: fresh, or from a checkpoint -------------------------------------------------------
    resume_from = None
    if resume:
        resume_from = (
            dist_ckpt.latest_valid(run_dir, rt, log) if resume is True else ckpt_io.resolve_model_dir(resume)
        )
        if resume_from is None:
            raise CheckpointError(
                f"--resume: {run_dir} has no valid checkpoint; drop --resume to start a new run"
            )
    elif ckpt_io.list_checkpoints(run_dir):
        raise CheckpointError(
            f"{run_dir} already holds checkpoints; pass --resume to continue it, or --run.out_dir NEW_DIR"
        )

    # ---- data --------------------------------------------------------------------------------------------
    sft = open_sft_data(cfg, run_dir, log) if cfg.sft.path else None  # instruction data (data/sft.py)
    if (
        sft is not None and rt.world_size > 1
    ):  # its batches are not split over ranks yet: each would repeat them
        raise ConfigError(
            "fine-tuning on sft.path runs in one process for now; start it without torchrun/`hopperlm launch`"
        )
    datasets = sft.datasets if sft else resolve_datasets(cfg.data)  # data.path, or data.mixture's datasets
    data_dir, manifest = datasets[0].path, datasets[0].manifest
    check_tokenizer(cfg.data.tokenizer, manifest, data_dir)
    model_cfg = resolve_model_config(cfg.model, manifest["vocab_size"])
    tc = cfg.train
    if sft is None:
        train_shards = open_train_shards(datasets, tc.seq_len, cfg.data.verify)
        val_sets = open_val_sets(datasets, tc.seq_len, tc.eval_windows, cfg.data.verify)
    else:
        val_sets = sft.val_sets
    if tc.target_loss is not None and not val_sets:
        raise ConfigError(
            f"train.target_loss is set but {data_dir} has no validation split; "
            "re-prepare with --val-fraction above 0 or drop train.target_loss"
        )

    # ---- the plan: hardware, precision, kernels, batch -------------------------------------------------------
    hw = detect_for(tc.device)
    resume_state = ckpt_io.read_state(resume_from) if resume_from is not None else None
    if resume_state is not None and resume_state.get("micro_batch"):
        # the data of step s depends on the micro-batch: keep the checkpoint's (measured, or halved after an
        # out-of-memory error) rather than planning anew. It is saved for all ranks together (one global
        # micro-batch per micro-step), so any world size that divides it reads the same windows.
        micro, accum = resume_state["micro_batch"], resume_state["grad_accum"]
        per_rank = micro // rt.world_size if micro % rt.world_size == 0 else None
        if (per_rank, micro * accum * tc.seq_len) != (tc.micro_batch, tc.batch_tokens):
            log(f"resume: micro-batch {micro} x {accum} accumulation (all ranks) from the checkpoint")
        if per_rank is None:
            log(
                f"resume: {micro} sequences per micro-step do not split over {rt.world_size} ranks; the global "
                "batch is kept but the remaining steps read other windows than an uninterrupted run would"
            )
        tc = dataclasses.replace(tc, micro_batch=per_rank, batch_tokens=micro * accum * tc.seq_len)
        cfg = dataclasses.replace(cfg, train=tc)
    finder = None

    # from scratch, model.init_from, LoRA/QLoRA (model_setup.py); the finder's trial models skip the weights
    def new_model(plan: Plan, weights: bool = True):
        return build_train_model(
            cfg, model_cfg, plan.device, plan.autocast_dtype, lambda: load_tokenizer(data_dir), weights, log
        )

    if hw.device_type == "cuda" and tc.micro_batch is None:
        cache_dir = run_dir if rt.world_size == 1 else run_dir / "ranks" / str(rt.rank)
        trial_model = lambda p: new_model(p, False)[0]  # noqa: E731
        finder = rt.agreed_finder(
            make_gpu_finder(cache_dir, tc.memory_target * hw.free_memory, log, trial_model)
        )
    plan = make_plan(cfg, model_cfg, hw, finder, rt.world)
    plan.apply_runtime_settings()
    device = plan.device

    # ---- model and optimizer -------------------------------------------------------------------------------
    torch.manual_seed(tc.seed)
    # the same weights on every rank; a checkpoint's are loaded below (checkpointer.load)
    model, embed_warmup = new_model(plan, weights=resume_from is None or cfg.lora.enabled)
    rt.seed_per_rank(tc.seed)
    if resume_from is not None and ckpt_io.read_model_config(resume_from) != model_cfg:
        raise CheckpointError(
            f"{resume_from} was trained with a different model section; resume with the run's own "
            f"config ({run_dir / 'config.yaml'})"
        )
    apply_speedups(model, plan, log)  # fp8 -> fused loss -> activation checkpointing -> compile, in place
    parallel = parallelize(model, plan, rt, log)  # -> DDP, or FSDP2 sharding in place (none: as it is)
    optimizer = build_optimizer(model, cfg.optim, plan.fused_adamw, plan.optimizer)
    mark_step = torch.compiler.cudagraph_mark_step_begin if uses_cuda_graphs(plan.compile_mode) else None
    scaler = parallel.grad_scaler(plan.loss_scaling)
    checkpointer = dist_ckpt.Checkpointer(rt, plan.strategy, cfg.parallel, log)

    step, tokens, elapsed_before, best_val = 0, 0, 0.0, None
    guard = Guard(cfg.guard, run_dir / "events.jsonl" if rt.is_main else Path(os.devnull), log)
    if resume_from is not None:
        state = checkpointer.load(resume_from, model, optimizer, scaler)  # weights, optimizer, RNG
        step, tokens, elapsed_before = state["step"], state["tokens"], state["elapsed_s"]
        best_val = state.get("best_val_loss")
        guard.load(state.get("guard"))

    # ---- run directory and banner --------------------------------------------------------------------------
    check_writable(run_dir)
    tokenizer_dir = run_dir / "tokenizer"
    if rt.is_main:  # one writer for the run's files
        save_config(cfg, run_dir / "config.yaml")
        if not tokenizer_dir.exists():
            load_tokenizer(data_dir).save(tokenizer_dir)
    # LoRA: the frozen base computes no weight gradients
    fpt = training_flops_per_token(model_cfg, tc.seq_len, cfg.lora)
    predicted = predicted_tokens_per_s(plan, fpt)
    print_banner(log, run_dir, resume_from, step, hw, plan, model_cfg, tc, manifest, fpt, predicted)
    # metrics.jsonl (truncated to the checkpoint's step), TensorBoard, W&B, CSV, progress, GPU monitor, plan.json
    # rank 0 observes; the other ranks' observer does nothing
    observer = (
        RunObserver(cfg, run_dir, log, hw, plan, model_cfg, fpt, predicted, step, tokens, elapsed_before)
        if rt.is_main
        else NullObserver()
    )
    prefetch = default_prefetch(cfg.data, device)
    batches = (
        sft.batches(plan.micro_batch, plan.grad_accum, tc.seed)
        if sft
        else TrainBatches(
            cfg.data,
            datasets,
            train_shards,
            tc.seq_len,
            plan.micro_batch,
            plan.grad_accum,
            tc.seed,
            plan.pin_memory,
            prefetch,
            rank=rt.rank,  # each rank reads its block of every global micro-batch
            world_size=rt.world_size,
        )
    )
    if resume_state is not None:
        batches.load_state_dict(resume_state.get("data"))  # sequential/mixture: exactly the next sample

    # ---- the loop ------------------------------------------------------------------------------------------
    elapsed = rt.start_clock(elapsed_before)  # several ranks: rank 0's clock, agreed on log steps

    def budget_done() -> str | None:
        if tc.max_steps is not None and step >= tc.max_steps:
            return "max_steps"
        if tc.max_tokens is not None and tokens >= tc.max_tokens:
            return "max_tokens"
        if tc.max_hours is not None and elapsed() >= tc.max_hours * 3600:
            return "max_hours"
        return None

    def save(val_loss: float | None) -> None:
        state = {
            "tokens": tokens,
            "elapsed_s": elapsed(),
            "best_val_loss": best_val,
            "val_loss": val_loss,
            "micro_batch": plan.micro_batch * rt.world_size,  # all ranks together
            "grad_accum": plan.grad_accum,
            "world_size": rt.world_size,
            "config": cfg.to_dict(),
            "data_manifest_tokenizer": manifest["tokenizer"],
            "guard": guard.to_dict(),
            "data": batches.state_dict(),
        }
        try:
            path = checkpointer.save(
                run_dir,
                step,
                model,
                model_cfg,
                optimizer,
                scaler,
                state,
                tokenizer_dir,
                tc.keep_last,
                tc.keep_every,
            )
            log(f"checkpoint: {path}")
        except CheckpointSaveError as e:  # e.g. a full disk: keep training, the previous checkpoint stands
            log(f"warning: {e}; training goes on")

    def run_step(lr: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One optimizer step: grad_accum micro-batches, clip, update unless the loss or gradient is not
        finite. Returns (loss, grad norm, finite) as device tensors."""
        set_lr(optimizer, lr)
        step_loss = torch.zeros((), device=device)
        for micro in range(plan.grad_accum):
            batch = batches.next(step + guard.state.data_offset, micro).to(device)  # pinned when planned
            if mark_step is not None:  # CUDA graphs: the previous step's outputs may be overwritten now
                mark_step()
            with parallel.grad_sync(last=micro == plan.grad_accum - 1):  # DDP: all-reduce on the last only
                with plan.autocast(), plan.sdpa_backends():
                    loss = parallel.module(batch.x, batch.y, **batch.model_kwargs) / plan.grad_accum
                (scaler.scale(loss) if scaler else loss).backward()
            step_loss += loss.detach()
        if scaler:
            scaler.unscale_(optimizer)
        grad_norm = parallel.clip_grad_norm_(params, clip)  # global: gradients are synced or sharded
        if scaler:  # fp16: an inf/NaN scaled gradient is the scaler's (it skips and lowers the scale)
            finite = torch.isfinite(step_loss)
            scaler.step(optimizer)
            scaler.update()
        else:
            finite = torch.isfinite(step_loss) & torch.isfinite(grad_norm)
            if device_skip:  # fused AdamW drops the update on the device when found_inf is 1: no host sync
                optimizer.found_inf = (~finite).float()
                optimizer.step()
            elif finite.item():  # CPU / unfused: the sync costs nothing here
                optimizer.step()
        parallel.after_optimizer_step()  # FSDP float8: precompute the weights' scales
        optimizer.zero_grad(set_to_none=True)
        return step_loss, grad_norm, finite

    params = [p for p in model.parameters() if p.requires_grad]
    device_skip = device.type == "cuda" and plan.fused_adamw
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
    interval = Interval()
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (loss, finite) per step since the last log
    val_loss, stopped_by, first_log = None, budget_done(), True
    if stopped_by:
        log(f"nothing to do: the run already reached its {stopped_by} budget at step {step}")
    elif cfg.guard.policy == "rollback" and not ckpt_io.list_checkpoints(run_dir):
        save(None)  # rollback needs a good checkpoint to return to, even before the first interval ends

    def rollback(bad_step: int) -> None:
        nonlocal step, tokens
        ckpt = checkpointer.latest_valid(run_dir, log)
        if ckpt is None:
            raise GuardStop(
                f"step {bad_step}: the run diverged and there is no valid checkpoint to roll back to"
            )
        state = checkpointer.load(ckpt, model, optimizer, scaler)
        guard.after_rollback(bad_step, state["step"])
        guard.event(
            bad_step,
            "divergence (bad steps or loss spike)",
            f"rolled back to {ckpt.name}, skipping the data of steps {state['step'] + 1}-{bad_step}, "
            f"LR x{guard.state.lr_scale:g}",
        )
        step, tokens = state["step"], state["tokens"]
        observer.restart_at(step, tokens, elapsed())  # the curve restarts there; events.jsonl keeps why

    model.train()
    with Preemption(log) as preemption, observer:
        while stopped_by is None:
            if on_step is not None:
                on_step(step)
            progress = budget_progress(step, tokens, elapsed(), tc, cfg.optim.warmup_steps)
            lr = lr_at(step, progress, cfg.optim) * guard.state.lr_scale
            if embed_warmup is not None:  # new token rows first, then everything (model_setup.py)
                embed_warmup.before_step(step, optimizer)
            try:
                step_loss, grad_norm, finite = run_step(lr)
            except torch.OutOfMemoryError:
                # free what the failed step held, halve the micro-batch, double accumulation, redo the step
                optimizer.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if plan.micro_batch == 1 or plan.micro_batch % 2 or rt.world_size > 1:
                    # (several ranks must change the micro-batch together: not attempted, the run stops)
                    raise OutOfMemory(
                        f"out of memory at step {step + 1} with micro-batch {plan.micro_batch}"
                        f"{f' on rank {rt.rank}' if rt.world_size > 1 else ''}; use a smaller --train.micro_batch,"
                        " --train.activation_checkpointing full, a shorter train.seq_len, or FSDP"
                    ) from None
                plan.micro_batch, plan.grad_accum = plan.micro_batch // 2, plan.grad_accum * 2
                batches.set_micro_batch(plan.micro_batch, plan.grad_accum)
                log(
                    f"out of memory at step {step + 1}: micro-batch halved to {plan.micro_batch}, accumulation "
                    f"doubled to {plan.grad_accum} (global batch unchanged); redoing the step"
                )
                continue
            pending.append((step_loss, finite))
            step += 1
            tokens += plan.tokens_per_step
            interval.add(plan.tokens_per_step)
            log_step = step % tc.log_every == 0 or bool(tc.eval_every and step % tc.eval_every == 0)
            log_step = log_step or budget_done() is not None  # (the same on every rank)
            signal = rt.agree(preemption.requested, log_step)  # several ranks: decided together on log steps
            stopped_by = budget_done() or (f"signal {signal}" if signal else None)
            if not (log_step or stopped_by):
                continue

            # ---- a log step: the one host sync, the guard's review, evaluation, metrics, checkpoint ----
            losses, flags = rt.log_step_losses(pending)  # the mean over ranks, finite on every rank
            verdict = guard.review(step - len(pending) + 1, losses, flags)
            pending.clear()
            if verdict is not None:
                action, bad_step = verdict
                if action == "stop":
                    save(val_loss)  # the bad update never reached the weights: this checkpoint is good
                    guard.event(bad_step, "non-finite loss or gradient norm", "stopped (guard.policy stop)")
                    raise GuardStop(
                        f"non-finite loss or gradient at step {bad_step}; stopped with a checkpoint "
                        "(guard.policy stop). Lower optim.lr, or use guard.policy skip or rollback"
                    )
                rollback(bad_step)
                interval.reset()
                stopped_by = None
                continue
            good = [x for x, ok in zip(losses, flags, strict=True) if ok]
            evaluated = False
            if val_sets and ((tc.eval_every and step % tc.eval_every == 0) or stopped_by):
                val_losses = {
                    v.name: evaluate(model, v.shards, v.starts, plan, cfg.data.packing, rt) for v in val_sets
                }
                val_loss, evaluated = combined_val_loss(val_losses, val_sets), True
                best_val = val_loss if best_val is None else min(best_val, val_loss)
                if tc.target_loss is not None and val_loss <= tc.target_loss and stopped_by is None:
                    stopped_by = "target_loss"
            tok_s, step_s = interval.rates()
            record = {"step": step, "tokens": tokens, "loss": sum(good) / len(good) if good else float("nan")}
            if evaluated:
                record["val_loss"] = val_loss
                if (
                    len(val_sets) > 1
                ):  # a mixture: each dataset's own loss (e.g. watch English being forgotten)
                    record["val_losses"] = val_losses
                    log("val by dataset: " + " | ".join(f"{k} {v:.4f}" for k, v in val_losses.items()))
            record.update(
                lr=lr,
                grad_norm=grad_norm.item(),
                tokens_per_s=tok_s,  # all ranks together
                mfu=mfu(tok_s / rt.world_size, fpt, hw.peak_16bit),
                step_time_s=step_s,
                peak_mem_gb=peak_memory_gb(device),
                elapsed_s=elapsed(),
            )
            if guard.state.skipped:
                record["skipped_steps"] = guard.state.skipped
            if rt.world_size > 1:
                record.update(world_size=rt.world_size, tokens_per_s_per_rank=tok_s / rt.world_size)
            # the GPU readings are added, every sink written, the line printed with the ETA (rank 0 only)
            observer.log_step(record)
            if first_log:
                print_preflight_check(log, record, plan, predicted[0])
                first_log = False
            interval.reset()
            if (tc.ckpt_every and step % tc.ckpt_every == 0) or stopped_by:
                save(val_loss)

    batches.close()
    checkpointer.close()  # a background checkpoint completes before the run ends
    total = elapsed()
    log(
        f"done: {stopped_by} after {step:,} steps, {human_count(tokens)} tokens, {total:.1f} s"
        + (f" | val loss {val_loss:.4f} (best {best_val:.4f})" if val_loss is not None else "")
    )
    result = TrainResult(run_dir, step, tokens, total, val_loss, best_val, stopped_by)
    observer.finish(result)
    return result


def check_writable(run_dir: Path) -> None:
    """Fail at start-up, not at the first checkpoint an hour later."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{socket.gethostname()}-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(
            f"run dir {run_dir} is not writable ({e.strerror}); choose another --run.out_dir"
        ) from None
