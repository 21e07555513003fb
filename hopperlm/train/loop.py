"""The pretraining loop, readable top to bottom: set up, then step, log, evaluate, checkpoint until a budget ends.

Nothing in the step waits on the host: the loss and grad norm stay on the device and are read (`.item()`)
only on log steps. The data for step s is a pure function of (seed, s), so resuming needs only the step.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hopperlm.config import Config, ModelConfig, save_config
from hopperlm.data.loader import RandomWindows, TokenShards, eval_windows
from hopperlm.data.prepare import read_manifest
from hopperlm.data.tokenizer import load_tokenizer
from hopperlm.errors import CheckpointError, ConfigError, DataError, HopperError
from hopperlm.hardware import detect_for
from hopperlm.model.transformer import build_model, count_params, flops_per_token
from hopperlm.plan import Plan, make_plan
from hopperlm.train import checkpoint as ckpt_io
from hopperlm.train.batch_finder import make_gpu_finder
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
def evaluate(model, data: TokenShards, starts: list[int], plan: Plan) -> float:
    """Mean loss over fixed validation windows (the same windows every time, in every run)."""
    was_training = model.training
    model.eval()
    T, B = plan.seq_len, plan.micro_batch
    total = torch.zeros((), device=plan.device)
    for i in range(0, len(starts), B):
        chunk = torch.stack([torch.from_numpy(data.read(s, T + 1)) for s in starts[i : i + B]])
        chunk = chunk.to(plan.device, non_blocking=True)
        with plan.autocast(), plan.sdpa_backends():
            total += model(chunk[:, :-1], chunk[:, 1:]) * chunk.shape[0]
    model.train(was_training)
    return total.item() / len(starts)


def predicted_tokens_per_s(plan: Plan, flops_per_token: int) -> tuple[float, float]:
    """(tokens/s if every FLOP ran at the matmul rate measured here and now, that rate in FLOP/s): an upper
    bound from this machine rather than from a datasheet."""
    from hopperlm.selftest import matmul_check

    n = 4096 if plan.device.type == "cuda" else 512
    with torch.random.fork_rng(devices=[plan.device] if plan.device.type == "cuda" else []):
        # random inputs must not move the training RNG: a resumed run has to draw the same dropout masks
        rate = matmul_check(plan.device, plan.autocast_dtype or torch.float32, n=n)["tflops"] * 1e12
    return rate / flops_per_token, rate


def _banner(log, run_dir, resume_from, step, hw, plan, model_cfg, tc, manifest, fpt, predicted) -> None:
    counts = count_params(model_cfg)
    planned = []
    if tc.max_steps:
        planned.append(f"{tc.max_steps:,} steps = {human_count(tc.max_steps * plan.tokens_per_step)} tokens")
    if tc.max_tokens:
        steps = math.ceil(tc.max_tokens / plan.tokens_per_step)
        planned.append(f"{human_count(tc.max_tokens)} tokens = {steps:,} steps")
    if tc.max_hours:
        planned.append(f"{tc.max_hours:g} h wall clock (LR decay lands at the deadline)")
    peak = (
        f"{hw.peak_16bit / 1e12:.0f} TFLOP/s dense 16-bit peak" if hw.peak_16bit else "peak unknown: MFU n/a"
    )
    log(
        f"hopperlm | run {run_dir}" + (f" | resuming from {resume_from} (step {step})" if resume_from else "")
    )
    for line in plan.lines():
        log(line)
    log(
        f"model: {model_cfg.preset or 'custom'} | {counts['total']:,} parameters "
        f"({counts['non_embedding']:,} non-embedding) | {model_cfg.n_layers} layers, d={model_cfg.dim}, "
        f"{model_cfg.n_heads} heads ({model_cfg.kv_heads} kv) x {model_cfg.head_dim}, "
        f"ffn {model_cfg.hidden_dim}, vocab {model_cfg.vocab_size}, ctx {tc.seq_len}"
    )
    log(f"FLOPs/token: {fpt / 1e9:.3f} GFLOP (6N + 12*L*d*T) | {peak}")
    log(
        f"batch: {plan.micro_batch} x {tc.seq_len} tokens x {plan.grad_accum} accumulation = "
        f"{plan.tokens_per_step:,} tokens/step | data: {manifest['tokens']['train']:,} train / "
        f"{manifest['tokens']['val']:,} val tokens ({manifest['tokenizer']['kind']} tokenizer)"
    )
    tok_s, rate = predicted
    log(
        f"preflight: speed at most {human_count(tok_s)} tokens/s (matmul measured here at "
        f"{rate / 1e12:.2f} TFLOP/s) | memory {plan.memory.total(plan.micro_batch) / 1e9:.2f} GB estimated"
    )
    log(f"plan: {' or '.join(planned)}" + (f" | target val loss {tc.target_loss}" if tc.target_loss else ""))


def _preflight_check(log, record: dict, plan: Plan, predicted: float) -> None:
    """After the first log step: the measured numbers beside the preflight estimate."""
    speed = (
        f"speed {human_count(record['tokens_per_s'])} tokens/s = {record['tokens_per_s'] / predicted:.0%} "
    )
    speed += "of the matmul-bound prediction"
    if plan.device.type == "cuda":
        memory = f"memory {record['peak_mem_gb']:.2f} GB measured vs {plan.memory.total(plan.micro_batch) / 1e9:.2f}"
        memory += " GB estimated"
    else:
        memory = f"memory {record['peak_mem_gb']:.2f} GB process peak (the Python runtime included)"
        memory += f" vs {plan.memory.total(plan.micro_batch) / 1e9:.2f} GB estimated for the model"
    log(f"preflight check: {speed} | {memory}")


class OutOfMemory(HopperError):
    """Out of memory even at micro-batch 1."""


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
    train_data.check_window(tc.seq_len)
    val_starts = eval_windows(val_data, tc.seq_len, tc.eval_windows) if val_data is not None else []

    # ---- the plan: hardware, precision, kernels, batch -------------------------------------------------------
    hw = detect_for(tc.device)
    resume_state = ckpt_io.read_state(resume_from) if resume_from is not None else None
    if resume_state is not None and resume_state.get("micro_batch"):
        # the data of step s depends on the micro-batch: keep the checkpoint's (measured, or halved after an
        # out-of-memory error) rather than planning anew
        micro, accum = resume_state["micro_batch"], resume_state["grad_accum"]
        if (micro, micro * accum * tc.seq_len) != (tc.micro_batch, tc.batch_tokens):
            log(f"resume: micro-batch {micro} x {accum} accumulation from the checkpoint")
        tc = dataclasses.replace(tc, micro_batch=micro, batch_tokens=micro * accum * tc.seq_len)
        cfg = dataclasses.replace(cfg, train=tc)
    finder = None
    if hw.device_type == "cuda" and tc.micro_batch is None:
        finder = make_gpu_finder(run_dir, tc.memory_target * hw.free_memory, log)
    plan = make_plan(cfg, model_cfg, hw, finder)
    plan.apply_runtime_settings()
    device = plan.device

    # ---- model and optimizer -------------------------------------------------------------------------------
    torch.manual_seed(tc.seed)
    model = build_model(model_cfg, device, seed=tc.seed)
    model.checkpoint_blocks = plan.activation_checkpointing == "full"
    if resume_from is not None:
        if ckpt_io.read_model_config(resume_from) != model_cfg:
            raise CheckpointError(
                f"{resume_from} was trained with a different model section; resume with the run's own "
                f"config ({run_dir / 'config.yaml'})"
            )
        ckpt_io.load_model_weights(resume_from, model)
    step_model = torch.compile(model, mode=plan.compile_mode) if plan.compile else model
    optimizer = build_optimizer(model, cfg.optim, plan.fused_adamw)
    scaler = torch.amp.GradScaler("cuda") if plan.loss_scaling else None

    step, tokens, elapsed_before, best_val = 0, 0, 0.0, None
    if resume_from is not None:
        state = ckpt_io.load_training_state(resume_from, optimizer, scaler)
        step, tokens, elapsed_before = state["step"], state["tokens"], state["elapsed_s"]
        best_val = state.get("best_val_loss")

    # ---- run directory and banner --------------------------------------------------------------------------
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    tokenizer_dir = run_dir / "tokenizer"
    if not tokenizer_dir.exists():
        load_tokenizer(data_dir).save(tokenizer_dir)
    metrics = MetricsFile(run_dir / "metrics.jsonl")
    fpt = flops_per_token(model_cfg, tc.seq_len)
    predicted = predicted_tokens_per_s(plan, fpt)
    _banner(log, run_dir, resume_from, step, hw, plan, model_cfg, tc, manifest, fpt, predicted)
    batches = RandomWindows(train_data, tc.seq_len, plan.micro_batch, tc.seed)

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
            "micro_batch": plan.micro_batch,
            "grad_accum": plan.grad_accum,
            "config": cfg.to_dict(),
            "data_manifest_tokenizer": manifest["tokenizer"],
        }
        path = ckpt_io.save_checkpoint(
            run_dir, step, model, model_cfg, optimizer, scaler, state, tokenizer_dir, tc.keep_last
        )
        log(f"checkpoint: {path}")

    def run_step(lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step: grad_accum micro-batches, clip, update. Returns (loss, grad norm) on device."""
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_loss = torch.zeros((), device=device)
        for micro in range(plan.grad_accum):
            x, y = batches.batch(step, micro)
            if plan.pin_memory:
                x, y = x.pin_memory(), y.pin_memory()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with plan.autocast(), plan.sdpa_backends():
                loss = step_model(x, y) / plan.grad_accum
            (scaler.scale(loss) if scaler else loss).backward()
            step_loss += loss.detach()
        if scaler:
            scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return step_loss, grad_norm

    params = [p for p in model.parameters() if p.requires_grad]
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
    interval = Interval()
    loss_sum = torch.zeros((), device=device)
    val_loss, stopped_by, first_log = None, budget_done(), True
    if stopped_by:
        log(f"nothing to do: the run already reached its {stopped_by} budget at step {step}")
    model.train()
    while stopped_by is None:
        lr = lr_at(step, budget_progress(step, tokens, elapsed(), tc, cfg.optim.warmup_steps), cfg.optim)
        try:
            step_loss, grad_norm = run_step(lr)
        except torch.OutOfMemoryError:
            # free what the failed step held, halve the micro-batch, double accumulation, redo the step
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if plan.micro_batch == 1 or plan.micro_batch % 2:
                raise OutOfMemory(
                    f"out of memory at step {step + 1} with micro-batch {plan.micro_batch}; use "
                    "--train.activation_checkpointing full, a shorter train.seq_len, or a smaller model / FSDP"
                ) from None
            plan.micro_batch, plan.grad_accum = plan.micro_batch // 2, plan.grad_accum * 2
            batches = RandomWindows(train_data, tc.seq_len, plan.micro_batch, tc.seed)
            log(
                f"out of memory at step {step + 1}: micro-batch halved to {plan.micro_batch}, accumulation "
                f"doubled to {plan.grad_accum} (global batch unchanged); redoing the step"
            )
            continue
        loss_sum += step_loss
        step += 1
        tokens += plan.tokens_per_step
        interval.add(plan.tokens_per_step)
        stopped_by = budget_done()

        evaluated = False
        if val_starts and ((tc.eval_every and step % tc.eval_every == 0) or stopped_by):
            val_loss, evaluated = evaluate(step_model, val_data, val_starts, plan), True
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
                mfu=mfu(tok_s, fpt, hw.peak_16bit),
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
            if first_log:
                _preflight_check(log, record, plan, predicted[0])
                first_log = False
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
