"""Find the largest micro-batch that fits on the GPU by running real training steps, and remember it.

The search runs the run's own model (LoRA/QLoRA included) with the actual plan (precision, attention kernels,
float8, fused loss, activation checkpointing, the optimizer) for two full training steps per candidate size —
`train_step`, the step `hopperlm train` runs, clipping and the finite check included — so the optimizer state
and the backward's peak are both counted. Trials run eagerly (compiled steps use the same or less memory, so
the answer is safe) and in one process, without DDP: under torchrun every rank measures on its own and the
smallest answer holds (parallel/runtime.py `agreed_finder`).
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
from hopperlm.errors import first_line
from hopperlm.files import write_atomic
from hopperlm.model.transformer import build_model
from hopperlm.parallel.runtime import Runtime
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


def trial_plan(plan: Plan) -> Plan:
    """The plan the trials run: eager (compiled steps need the same or less memory), one process, no
    data-parallel wrapper. Under torchrun each rank measures alone and `Runtime.agreed_finder` takes the
    smallest answer afterwards: inside DDP, trials would all-reduce gradients, so ranks that run out of memory
    at different sizes fall out of step and hang, and DDP cannot go on after an out-of-memory error inside its
    backward ("Expected to have finished reduction"). DDP keeps its gradients in the all-reduce buckets
    (gradient_as_bucket_view), so the unwrapped trial holds the same tensors."""
    return plan.replace(
        compile=False, compile_mode=None, strategy="none", world_size=1, dp_shard=1, fp8_all_gather=False
    )


def _memory_error(e: RuntimeError) -> bool:
    """An allocation failure that torch does not raise as OutOfMemoryError (cuBLAS's or cuDNN's workspace)."""
    text = str(e)
    return "out of memory" in text.lower() or "ALLOC_FAILED" in text


def _read_cache(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):  # a torn or foreign file: measure again (and rewrite it)
        return {}


def _write_cache(path: Path, cache: dict) -> None:
    """Atomically (hopperlm/files.py): under torchrun every rank of a node writes the same file."""
    write_atomic(path, json.dumps(cache, indent=1))


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
    build_model. No collective runs inside: each rank measures on its own (see `trial_plan`)."""

    def finder(model_cfg: ModelConfig, plan: Plan, cap: int) -> tuple[int, str]:
        device = plan.device
        cache_path = Path(run_dir) / CACHE_FILE
        key = cache_key(model_cfg, plan, torch.cuda.get_device_name(device), budget_bytes, cap)
        cache = _read_cache(cache_path)
        if key in cache:
            return cache[key], f"measured earlier on this GPU, cached in {cache_path}"
        start, trials = time.perf_counter(), []
        trial = trial_plan(plan)
        model = build(trial) if build is not None else build_model(model_cfg, device)
        # the plan's float8, fused loss and checkpointing; a single-process runtime whatever the session's
        parts, _ = build_step(
            model, trial, OptimConfig(lr=1e-6, grad_clip=grad_clip), log=lambda line: None, rt=Runtime()
        )
        failed_once = False  # an out-of-memory error happened: what fails after it is memory too

        def fits(n: int) -> bool:
            nonlocal failed_once
            ok, note = False, ""
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
                failed_once = True
            except RuntimeError as e:
                # after an out-of-memory error a later trial can fail elsewhere (a cuBLAS workspace, a
                # half-freed allocator): that size does not fit. Before any, it is a real error: raised.
                if not (failed_once or _memory_error(e)):
                    raise
                failed_once, note = True, f" ({first_line(e, type_name=False)[:120]})"
            finally:
                batch = None
                parts.optimizer.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
            trials.append(f"{n}{'' if ok else 'x'}{note}")
            return ok

        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # trial steps must not move the training RNG
            best = search_largest(fits, cap)
        model = parts = None  # free the trial model before the real one is built
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)  # the run's memory readings start from its own steps
        cache[key] = best
        _write_cache(cache_path, cache)
        seconds = time.perf_counter() - start
        log(f"micro-batch finder: tried {', '.join(trials)} (x = over budget) in {seconds:.1f} s")
        return best, f"measured: largest within {budget_bytes / 1024**3:.1f} GiB in real steps, at most {cap}"

    return finder
