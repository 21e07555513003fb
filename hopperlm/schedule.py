"""The learning-rate schedule: warm-up, then a shape (cosine, linear, WSD or constant) over the run's budget;
and what follows the same clock: Muon's momentum and its weight decay.

The LR is a function of the optimizer step (for warm-up) and of `progress`, the fraction of the run's budget
used so far. With a step or token budget progress advances step by step; with a wall-clock budget it is
elapsed / budget, so the decay lands at the deadline whatever the speed of the machine. A warm-up given as a
share of the budget (schedule.warmup_share) is laid on `progress` too, like the decay. The training loop sets them
(train/loop.py) and the loss forecast replays the LR to the budget's end (observe/forecast.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hopperlm.config import MuonConfig, ScheduleConfig, TrainConfig


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


def counted_warmup_steps(cfg: ScheduleConfig) -> int:
    """The warm-up in steps that a step budget's progress counts from: schedule.warmup_steps, or 0 when the
    warm-up is a share of the budget (it is laid on the progress itself)."""
    return cfg.warmup_steps if cfg.warmup_share is None else 0


def shape_progress(progress: float, cfg: ScheduleConfig) -> float | None:
    """How far along the shape after warm-up the run is, in [0, 1], at budget fraction `progress`; None while a
    warm-up given as a share of the budget lasts (a warm-up in steps is counted by budget_progress)."""
    p = min(max(progress, 0.0), 1.0)
    share = cfg.warmup_share
    if share is None:
        return p
    return None if p < share else (p - share) / (1.0 - share)


def lr_at(step: int, progress: float, cfg: ScheduleConfig, peak: float) -> float:
    """Learning rate for optimizer step `step` (0-based) at budget fraction `progress` in [0, 1], peaking at
    `peak` (optim.lr)."""
    if cfg.warmup_share is None and step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    p = shape_progress(progress, cfg)
    if p is None:  # a warm-up share: linear from 0 at the start of the budget (as transformers' warm-up)
        return peak * max(progress, 0.0) / cfg.warmup_share
    min_lr = peak * cfg.min_lr_ratio
    if cfg.name == "constant":
        return peak
    if cfg.name == "cosine":
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * p)) * (peak - min_lr)
    if cfg.name == "linear":
        return peak - p * (peak - min_lr)
    if cfg.name == "wsd":  # warm-up, stable at the peak, then linear decay over the last decay_fraction
        start = 1.0 - cfg.decay_fraction
        if p <= start:
            return peak
        return peak - (p - start) / cfg.decay_fraction * (peak - min_lr)
    raise ValueError(f"unknown schedule {cfg.name!r}")


def decay_progress(progress: float, cfg: ScheduleConfig) -> float:
    """How far through the LR's decay the run is, in [0, 1]: WSD's decay over its last decay_fraction, the
    whole shape for cosine and linear, never for constant."""
    p = shape_progress(progress, cfg)
    if p is None or cfg.name == "constant":
        return 0.0
    if cfg.name == "wsd":
        return max(0.0, (p - (1.0 - cfg.decay_fraction)) / cfg.decay_fraction)
    return p


def muon_momentum_at(step: int, progress: float, muon: MuonConfig, sc: ScheduleConfig) -> float:
    """Muon's momentum at optimizer step `step`: muon.momentum_start rising linearly to muon.momentum over
    muon.momentum_warmup_steps, then (with muon.momentum_final) falling linearly to that over the LR's decay
    (nanochat's 0.85 -> 0.97 -> 0.90). The warm-up wins where the two overlap."""
    warmup = muon.momentum_warmup_steps
    if step < warmup:
        return muon.momentum_start + step / warmup * (muon.momentum - muon.momentum_start)
    if muon.momentum_final is None:
        return muon.momentum
    d = decay_progress(progress, sc)
    return muon.momentum + d * (muon.momentum_final - muon.momentum)


def weight_decay_factor(progress: float, muon: MuonConfig) -> float:
    """What Muon's weight decay is multiplied by at budget fraction `progress`: 1 under a constant
    muon.weight_decay_schedule, a cosine from 1 to 0 over the budget under cosine (nanochat's)."""
    if muon.weight_decay_schedule == "constant":
        return 1.0
    return 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))


def muon_schedule_at(step: int, progress: float, muon: MuonConfig, sc: ScheduleConfig) -> MuonSchedule | None:
    """Muon's momentum and weight-decay factor at this step; None where neither moves (left as built)."""
    moves = muon.momentum_warmup_steps or muon.momentum_final is not None
    if not moves and muon.weight_decay_schedule == "constant":
        return None
    return MuonSchedule(muon_momentum_at(step, progress, muon, sc), weight_decay_factor(progress, muon))
