"""The loss forecast during training: at every evaluation, where the run will land at the end of its budget
(observe/forecast.py fits the curve), added to the metrics record, printed as one line, and a warning with
the budget that would reach train.target_loss when the target looks out of reach. Where train.forecast_from kept
the proxies' curves (`sweep --widths`), the forecast by collapse (observe/collapse.py) is printed and recorded
beside it (`forecast_collapse`); the law stays the forecast the warning and the record's `forecast` use: on the
CPU benchmark it was the better of the two (bench/results/2026-11-27-forecast-collapse-cpu.json).

    forecast: 3.05 (3.02-3.09) at step 12000 (the budget's end); target 3.0781: likely
    warning: target 3.0781 looks out of reach (forecast 3.21, at best 3.17); about 2x this budget would reach
    it by the forecast (train.max_hours 3)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from hopperlm.config import ScheduleConfig, TrainConfig
from hopperlm.config.training import BUDGET_KEYS
from hopperlm.errors import ConfigError, first_line
from hopperlm.observe import collapse
from hopperlm.observe.forecast import Forecast, forecast_curve, planned_lrs

# budgets tried, as multiples of the run's, when the target looks out of reach
BUDGET_SCALES = (1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)


class Forecaster:
    """Forecasts for one run, to the end of `tc`'s budget with `sc`'s LR schedule peaking at `peak` (optim.lr).
    `schedule`: the budget the
    LR schedule is laid over when a resume kept the original one (None: the run's own)."""

    def __init__(
        self,
        tc: TrainConfig,
        sc: ScheduleConfig,
        peak: float,
        log: Callable[[str], None],
        schedule: TrainConfig | None = None,
        proxies: list[collapse.Curve] | None = None,
        run: dict | None = None,
    ) -> None:
        """`proxies` (train.forecast_from's curves) and `run` (make_curve's description of this run but its
        schedule and losses: label, width, params, seed, parametrization, data, warmup_steps): forecast by
        collapse where they match (observe/collapse.py), else by the law."""
        self.tc, self.sc, self.peak, self.log, self.schedule = tc, sc, peak, log, schedule
        self.proxies, self.run = (proxies, run) if proxies and run else (None, None)
        self.off = False  # a forecast failed once: said in one line, then no more (training goes on)
        self.needed: str | None = None  # the last budget advice printed, so it is not repeated every eval
        # what the latest evaluation saw, and the LRs of its planned schedule (the past ones included)
        self.val_points: list[tuple[int, float]] = []
        self.train_points: list[tuple[int, float]] = []
        self.step, self.tokens_per_step, self.elapsed_s = 0, 0, 0.0
        self.lrs: list[float] = []
        self.collapsed: collapse.CollapseForecast | None = None  # the latest forecast by collapse

    def at(
        self,
        record: dict[str, Any],
        val_points: list[tuple[int, float]],
        train_points: list[tuple[int, float]],
    ) -> Forecast | None:
        """The forecast after this evaluation (None: too few evaluations yet), its fields added to `record`."""
        if self.off:
            return None
        self.step = record["step"]
        self.tokens_per_step = record["tokens"] // max(self.step, 1)
        self.elapsed_s = record["elapsed_s"]
        self.val_points, self.train_points = list(val_points), list(train_points)
        try:
            self.lrs = self._planned(self.tc, self.schedule)
            forecast = self._fit(self.lrs)
            self.collapsed = self._collapse()
        except Exception as e:  # a fit that breaks must never end a training run: one line, then off
            self.off = True
            self.log(f"forecast: off from step {self.step} ({first_line(e)[:200]})")
            return None
        if forecast is not None:
            record.update(
                forecast=forecast.final_val_loss,
                forecast_low=forecast.low,
                forecast_high=forecast.high,
                forecast_step=forecast.final_step,
            )
        if self.collapsed is not None:
            c = self.collapsed
            record.update(
                forecast_collapse=c.final_val_loss, forecast_collapse_low=c.low, forecast_collapse_high=c.high
            )
        return forecast

    def report(self, forecast: Forecast) -> None:
        """The forecast line, and when the target is out of reach, the budget that would reach it."""
        target = self.tc.target_loss
        self.log(forecast.line(target))
        if self.collapsed is not None:
            self.log(self.collapsed.line(target))
        if target is None or forecast.low <= target:
            self.needed = None
            return
        advice = self._budget_needed(target)
        if advice != self.needed:
            self.needed = advice
            self.log(
                f"warning: target {target:g} looks out of reach (forecast {forecast.final_val_loss:.4f}, at best "
                f"{forecast.low:.4f}); {advice}"
            )

    def _planned(self, tc: TrainConfig, schedule: TrainConfig | None = None) -> list[float]:
        """The LR of every step to the end of `tc`'s budget, at the speed measured so far."""
        return list(
            planned_lrs(
                tc,
                self.sc,
                self.peak,
                steps_done=self.step,
                tokens_per_step=self.tokens_per_step,
                elapsed_s=self.elapsed_s,
                schedule=schedule,
            )
        )

    def _collapse(self) -> collapse.CollapseForecast | None:
        """The forecast by collapse, or None (no proxies, or too few evaluations yet). Proxies that do not match
        this run are said once, in one line, and left."""
        if self.proxies is None:
            return None
        curve = collapse.make_curve(
            **self.run, tokens_per_step=self.tokens_per_step, lrs=self.lrs, val=self.val_points
        )
        why = collapse.check_proxies(curve, self.proxies) or collapse.tokens_mismatch(curve, self.proxies)
        if why is not None:
            self.log(
                f"forecast: train.forecast_from's proxies do not shape this run ({why}); no forecast by collapse"
            )
            self.proxies = None
            return None
        try:
            return collapse.collapse_forecast(curve, self.proxies, using=self.step / len(self.lrs))
        except ConfigError:  # too few evaluations inside the window yet: the law's forecast, as before
            return None

    def _fit(self, lrs: list[float]) -> Forecast | None:
        return forecast_curve(self.val_points, lrs, at_step=self.step, train_points=self.train_points)

    def _budget_needed(self, target: float) -> str:
        """The smallest multiple of the budget (BUDGET_SCALES) whose schedule the forecast puts at the target."""
        tc = self.tc
        for scale in BUDGET_SCALES:
            changes = {
                k: _scaled(k, getattr(tc, k), scale) for k in BUDGET_KEYS if getattr(tc, k) is not None
            }
            longer = dataclasses.replace(tc, **changes)
            # the LRs already used stay what they were; the longer budget shapes the rest (laid over it, as a
            # run started with that budget, or resumed with resume_horizon extend, would)
            forecast = self._fit(self.lrs[: self.step] + self._planned(longer)[self.step :])
            if forecast is not None and forecast.final_val_loss <= target:
                setting = ", ".join(f"train.{k} {v:g}" for k, v in changes.items())
                return f"about {scale:g}x this budget would reach it by the forecast ({setting})"
        return f"not even {BUDGET_SCALES[-1]:g}x this budget reaches it by the forecast: a larger model or more data"


def _scaled(key: str, value: float, scale: float) -> float:
    """A budget times `scale`: hours stay a fraction (a YAML `max_hours: 2` is an int), steps and tokens whole."""
    return value * scale if key == "max_hours" else int(round(value * scale))
