"""Progress and ETA under every stopping rule, shown live with `rich` on a terminal or as plain lines elsewhere.

A run stops at the first of its budgets: max_steps, max_tokens, max_hours, or a validation loss at or below
target_loss. `rule_progress` says how far along each budget is and when it would end the run; `ending_rule`
picks the one that ends it first. These are pure functions of the numbers a log step knows, so they are tested
without training. The ETA uses the mean speed since the (re)start with evaluations and checkpoints included,
because they recur until the end; the first interval (compilation, warm-up) is dropped once a later one exists.
For target_loss the ETA is an extrapolation of the validation curve and is marked with "~".
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from hopperlm.config import TrainConfig
from hopperlm.observe.metrics import WINDOW_MEAN, human_count

TARGET_FIT_POINTS = 4  # evaluations the target-loss trend is fitted on (the latest ones)


@dataclass(frozen=True)
class RuleProgress:
    rule: str  # "max_steps" | "max_tokens" | "max_hours" | "target_loss"
    fraction: float | None  # share of this budget used, in [0, 1]; None when it cannot be told yet
    remaining_s: float | None  # seconds until this rule stops the run; None without a speed or a trend
    detail: str  # e.g. "step 340/1,000"
    estimate: bool = False  # an extrapolation (target_loss) rather than a count


@dataclass(frozen=True)
class Rate:
    steps_per_s: float
    tokens_per_s: float


class RateMeter:
    """Mean speed since the (re)start, from the (step, tokens, elapsed) of each log step."""

    def __init__(self, step: int, tokens: int, elapsed_s: float) -> None:
        self.marks = [(step, tokens, elapsed_s)]

    def mark(self, step: int, tokens: int, elapsed_s: float) -> None:
        if step < self.marks[-1][0]:  # a rollback: the speed before it still holds, the counts restart
            self.marks = [(step, tokens, elapsed_s)]
            return
        self.marks.append((step, tokens, elapsed_s))

    def rate(self) -> Rate | None:
        if len(self.marks) < 2:
            return None
        first = self.marks[1] if len(self.marks) >= 3 else self.marks[0]
        last = self.marks[-1]
        seconds = last[2] - first[2]
        if seconds <= 0 or last[0] <= first[0]:
            return None
        return Rate((last[0] - first[0]) / seconds, (last[1] - first[1]) / seconds)


def steps_to_target(val_points: list[tuple[int, float]], target: float) -> float | None:
    """Steps from the last evaluation until the validation loss reaches `target`, extrapolating a fit of
    loss = a + b * ln(step) over the latest evaluations (loss curves flatten roughly like that). 0 when it is
    already reached, None without a falling trend."""
    if val_points and val_points[-1][1] <= target:
        return 0.0
    points = [(s, v) for s, v in val_points if s > 0 and math.isfinite(v)][-TARGET_FIT_POINTS:]
    if len(points) < 2:
        return None
    xs = [math.log(s) for s, _ in points]
    ys = [v for _, v in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    if b >= 0:
        return None  # not falling: no honest ETA
    log_step = mx + (target - my) / b
    if log_step > 40:  # beyond e^40 steps: never, for any practical purpose
        return None
    return max(0.0, math.exp(log_step) - points[-1][0])


def _budget(rule: str, used: float, budget: float, per_s: float | None, detail: str) -> RuleProgress:
    """A counted budget: the fraction used, and the seconds left at `per_s` units a second (None: no speed)."""
    remaining = max(0.0, budget - used) / per_s if per_s else None
    return RuleProgress(rule, min(1.0, used / budget), remaining, detail)


def rule_progress(
    step: int,
    tokens: int,
    elapsed_s: float,
    tc: TrainConfig,
    rate: Rate | None,
    val_points: Sequence[tuple[int, float]] = (),
) -> list[RuleProgress]:
    """Where each budget of the run stands, in the order max_steps, max_tokens, max_hours, target_loss."""
    out = []
    if tc.max_steps is not None:
        per_s = rate and rate.steps_per_s
        out.append(_budget("max_steps", step, tc.max_steps, per_s, f"step {step:,}/{tc.max_steps:,}"))
    if tc.max_tokens is not None:
        per_s = rate and rate.tokens_per_s
        detail = f"{human_count(tokens)}/{human_count(tc.max_tokens)} tokens"
        out.append(_budget("max_tokens", tokens, tc.max_tokens, per_s, detail))
    if tc.max_hours is not None:  # the clock runs at one second per second, whatever the machine's speed
        budget = tc.max_hours * 3600
        detail = f"{format_duration(elapsed_s)}/{format_duration(budget)}"
        out.append(_budget("max_hours", elapsed_s, budget, 1.0, detail))
    if tc.target_loss is not None:
        val_points = list(val_points)
        fraction = remaining = None
        detail = f"target val {tc.target_loss:g}"
        if val_points:
            first, last = val_points[0][1], val_points[-1][1]
            detail = f"val {last:.4f} -> {tc.target_loss:g}"
            if last <= tc.target_loss:
                fraction = 1.0
            elif first > tc.target_loss:
                fraction = min(1.0, max(0.0, (first - last) / (first - tc.target_loss)))
        steps = steps_to_target(val_points, tc.target_loss)
        if steps is not None and rate and rate.steps_per_s > 0:
            remaining = steps / rate.steps_per_s
        out.append(RuleProgress("target_loss", fraction, remaining, detail, estimate=True))
    return out


def ending_rule(rules: list[RuleProgress]) -> RuleProgress:
    """The budget expected to end the run first: the soonest ETA; without any ETA, the most used budget."""
    timed = [r for r in rules if r.remaining_s is not None]
    if timed:
        return min(timed, key=lambda r: r.remaining_s)
    known = [r for r in rules if r.fraction is not None]
    return max(known, key=lambda r: r.fraction) if known else rules[0]


def format_duration(seconds: float) -> str:
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def eta_text(rule: RuleProgress, since_s: float = 0.0) -> str:
    """'34% ETA 12m05s (max_steps)'; `since_s` counts down a remaining time measured that long ago."""
    parts = [] if rule.fraction is None else [f"{100 * rule.fraction:.0f}%"]
    if rule.remaining_s is None:
        parts.append("ETA ?")
    else:
        parts.append(f"ETA {'~' if rule.estimate else ''}{format_duration(rule.remaining_s - since_s)}")
    return " ".join(parts) + f" ({rule.rule})"


# ---- the console -------------------------------------------------------------------------------------------
def choose_progress(mode: str, stream: TextIO | None = None) -> tuple[str, str]:
    """('rich' | 'plain', why) for log.progress."""
    if mode != "auto":
        return mode, f"{mode} (set by log.progress)"
    stream = stream or sys.stdout
    if getattr(stream, "isatty", lambda: False)():
        return "rich", "rich live display (stdout is a terminal)"
    return "plain", "plain lines (stdout is not a terminal)"


@dataclass
class Snapshot:
    """What the live display shows, as of one log step."""

    record: dict[str, Any]
    rules: list[RuleProgress]
    ending: RuleProgress
    best_val: float | None
    last_val: float | None
    taken_at: float  # time.perf_counter() when it was taken


class RichProgress:
    """A bar with the ETA of the ending budget and the latest numbers, redrawn twice a second below the log lines
    (which rich keeps scrolling above it). Elapsed time and ETA tick between log steps."""

    def __init__(self, console: Any = None) -> None:
        from rich.console import Console

        # forced on (log.progress rich) even where stdout is not a terminal: draw as on one
        self.console = console or Console(force_terminal=True)
        self.snapshot: Snapshot | None = None
        self.live = None

    def start(self) -> None:
        from rich.live import Live

        self.live = Live(
            get_renderable=self.render,
            console=self.console,
            refresh_per_second=2,
            redirect_stdout=True,
            redirect_stderr=True,
        )
        self.live.start()

    def update(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        if self.live is not None:
            self.live.refresh()

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

    def render(self):
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        snap = self.snapshot
        if snap is None:
            return Text("waiting for the first log step ...", style="dim")
        since = time.perf_counter() - snap.taken_at
        top = Table.grid(padding=(0, 1))
        top.add_row(
            ProgressBar(total=1.0, completed=snap.ending.fraction or 0.0, width=36),
            Text(eta_text(snap.ending, since), style="bold"),
            Text(" | ".join(r.detail for r in snap.rules), style="dim"),
        )
        return Group(top, Text(live_numbers(snap.record, snap.last_val, snap.best_val)))


def live_numbers(r: dict[str, Any], last_val: float | None, best_val: float | None) -> str:
    """The second line of the live display: loss, validation, speed, MFU, memory and the GPU's state."""
    parts = [f"train loss {r['loss']:.4f} ({WINDOW_MEAN})"]  # a window mean: see format_record
    if last_val is not None:
        parts.append(f"val {last_val:.4f} (best {best_val:.4f})")
    parts += [f"lr {r['lr']:.2e}", f"gnorm {r['grad_norm']:.2f}", f"{human_count(r['tokens_per_s'])} tok/s"]
    parts.append("MFU n/a" if r.get("mfu") is None else f"MFU {100 * r['mfu']:.1f}%")
    parts.append(f"mem {r['peak_mem_gb']:.2f} GB")
    gpu = [
        f"{r['gpu_util']:.0f}%" if "gpu_util" in r else None,
        f"{r['gpu_power_w']:.0f} W" if "gpu_power_w" in r else None,
        f"{r['gpu_temp_c']:.0f} C" if "gpu_temp_c" in r else None,
        f"{r['gpu_mem_gb']:.1f} GB used" if "gpu_mem_gb" in r else None,
    ]
    if any(gpu):
        parts.append("GPU " + " ".join(g for g in gpu if g))
    return " | ".join(parts)
