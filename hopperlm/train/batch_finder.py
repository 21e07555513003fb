"""Find the largest micro-batch that fits on the GPU by running real training steps, and remember it.

The search runs the run's own model (LoRA/QLoRA included) with the actual plan (precision, attention kernels,
float8, fused loss, activation checkpointing, the optimizer) for two full training steps per candidate size —
`train_step`, the step `hopperlm train` runs, clipping and the finite check included — so the optimizer state
and the backward's peak are both counted. Trials run eagerly: compiled steps use the same or less memory, so
the answer is safe.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hopperlm.config import ModelConfig, OptimConfig
from hopperlm.data.loader import Batch
from hopperlm.model.transformer import build_model
from hopperlm.plan import Plan
from hopperlm.train.step import build_step, train_step

CACHE_FILE = "micro_batch_cache.json"


def search_largest(fits: Callable[[int], bool], cap: int) -> int:
    """Largest n in [1, cap] with fits(n), for a monotone `fits`: double until it fails, then bisect.
    Returns 0 when even fits(1) is False."""
    lo, hi, n = 0, None, 1
    while hi is None:
        n = min(n, cap)
        if fits(n):
            lo = n
            if n == cap:
                return lo
            n *= 2
        else:
            hi = n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def cache_key(model_cfg: ModelConfig, plan: Plan, device_name: str, budget: float, cap: int) -> str:
    parts = {
        "model": {k: getattr(model_cfg, k) for k in model_cfg.__dataclass_fields__},
        "plan": [
            plan.precision,
            plan.activation_checkpointing,
            plan.ac_every,
            plan.attention,
            plan.fused_adamw,
            plan.seq_len,
            plan.fp8,
            plan.fused_loss,
            plan.optimizer,
            plan.lora,
        ],
        "device": device_name,
        "torch": torch.__version__,
        "budget_gib": round(budget / 1024**3, 1),
        "cap": cap,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def make_gpu_finder(
    run_dir: Path,
    budget_bytes: float,
    log: Callable[[str], None],
    *,
    build: Callable[[Plan], torch.nn.Module] | None = None,
    grad_clip: float = 1.0,
):
    """A finder for plan.make_plan: measures on this GPU, cached in RUN_DIR/micro_batch_cache.json.
    `build(plan)` makes the trial model (the run's own kind: LoRA/QLoRA with a random base); default
    build_model."""

    def finder(model_cfg: ModelConfig, plan: Plan, cap: int) -> tuple[int, str]:
        device = plan.device
        cache_path = Path(run_dir) / CACHE_FILE
        key = cache_key(model_cfg, plan, torch.cuda.get_device_name(device), budget_bytes, cap)
        cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
        if key in cache:
            return cache[key], f"measured earlier on this GPU, cached in {cache_path}"
        start, trials = time.perf_counter(), []
        model = build(plan) if build is not None else build_model(model_cfg, device)
        # the plan's float8, fused loss and checkpointing, eagerly: compiled steps need the same or less
        parts, _ = build_step(
            model,
            plan.replace(compile=False),
            OptimConfig(lr=1e-6, grad_clip=grad_clip),
            log=lambda line: None,
        )

        def fits(n: int) -> bool:
            ok = False
            batch = None
            try:
                torch.cuda.reset_peak_memory_stats(device)
                x = torch.randint(0, model_cfg.vocab_size, (n, plan.seq_len), device=device)
                batch = Batch(x, x)
                for _ in range(2):
                    train_step(parts, lambda micro: batch, grad_accum=1, lr=1e-6)
                torch.cuda.synchronize(device)
                ok = torch.cuda.max_memory_allocated(device) <= budget_bytes
            except torch.OutOfMemoryError:
                ok = False
            finally:
                batch = None
                parts.optimizer.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
            trials.append((n, ok))
            return ok

        with torch.random.fork_rng(devices=[device]):  # trial steps must not move the training RNG
            best = search_largest(fits, cap)
        model = parts = None  # free the trial model before the real one is built
        torch.cuda.empty_cache()
        cache[key] = best
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        cache_path.write_text(json.dumps(cache, indent=1))
        tried = ", ".join(f"{n}{'' if ok else 'x'}" for n, ok in trials)
        seconds = time.perf_counter() - start
        log(f"micro-batch finder: tried {tried} (x = over budget) in {seconds:.1f} s")
        return best, f"measured: largest within {budget_bytes / 1024**3:.1f} GiB in real steps, at most {cap}"

    return finder
