"""The learning-rate schedule: warm-up, then a shape (cosine, linear, WSD or constant) over the run's budget.

The LR is a function of the optimizer step (for warm-up) and of `progress`, the fraction of the run's budget
used so far. With a step or token budget progress advances step by step; with a wall-clock budget it is
elapsed / budget, so the decay lands at the deadline whatever the speed of the machine. The training loop
sets it (train/loop.py) and the loss forecast replays it to the budget's end (observe/forecast.py).
"""

from __future__ import annotations

import math

from hopperlm.config import OptimConfig, TrainConfig


def budget_progress(
    step: int, tokens: int, elapsed_s: float, cfg: TrainConfig, warmup_steps: int = 0
) -> float:
    """Fraction of the run's budget used: the largest over the budgets that are set (steps, tokens, hours).
    The step budget counts from the end of warm-up, so a step-budgeted decay spans exactly the post-warm-up
    steps (as in nanoGPT)."""
    fractions = [0.0]
    if cfg.max_steps is not None:
        span = max(1, cfg.max_steps - warmup_steps)
        fractions.append((step - warmup_steps) / span)
    if cfg.max_tokens is not None:
        fractions.append(tokens / cfg.max_tokens)
    if cfg.max_hours is not None:
        fractions.append(elapsed_s / (cfg.max_hours * 3600.0))
    return min(1.0, max(fractions))


def lr_at(step: int, progress: float, cfg: OptimConfig) -> float:
    """Learning rate for optimizer step `step` (0-based) at budget fraction `progress` in [0, 1]."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    min_lr = cfg.lr * cfg.min_lr_ratio
    p = min(max(progress, 0.0), 1.0)
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "cosine":
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * p)) * (cfg.lr - min_lr)
    if cfg.schedule == "linear":
        return cfg.lr - p * (cfg.lr - min_lr)
    if cfg.schedule == "wsd":  # warm-up, stable at the peak, then linear decay over the last decay_fraction
        start = 1.0 - cfg.decay_fraction
        if p <= start:
            return cfg.lr
        return cfg.lr - (p - start) / cfg.decay_fraction * (cfg.lr - min_lr)
    raise ValueError(f"unknown schedule {cfg.schedule!r}")
