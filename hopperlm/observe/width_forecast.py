"""Where will the big run land? A forecast of its final validation loss from finished proxy runs at several
widths, trained at the same tokens per parameter as the big run (`hopperlm sweep --widths`).

At a fixed number of tokens per parameter the final loss falls with the model's size along a power law with a
floor, L(N) = E + A * N^(-alpha) (Hoffmann et al. 2022, along their compute-optimal line; Kaplan et al. 2020),
which at the widths a proxy sweep affords may look like a plain power law, L = A * N^(-alpha), or a line in
log N. The three laws extrapolate differently, so the forecast lets the proxies choose: each law is fitted to
the narrower proxies and asked for the widest one (as far beyond them as the big run is beyond the widest
proxy, when the widths allow), and the law that misses it least is refitted to every proxy and extrapolated to
the big run. The interval is the larger of two spreads: the forecasts from every choice of one seed per width
(the noise of the proxies), and that law's backtest miss (its error at one extrapolation step).
Measured on the CPU by bench/width_forecast.py (its results file says how well it does).
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from hopperlm.errors import ConfigError

ALPHAS = np.geomspace(0.02, 2.0, 200)
"""The floor law's exponent grid: for a fixed alpha it is linear in (E, A), fitted by least squares."""
MIN_WIDTHS = 3
"""Proxy widths a forecast needs: two to fit a law's two free numbers and one more to choose between laws."""
MAX_SEED_CHOICES = 256
"""At most this many one-seed-per-width combinations enter the interval (all of them for a few widths)."""


def _fit_floor(n: np.ndarray, loss: np.ndarray):
    """L = E + A * N^-alpha with A >= 0, E >= 0: the alpha on the grid with the least squared error."""
    best = None
    for alpha in ALPHAS:
        x = n ** (-alpha)
        design = np.stack([np.ones_like(x), x], axis=1)
        (e, a), *_ = np.linalg.lstsq(design, loss, rcond=None)
        if a < 0 or e < 0:
            continue
        sse = float(np.sum((e + a * x - loss) ** 2))
        if best is None or sse < best[0]:
            best = (sse, float(e), float(a), float(alpha))
    if best is None:  # the loss does not fall with size here: the mean is the best constant
        return lambda m: float(np.mean(loss)) + 0.0 * m
    _, e, a, alpha = best
    return lambda m: e + a * m ** (-alpha)


def _fit_power(n: np.ndarray, loss: np.ndarray):
    """L = A * N^-alpha: a line in (log N, log L)."""
    slope, intercept = np.polyfit(np.log(n), np.log(loss), 1)
    return lambda m: math.exp(intercept) * m**slope


def _fit_log(n: np.ndarray, loss: np.ndarray):
    """L = a - b log N: a line in (log N, L)."""
    slope, intercept = np.polyfit(np.log(n), loss, 1)
    return lambda m: intercept + slope * math.log(m)


LAWS = {"floor": _fit_floor, "power": _fit_power, "log": _fit_log}
"""name: fit(params, losses) -> predict(params)."""
FREE = {"floor": 3, "power": 2, "log": 2}
"""Each law's free numbers: the backtest fits a law on at least that many widths (then asks it for a width it
did not see)."""


@dataclass
class WidthForecast:
    target_params: int
    tokens_per_param: float
    law: str
    """The law the backtest chose (LAWS)."""
    final_val_loss: float
    low: float
    high: float
    backtest: dict
    """{law: relative error forecasting the widest proxy from the narrower ones}, and which widths did what."""
    points: list
    """[{width, params, seed, final_val_loss}] of the proxies."""
    curves: list = field(default_factory=list)
    """The proxies' whole validation curves (observe/collapse.py's Curve as dicts): `forecast --proxies` fits a
    run's first part of its budget to their shape."""

    def line(self, tokens: float | None = None) -> str:
        widths = sorted({p["width"] for p in self.points})
        text = (
            f"forecast from proxies: final val loss {self.final_val_loss:.3f} ({self.low:.3f}-{self.high:.3f}) "
            f"at {self.target_params:,} parameters and {self.tokens_per_param:.3g} tokens per parameter "
            f"({self.law} law over widths {widths[0]}-{widths[-1]}, {len(self.points)} runs)"
        )
        if tokens:
            here = tokens / self.target_params
            text += f"; this run: {here:.3g} tokens per parameter"
            if abs(here / self.tokens_per_param - 1) > 0.1:
                text += " (not the proxies': the forecast does not apply to this budget)"
        return text

    def save(self, path: Path) -> None:
        from hopperlm.files import write_atomic

        write_atomic(path, json.dumps(asdict(self), indent=1))


def load(path: str | Path) -> WidthForecast:
    """A saved forecast; ConfigError naming the file when it is missing or not one."""
    try:
        return WidthForecast(**json.loads(Path(path).read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(
            f"train.forecast_from {path}: not a forecast written by `hopperlm sweep --widths` ({e}); "
            "rerun the sweep or remove the key"
        ) from None


def mean_by_width(points: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(each width's parameters, its mean final loss over seeds), narrowest first."""
    widths = sorted({p["width"] for p in points})
    n = np.array([next(p["params"] for p in points if p["width"] == w) for w in widths], dtype=float)
    loss = np.array(
        [statistics.fmean(p["final_val_loss"] for p in points if p["width"] == w) for w in widths]
    )
    return n, loss


def forecast(points: list[dict], *, target_params: int, tokens_per_param: float) -> WidthForecast:
    """The big run's final validation loss from proxy runs: `points` are {width, params, seed, final_val_loss}
    of finished runs at `tokens_per_param` (failed runs left out by the caller)."""
    points = [p for p in points if p["final_val_loss"] is not None and math.isfinite(p["final_val_loss"])]
    n, loss = mean_by_width(points)
    if len(n) < MIN_WIDTHS:
        raise ConfigError(
            f"a forecast needs finished runs at {MIN_WIDTHS} or more widths, got {len(n)}; "
            "give --widths at least three widths"
        )
    if target_params <= n[-1]:
        raise ConfigError(
            f"the target's {target_params:,} parameters are not beyond the widest proxy's {int(n[-1]):,}: "
            "the proxies must be narrower than the target"
        )
    # the backtest: from the proxies up to 1/ratio of the widest, forecast the widest (the ratio as large as
    # the big run's over the widest proxy, as far as the widths allow; at least two proxies to fit)
    ratio = target_params / n[-1]
    fit_upto = min(max(3, int(np.sum(n <= n[-1] / ratio))), len(n) - 1)
    errors = {}
    for name, fit in LAWS.items():
        if fit_upto < FREE[name]:  # fewer points than free numbers: any curve fits, the backtest says nothing
            continue
        predicted = fit(n[:fit_upto], loss[:fit_upto])(n[-1])
        errors[name] = round(float(predicted / loss[-1] - 1), 5)
    law = min(errors, key=lambda k: abs(errors[k]))
    center = LAWS[law](n, loss)(target_params)
    # the proxies' noise: the forecast from each choice of one seed per width
    widths = sorted({p["width"] for p in points})
    choices = itertools.product(*[[p for p in points if p["width"] == w] for w in widths])
    spread = []
    for choice in itertools.islice(choices, MAX_SEED_CHOICES):
        cn, cl = mean_by_width(list(choice))
        spread.append(LAWS[law](cn, cl)(target_params))
    half = max(max(spread) - center, center - min(spread), abs(errors[law]) * center)
    return WidthForecast(
        target_params=int(target_params),
        tokens_per_param=float(tokens_per_param),
        law=law,
        final_val_loss=round(float(center), 4),
        low=round(float(center - half), 4),
        high=round(float(center + half), 4),
        backtest={
            "relative_error": errors,
            "fitted_widths": widths[:fit_upto],
            "forecast_width": widths[-1],
        },
        points=points,
    )
