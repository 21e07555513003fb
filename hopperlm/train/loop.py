"""The pretraining loop, readable top to bottom: set up, then step, log, evaluate, checkpoint until a budget ends.

Nothing in the step waits on the host: the loss and grad norm stay on the device and are read (`.item()`)
only on log steps. The data for step s is a pure function of (seed, s), so resuming needs only the step.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from hopperlm.config import Config, ModelConfig, save_config
from hopperlm.data.loader import RandomWindows, TokenShards, eval_windows
from hopperlm.data.prepare import read_manifest
from hopperlm.data.tokenizer import load_tokenizer
from hopperlm.errors import CheckpointError, ConfigError, DataError
from hopperlm.hardware import pick_device, pick_precision
from hopperlm.model.transformer import build_model, count_params, flops_per_token
from hopperlm.train import checkpoint as ckpt_io
from hopperlm.train.metrics import Interval, MetricsFile, format_record, human_count, mfu, peak_memory_gb
from hopperlm.train.optim import budget_progress, build_optimizer, lr_at


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


@torch.no_grad()
def evaluate(model, data: TokenShards, starts: list[int], cfg: Config, device, autocast) -> float:
    """Mean loss over fixed validation windows (the same windows every time, in every run)."""
    was_training = model.training
    model.eval()
    T, B = cfg.train.seq_len, cfg.train.micro_batch
    total = torch.zeros((), device=device)
    for i in range(0, len(starts), B):
        chunk = torch.stack([torch.from_numpy(data.read(s, T + 1)) for s in starts[i : i + B]])
        chunk = chunk.to(device, non_blocking=True)
        with autocast():
            total += model(chunk[:, :-1], chunk[:, 1:]) * chunk.shape[0]
    model.train(was_training)
    return total.item() / len(starts)


def train(cfg: Config, resume: bool | str = False, log: Callable[[str], None] = print) -> TrainResult:
    run_dir = Path(cfg.run.out_dir)
    # ---- where we start: fresh, or from a checkpoint -------------------------------------------------------
    resume_from = None
    if resume:
        resume_from = (
            ckpt_io.latest_checkpoint(run_dir) if resume is True else ckpt_io.resolve_model_dir(resume)
        )
        if resume_from is None:
            raise CheckpointError(
                f"--resume: {run_dir} has no checkpoint yet; drop --resume to start a new run"
            )
    elif ckpt_io.list_checkpoints(run_dir):
        raise CheckpointError(
            f"{run_dir} already holds checkpoints; pass --resume to continue it, or --run.out_dir NEW_DIR"
        )

    # ---- data --------------------------------------------------------------------------------------------
    if not cfg.data.path:
        raise ConfigError(
            "data.path is not set; point it at a `hopperlm prepare` output, e.g. --data.path DIR"
        )
    data_dir = Path(cfg.data.path)
    manifest = read_manifest(data_dir)
    check_tokenizer(cfg.data.tokenizer, manifest, data_dir)
    model_cfg = resolve_model_config(cfg.model, manifest["vocab_size"])
    tc = cfg.train
    train_data = TokenShards(data_dir, "train", verify=cfg.data.verify)
    val_data = TokenShards(data_dir, "val", verify=cfg.data.verify) if manifest["tokens"]["val"] > 0 else None
    if tc.target_loss is not None and val_data is None:
        raise ConfigError(
            f"train.target_loss is set but {data_dir} has no validation split; "
            "re-prepare with --val-fraction above 0 or drop train.target_loss"
        )
    batches = RandomWindows(train_data, tc.seq_len, tc.micro_batch, tc.seed)
    val_starts = eval_windows(val_data, tc.seq_len, tc.eval_windows) if val_data is not None else []

    # ---- device, precision, model, optimizer ----------------------------------------------------------------
    dev = pick_device(tc.device)
    device = dev.device
    prec = pick_precision(tc.precision, device)
    torch.manual_seed(tc.seed)
    model = build_model(model_cfg, device, seed=tc.seed)
    if resume_from is not None:
        if ckpt_io.read_model_config(resume_from) != model_cfg:
            raise CheckpointError(
                f"{resume_from} was trained with a different model section; resume with the run's own "
                f"config ({run_dir / 'config.yaml'})"
            )
        ckpt_io.load_model_weights(resume_from, model)
    use_compile = tc.compile if tc.compile is not None else device.type == "cuda"
    step_model = torch.compile(model) if use_compile else model
    optimizer, optim_why = build_optimizer(model, cfg.optim, device)
    scaler = torch.amp.GradScaler("cuda") if prec.loss_scaling else None

    def autocast():
        if prec.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device.type, dtype=prec.autocast_dtype)

    step, tokens, elapsed_before, best_val = 0, 0, 0.0, None
    if resume_from is not None:
        state = ckpt_io.load_training_state(resume_from, optimizer, scaler)
        step, tokens, elapsed_before = state["step"], state["tokens"], state["elapsed_s"]
        best_val = state.get("best_val_loss")

    # ---- run directory -------------------------------------------------------------------------------------
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    tokenizer_dir = run_dir / "tokenizer"
    if not tokenizer_dir.exists():
        load_tokenizer(data_dir).save(tokenizer_dir)
    metrics = MetricsFile(run_dir / "metrics.jsonl")

    # ---- banner --------------------------------------------------------------------------------------------
    counts = count_params(model_cfg)
    fpt = flops_per_token(model_cfg, tc.seq_len)
    planned = []
    if tc.max_steps:
        planned.append(f"{tc.max_steps:,} steps = {human_count(tc.max_steps * tc.tokens_per_step)} tokens")
    if tc.max_tokens:
        planned.append(
            f"{human_count(tc.max_tokens)} tokens = {math.ceil(tc.max_tokens / tc.tokens_per_step):,} steps"
        )
    if tc.max_hours:
        planned.append(f"{tc.max_hours:g} h wall clock (LR decay lands at the deadline)")
    peak = (
        f"{dev.peak_flops / 1e12:.0f} TFLOP/s dense bf16 peak" if dev.peak_flops else "peak unknown: MFU n/a"
    )
    log(
        f"hopperlm | run {run_dir}" + (f" | resuming from {resume_from} (step {step})" if resume_from else "")
    )
    for line in (
        dev.reason,
        prec.reason,
        optim_why,
        f"compile: {'on' if use_compile else 'off'}"
        + (
            ""
            if tc.compile is not None
            else f" (auto: {'CUDA' if use_compile else 'CPU, compile start-up not worth it'})"
        ),
    ):
        log(line)
    log(
        f"model: {model_cfg.preset or 'custom'} | {counts['total']:,} parameters "
        f"({counts['non_embedding']:,} non-embedding) | {model_cfg.n_layers} layers, d={model_cfg.dim}, "
        f"{model_cfg.n_heads} heads ({model_cfg.kv_heads} kv) x {model_cfg.head_dim}, ffn {model_cfg.hidden_dim}, "
        f"vocab {model_cfg.vocab_size}, ctx {tc.seq_len}"
    )
    log(f"FLOPs/token: {fpt / 1e9:.3f} GFLOP (6N + 12*L*d*T) | {peak}")
    log(
        f"batch: {tc.micro_batch} x {tc.seq_len} tokens x {tc.grad_accum} accumulation = "
        f"{tc.tokens_per_step:,} tokens/step | data: {manifest['tokens']['train']:,} train / "
        f"{manifest['tokens']['val']:,} val tokens ({manifest['tokenizer']['kind']} tokenizer)"
    )
    log(f"plan: {' or '.join(planned)}" + (f" | target val loss {tc.target_loss}" if tc.target_loss else ""))

    # ---- the loop ------------------------------------------------------------------------------------------
    t0 = time.perf_counter()

    def elapsed() -> float:
        return elapsed_before + time.perf_counter() - t0

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
            "config": cfg.to_dict(),
            "data_manifest_tokenizer": manifest["tokenizer"],
        }
        path = ckpt_io.save_checkpoint(
            run_dir, step, model, model_cfg, optimizer, scaler, state, tokenizer_dir, tc.keep_last
        )
        log(f"checkpoint: {path}")

    params = [p for p in model.parameters() if p.requires_grad]
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
    interval = Interval()
    loss_sum = torch.zeros((), device=device)
    val_loss, stopped_by = None, budget_done()
    if stopped_by:
        log(f"nothing to do: the run already reached its {stopped_by} budget at step {step}")
    model.train()
    while stopped_by is None:
        lr = lr_at(step, budget_progress(step, tokens, elapsed(), tc, cfg.optim.warmup_steps), cfg.optim)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for micro in range(tc.grad_accum):
            x, y = batches.batch(step, micro)
            if device.type == "cuda":
                x, y = (
                    x.pin_memory().to(device, non_blocking=True),
                    y.pin_memory().to(device, non_blocking=True),
                )
            with autocast():
                loss = step_model(x, y) / tc.grad_accum
            (scaler.scale(loss) if scaler else loss).backward()
            loss_sum += loss.detach()
        if scaler:
            scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens += tc.tokens_per_step
        interval.add(tc.tokens_per_step)
        stopped_by = budget_done()

        evaluated = False
        if val_starts and ((tc.eval_every and step % tc.eval_every == 0) or stopped_by):
            val_loss, evaluated = evaluate(step_model, val_data, val_starts, cfg, device, autocast), True
            best_val = val_loss if best_val is None else min(best_val, val_loss)
            if tc.target_loss is not None and val_loss <= tc.target_loss and stopped_by is None:
                stopped_by = "target_loss"
        if step % tc.log_every == 0 or evaluated or stopped_by:
            train_loss = loss_sum.item() / interval.steps  # the one host sync of a log step
            tok_s, step_s = interval.rates()
            record = {"step": step, "tokens": tokens, "loss": train_loss}
            if evaluated:
                record["val_loss"] = val_loss
            record.update(
                lr=lr,
                grad_norm=grad_norm.item(),
                tokens_per_s=tok_s,
                mfu=mfu(tok_s, fpt, dev.peak_flops),
                step_time_s=step_s,
                peak_mem_gb=peak_memory_gb(device),
                elapsed_s=elapsed(),
            )
            if not math.isfinite(train_loss):
                raise DataError(
                    f"training loss is {train_loss} at step {step}; lower optim.lr or check the data"
                )
            metrics.write(record)
            log(format_record(record, tc.max_steps))
            loss_sum.zero_()
            interval.reset()
        if (tc.ckpt_every and step % tc.ckpt_every == 0) or stopped_by:
            save(val_loss)

    total = elapsed()
    log(
        f"done: {stopped_by} after {step:,} steps, {human_count(tokens)} tokens, {total:.1f} s"
        + (f" | val loss {val_loss:.4f} (best {best_val:.4f})" if val_loss is not None else "")
    )
    return TrainResult(run_dir, step, tokens, total, val_loss, best_val, stopped_by)
