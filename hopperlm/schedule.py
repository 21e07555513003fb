"""The learning-rate schedule: warm-up, then a shape (cosine, linear, WSD or constant) over the run's budget;
and what follows the same clock: Muon's momentum and its weight decay.

The LR is a function of the optimizer step (for warm-up) and of `progress`, the fraction of the run's budget
used so far. With a step or token budget progress advances step by step; with a wall-clock budget it is
elapsed / budget, so the decay lands at the deadline whatever the speed of the machine. A warm-up given as a
share of the budget (optim.warmup_share) is laid on `progress` too, like the decay. The training loop sets them
(train/loop.py) and the loss forecast replays the LR to the budget's end (observe/forecast.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hopperlm.config import OptimConfig, TrainConfig


@dataclass(frozen=True)
class MuonSchedule:
    """Muon's settings that follow the clock, for one step: its momentum and what its weight decay is
    multiplied by."""

    momentum: float
    decay_factor: float


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


def counted_warmup_steps(cfg: OptimConfig) -> int:
    """The warm-up in steps that a step budget's progress counts from: optim.warmup_steps, or 0 when the
    warm-up is a share of the budget (it is laid on the progress itself)."""
    return cfg.warmup_steps if cfg.warmup_share is None else 0


def shape_progress(progress: float, cfg: OptimConfig) -> float | None:
    """How far along the shape after warm-up the run is, in [0, 1], at budget fraction `progress`; None while a
    warm-up given as a share of the budget lasts (a warm-up in steps is counted by budget_progress)."""
    p = min(max(progress, 0.0), 1.0)
    share = cfg.warmup_share
    if share is None:
        return p
    return None if p < share else (p - share) / (1.0 - share)


def lr_at(step: int, progress: float, cfg: OptimConfig) -> float:
    """Learning rate for optimizer step `step` (0-based) at budget fraction `progress` in [0, 1]."""
    if cfg.warmup_share is None and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    p = shape_progress(progress, cfg)
    if p is None:  # a warm-up share: linear from 0 at the start of the budget (as transformers' warm-up)
        return cfg.lr * max(progress, 0.0) / cfg.warmup_share
    min_lr = cfg.lr * cfg.min_lr_ratio
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


def decay_progress(progress: float, cfg: OptimConfig) -> float:
    """How far through the LR's decay the run is, in [0, 1]: WSD's decay over its last decay_fraction, the
    whole shape for cosine and linear, never for constant."""
    p = shape_progress(progress, cfg)
    if p is None or cfg.schedule == "constant":
        return 0.0
    if cfg.schedule == "wsd":
        return max(0.0, (p - (1.0 - cfg.decay_fraction)) / cfg.decay_fraction)
    return p


def muon_momentum_at(step: int, progress: float, cfg: OptimConfig) -> float:
    """Muon's momentum at optimizer step `step`: optim.muon_momentum_start rising linearly to muon_momentum over
    muon_momentum_warmup_steps, then (with muon_momentum_final) falling linearly to that over the LR's decay
    (nanochat's 0.85 -> 0.97 -> 0.90). The warm-up wins where the two overlap."""
    warmup = cfg.muon_momentum_warmup_steps
    if step < warmup:
        return cfg.muon_momentum_start + step / warmup * (cfg.muon_momentum - cfg.muon_momentum_start)
    if cfg.muon_momentum_final is None:
        return cfg.muon_momentum
    d = decay_progress(progress, cfg)
    return cfg.muon_momentum + d * (cfg.muon_momentum_final - cfg.muon_momentum)


def weight_decay_factor(progress: float, cfg: OptimConfig) -> float:
    """What Muon's weight decay is multiplied by at budget fraction `progress`: 1 under a constant
    optim.weight_decay_schedule, a cosine from 1 to 0 over the budget under cosine (nanochat's)."""
    if cfg.weight_decay_schedule == "constant":
        return 1.0
    return 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))


def muon_schedule_at(step: int, progress: float, cfg: OptimConfig) -> MuonSchedule | None:
    """Muon's momentum and weight-decay factor at this step; None where neither moves (left as built)."""
    moves = cfg.muon_momentum_warmup_steps or cfg.muon_momentum_final is not None
    if not moves and cfg.weight_decay_schedule == "constant":
        return None
    return MuonSchedule(muon_momentum_at(step, progress, cfg), weight_decay_factor(progress, cfg))
