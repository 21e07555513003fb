"""Throughput, MFU and memory, measured between log steps, written to metrics.jsonl and printed as one line.

metrics.jsonl schema (one JSON object per line; a key is absent when it was not measured at that step):
  step          optimizer steps completed             tokens        training tokens seen so far
  loss          mean training loss since the last log val_loss      validation loss (evaluation steps only)
  lr            learning rate of the last step        grad_norm     global gradient norm before clipping
  tokens_per_s  training tokens / wall second of training since the last log (evaluations and checkpoint
                saves left out: they are not training)
  mfu           tokens_per_s * FLOPs per token / the device's dense bf16 peak; null where the peak is unknown (CPU)
  step_time_s   mean wall seconds per training step since the last log (evaluations and saves left out)
  peak_mem_gb   CUDA: max allocated by tensors; CPU: peak resident memory of the process
  elapsed_s     wall seconds of training so far (across resumes; what max_hours counts)
  skipped_steps updates the stability guard dropped so far (present once there is one)
  gpu_util      CUDA with NVML: mean GPU utilisation since the last log, percent
  gpu_power_w   mean board power since the last log, watts      gpu_temp_c   highest GPU temperature, Celsius
  gpu_mem_gb    most device memory in use since the last log (all processes, the allocator's cache included)
  world_size    data-parallel ranks (present with more than one; tokens_per_s and mfu are then the run's: all
                ranks' tokens, MFU against all ranks' peak)      tokens_per_s_per_rank  tokens_per_s / world_size
  forecast      evaluation steps, once enough evaluations exist: the predicted validation loss at the end of the
                budget (observe/forecast.py)      forecast_low, forecast_high  its interval
                forecast_step  the step the budget is predicted to end at
  loss is the mean over the finite steps of the interval (NaN only if every one of them was bad)
The same fields go to TensorBoard and W&B under the tags in hopperlm/observe/sinks.py and to metrics.csv.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any

import torch

from hopperlm.files import append_line

# every field metrics.jsonl may hold, in the order above (the columns of metrics.csv)
FIELDS = (
    "step",
    "tokens",
    "loss",
    "val_loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "mfu",
    "step_time_s",
    "peak_mem_gb",
    "elapsed_s",
    "skipped_steps",
    "gpu_util",
    "gpu_power_w",
    "gpu_temp_c",
    "gpu_mem_gb",
    "forecast",
    "forecast_low",
    "forecast_high",
    "forecast_step",
)


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux reports KiB


def mfu(tokens_per_s: float, flops_per_token: int, peak_flops: float | None) -> float | None:
    if peak_flops is None:
        return None
    return tokens_per_s * flops_per_token / peak_flops


class Interval:
    """Wall time and work between two log steps. Timing is read only on log steps, after the loss `.item()`
    has synchronised with the device, so the hot path never waits on the host. What is not training (an
    evaluation, a checkpoint save) is timed by the loop and left out (`exclude`), so the rates are training's."""

    def __init__(self) -> None:
        self.reset()
        self.cold = True  # holds the process's first steps: compile, autotuning and warm-up

    def reset(self) -> None:
        self.cold = False
        self.start = time.perf_counter()
        self.steps = 0
        self.tokens = 0
        self.excluded = 0.0  # seconds of the interval that were not training

    def add(self, tokens: int) -> None:
        self.steps += 1
        self.tokens += tokens

    def exclude(self, seconds: float) -> None:
        """`seconds` of this interval were not training (an evaluation, a checkpoint save)."""
        self.excluded += seconds

    def training_s(self) -> float:
        """Wall seconds of training in the interval so far."""
        return max(time.perf_counter() - self.start - self.excluded, 1e-9)

    def rates(self) -> tuple[float, float]:
        """(tokens per second, seconds per step), of training."""
        seconds = self.training_s()
        return self.tokens / seconds, seconds / max(self.steps, 1)


class MetricsFile:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def write(self, record: dict[str, Any]) -> None:
        append_line(self.path, json.dumps(record))  # whole records only, even on a full disk


def read_metrics(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


WINDOW_MEAN = "mean since last line"  # what the printed train loss is (metrics.jsonl's `loss`)


def format_record(r: dict[str, Any], max_steps: int | None) -> str:
    """One console line per log step. The train loss is labelled: it is the mean over the steps since the last
    line, so while the loss falls fast it sits well above the validation loss of the current weights."""
    step = f"step {r['step']}" + (f"/{max_steps}" if max_steps else "")
    parts = [step, f"train loss {r['loss']:.4f} ({WINDOW_MEAN})"]
    if "val_loss" in r:
        parts.append(f"val {r['val_loss']:.4f}")
    parts += [f"lr {r['lr']:.2e}", f"gnorm {r['grad_norm']:.2f}", f"{_si(r['tokens_per_s'])} tok/s"]
    if "tokens_per_s_per_rank" in r:
        parts[-1] += f" ({_si(r['tokens_per_s_per_rank'])}/rank x {r['world_size']})"
    parts.append("MFU n/a" if r["mfu"] is None else f"MFU {100 * r['mfu']:.1f}%")
    parts += [f"{1000 * r['step_time_s']:.0f} ms/step", f"mem {r['peak_mem_gb']:.2f} GB"]
    return " | ".join(parts)


def _si(x: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def human_count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def human_hours(hours: float) -> str:
    """A wall-clock budget in the unit a person would use: `95 s`, `12 min`, `1.5 h` (never `0.0264 h`)."""
    seconds = hours * 3600
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{hours:.3g} h"
