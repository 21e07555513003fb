"""Forecast a run's final validation loss by scaling collapse: its μP proxies' whole curves give the shape, the
run's own first part of its budget gives the scale.

Qiu et al. 2025 ("Scaling collapse reveals universal dynamics in compute-optimally trained neural networks")
find that under μP-style transfer at a fixed number of tokens per parameter and one schedule shape, loss curves
normalised as (L(t) - L(T)) / (L(t0) - L(T)) against the budget's fraction t / T fall onto one curve across model
sizes; Bergsma et al. 2025 find the same under joint width, depth, LR and batch scaling. So, with f that curve:

    L_run(tau) = floor + scale * f(tau)         tau = step / the run's last step

and the forecast is `floor`, L_run(1) (f(1) = 0). Both are fitted by least squares to the run's validation
losses within the share of its budget it has trained; nothing else about the run is free.

The shape. Each proxy curve is normalised by its own final loss and its mean loss over the window the run is
fitted on ([the first 5% of the budget or the warm-up's end, `using`]), so f's mean over that window is 1 and
the normalisation's noise is the mean's, not one evaluation's. Seeds of one width are averaged first, then the
widths, with equal weight.

The interval, four relative spreads added in quadrature and multiplied by Z (fixed before the benchmark ran,
bench/forecast_collapse.py's PLAN): (1) the backtest: the widest proxy forecast from the narrower ones' shape
at the same `using`; (2) leave one width out: each width forecast from the others' shape, their RMS error;
(3) the seeds: the final loss's spread between seeds of one width; (4) the fit's own standard error of the
floor. The proxies must match the run: same schedule shape, parametrization and data, and tokens per parameter
within 10%; `check_proxies` says what differs.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from hopperlm.errors import ConfigError

MIN_WIDTHS = 3
"""Proxy widths the shape needs: one to backtest with, and two for the shape it is backtested against."""
MIN_POINTS = 4
"""The run's validation losses inside the window: two free numbers and two to check them with."""
SKIP_FRACTION = 0.05
"""The window starts after the first 5% of the budget (and after warm-up): the transient before it differs most
between sizes (the law's own rule, observe/forecast.py)."""
Z = 1.5
"""Half-width of the interval in units of the combined relative spread (pre-registered: PLAN in
bench/forecast_collapse.py)."""
FLOOR = 0.003
"""The interval is at least +-0.3%: the validation set's own noise."""
SHAPE_GRID = 101
"""The LR schedule's shape is compared at this many fractions of the budget."""
SHAPE_TOLERANCE = 0.05
"""Schedules whose normalised LR differs by more than this at some fraction of the budget past the window's start
(warm-up and the first 5%) have another shape."""
TOKENS_TOLERANCE = 0.10
"""Tokens per parameter within 10% of the proxies' count as the same."""


@dataclass(frozen=True)
class Curve:
    """One run's validation curve and what a collapse needs to know about it."""

    label: str
    width: int
    params: int
    seed: int
    final_step: int
    """The budget's last step (T)."""
    tokens_per_param: float
    """Training tokens at T over the parameters `params` counts (sweep's model_params)."""
    lr_shape: list[float]
    """The LR schedule, normalised by its peak, at SHAPE_GRID evenly spaced fractions of T."""
    warmup_fraction: float
    parametrization: str
    data: str
    val: list[tuple[int, float]]
    """(step, validation loss), in step order."""

    @property
    def final_val_loss(self) -> float | None:
        return self.val[-1][1] if self.val and self.val[-1][0] >= self.final_step else None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Curve:
        return cls(**{**d, "val": [tuple(p) for p in d["val"]]})


def lr_shape(lrs: Sequence[float]) -> list[float]:
    """The schedule `lrs` (one LR per step) normalised by its peak, at SHAPE_GRID fractions of its length."""
    eta = np.asarray(lrs, dtype=float)
    eta = eta / eta.max()
    at = np.linspace(0, len(eta) - 1, SHAPE_GRID)
    return [round(float(v), 5) for v in np.interp(at, np.arange(len(eta)), eta)]


def make_curve(
    *,
    label: str,
    width: int,
    params: int,
    seed: int,
    parametrization: str,
    data: str,
    warmup_steps: int,
    tokens_per_step: int,
    lrs: Sequence[float],
    val: Sequence[tuple[int, float]],
) -> Curve:
    """A run's curve from what it is (width, parameters as `sweep --widths` counts them, seed, parametrization,
    data), its LR schedule to the budget's end (one LR per step) and its validation losses so far."""
    return Curve(
        label=label,
        width=int(width),
        params=int(params),
        seed=int(seed),
        final_step=len(lrs),
        tokens_per_param=len(lrs) * tokens_per_step / params,
        lr_shape=lr_shape(lrs),
        warmup_fraction=min(1.0, warmup_steps / len(lrs)),
        parametrization=parametrization,
        data=data,
        val=[(int(s), float(v)) for s, v in val if math.isfinite(v)],
    )


def identity(cfg) -> dict:
    """The parametrization and data of a run's Config, as curves name them."""
    data = str(Path(cfg.data.path).resolve()) if cfg.data.path else str(cfg.sft.path)
    return {"parametrization": f"{cfg.model.parametrization}/{cfg.model.depth_parametrization}", "data": data}


def curve_of_run(run_dir: Path, *, label: str | None = None) -> Curve:
    """A run folder's curve: its config.yaml, plan.json and metrics.jsonl (the LR schedule as the loop sets it,
    the budget's last step, the parameters the run counted, as `sweep --widths` counts them)."""
    from hopperlm.observe.forecast import read_records, read_run_config, run_schedule, validation_points

    run_dir = Path(run_dir)
    cfg, records = read_run_config(run_dir), read_records(run_dir)
    if not records:
        raise ConfigError(f"{run_dir}: no training records in metrics.jsonl; it has not trained a step")
    try:
        params = json.loads((run_dir / "plan.json").read_text())["model"]["parameters"]["total"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(
            f"{run_dir}/plan.json: missing or without the model's parameter count; a run folder written by "
            "`hopperlm train` has it"
        ) from None
    lrs = run_schedule(cfg, records, run_dir)
    share = cfg.schedule.warmup_share  # a warm-up laid over the budget: its steps out of the schedule's
    return make_curve(
        label=label or run_dir.name,
        width=cfg.model.dim,
        params=params,
        seed=cfg.train.seed,
        warmup_steps=cfg.schedule.warmup_steps if share is None else round(share * len(lrs)),
        tokens_per_step=max(1, round(records[-1].get("tokens", 0) / max(1, records[-1]["step"]))),
        lrs=lrs,
        val=validation_points(records),
        **identity(cfg),
    )


def check_proxies(run: Curve, proxies: Sequence[Curve]) -> str | None:
    """None when the proxies can shape this run's forecast, else what differs (one clause): fewer than
    MIN_WIDTHS finished widths, another schedule shape, parametrization or data. (Another number of tokens per
    parameter: `tokens_mismatch`.)"""
    finished = [p for p in proxies if p.final_val_loss is not None]
    widths = sorted({p.width for p in finished})
    if len(widths) < MIN_WIDTHS:
        return f"the proxies have {len(widths)} finished width(s) ({widths}); the collapse needs {MIN_WIDTHS} or more"
    for p in finished:
        if p.parametrization != run.parametrization:
            return f"proxy {p.label} is {p.parametrization}, the run {run.parametrization}"
        if p.data != run.data:
            return f"proxy {p.label} trained on {p.data}, the run on {run.data}"
        # after warm-up: a warm-up of a few steps is a different share of a short and a long run's budget
        first = math.ceil(_window([run, p], 1.0)[0] * (SHAPE_GRID - 1))
        gap = float(np.max(np.abs(np.array(p.lr_shape[first:]) - np.array(run.lr_shape[first:]))))
        if gap > SHAPE_TOLERANCE:
            return (
                f"proxy {p.label}'s LR schedule has another shape than the run's (normalised LRs differ by up "
                f"to {gap:.2f})"
            )
    return None


def tokens_mismatch(run: Curve, proxies: Sequence[Curve]) -> str | None:
    """What differs when the proxies trained another number of tokens per parameter than the run (by more than
    TOKENS_TOLERANCE), else None: their curves then have another shape, and the in-run law forecasts instead."""
    finished = [p.tokens_per_param for p in proxies if p.final_val_loss is not None]
    theirs = statistics.fmean(finished) if finished else run.tokens_per_param
    if abs(theirs / run.tokens_per_param - 1) <= TOKENS_TOLERANCE:
        return None
    return f"the proxies trained {theirs:.3g} tokens per parameter, the run {run.tokens_per_param:.3g}"


def _window(curves: Sequence[Curve], using: float) -> tuple[float, float]:
    """The fractions of the budget the run's fit (and the shape's normalisation) uses."""
    start = max([SKIP_FRACTION] + [c.warmup_fraction for c in curves])
    return start, using


def _interp(curve: Curve, taus: np.ndarray) -> np.ndarray:
    steps = np.array([s for s, _ in curve.val], dtype=float) / curve.final_step
    return np.interp(taus, steps, np.array([v for _, v in curve.val]))


def shape(
    proxies: Sequence[Curve], window: tuple[float, float], taus: np.ndarray, at_params: int | None = None
) -> np.ndarray:
    """The collapsed curve f at `taus`: each proxy normalised to 0 at its end and mean 1 over the window,
    averaged over seeds per width, then over widths. With `at_params`, the widths' normalised curves are not
    averaged but extrapolated: at each tau a line through them against log(parameters), read at `at_params`
    (the `collapse-width` method: for curves that do not quite collapse, but drift with size)."""
    grid = np.linspace(window[0], window[1], 64)
    per_width: dict[int, list[np.ndarray]] = {}
    sizes: dict[int, list[float]] = {}
    for p in proxies:
        final = p.final_val_loss
        level = float(np.mean(_interp(p, grid))) - final if final is not None else 0.0
        if level <= 0:
            continue  # a curve that does not fall over the window has no shape to lend
        per_width.setdefault(p.width, []).append((_interp(p, taus) - final) / level)
        sizes.setdefault(p.width, []).append(math.log(p.params))
    if not per_width:
        raise ConfigError("no proxy's validation loss falls from the window to its end: nothing to collapse")
    curves = np.array([np.mean(v, axis=0) for v in per_width.values()])
    if at_params is None or len(per_width) < 2:
        return curves.mean(axis=0)
    x = np.array([statistics.fmean(sizes[w]) for w in per_width])
    slope, intercept = np.polyfit(x, curves, 1)  # one line per tau (the columns)
    return intercept + slope * math.log(at_params)


def fit_floor(f_of: np.ndarray, points: list[tuple[int, float]]) -> tuple[float, float, float]:
    """(floor, scale, the floor's standard error) of L = floor + scale * f fitted to `points`."""
    y = np.array([v for _, v in points])
    x = np.stack([np.ones_like(f_of), f_of], axis=1)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    resid = y - x @ coef
    dof = max(1, len(y) - 2)
    cov = np.linalg.pinv(x.T @ x) * float(resid @ resid) / dof
    return float(coef[0]), float(coef[1]), math.sqrt(max(0.0, float(cov[0, 0])))


def _forecast(
    run: Curve, proxies: Sequence[Curve], using: float, extrapolate: bool = False
) -> tuple[float, float] | None:
    """(floor, its standard error) of `run` from `proxies`' shape (extrapolated to the run's size with
    `extrapolate`), its points within `using`; None when it has fewer than MIN_POINTS there."""
    window = _window([run, *proxies], using)
    points = [(s, v) for s, v in run.val if window[0] < s / run.final_step <= using + 1e-9]
    if len(points) < MIN_POINTS:
        return None
    taus = np.array([s / run.final_step for s, _ in points])
    floor, _, se = fit_floor(shape(proxies, window, taus, run.params if extrapolate else None), points)
    return floor, se


@dataclass(frozen=True)
class CollapseForecast:
    final_val_loss: float
    low: float
    high: float
    final_step: int
    at_step: int
    using: float
    spreads: dict
    """The interval's parts, relative: backtest, leave_one_out, seeds, fit."""
    widths: list[int]
    method: str = "collapse"

    def line(self, target: float | None = None) -> str:
        how = "collapse" if self.method == "collapse" else "collapse, its shape extrapolated in size"
        text = (
            f"forecast by {how}: {self.final_val_loss:.3f} ({self.low:.3f}-{self.high:.3f}) at step "
            f"{self.final_step} (the budget's end), from {self.using:.0%} of the run and proxies at widths "
            f"{', '.join(map(str, self.widths))}"
        )
        if target is None:
            return text
        verdict = "likely" if self.high <= target else "unlikely" if self.low > target else "possible"
        return f"{text}; target {target:g}: {verdict}"

    def to_dict(self) -> dict:
        return asdict(self)


def _relative_miss(
    target: Sequence[Curve], others: Sequence[Curve], using: float, extrapolate: bool = False
) -> float | None:
    """Mean relative error forecasting each curve of `target` (one width) from `others`' shape."""
    misses = []
    for t in target:
        got = _forecast(t, others, using, extrapolate)
        if got is not None and t.final_val_loss:
            misses.append(got[0] / t.final_val_loss - 1)
    return statistics.fmean(misses) if misses else None


def collapse_forecast(
    run: Curve, proxies: Sequence[Curve], *, using: float, extrapolate: bool = False
) -> CollapseForecast:
    """The run's final validation loss from its points within `using` of its budget and the proxies' shape
    (`extrapolate`: the shape extrapolated in size to the run's parameters, method `collapse-width`; it measured
    worse than the plain collapse, docs/benchmarks.md, and stays for the benchmark that measured it).
    ConfigError when the proxies do not match the run (check_proxies) or the run has too few points."""
    if (why := check_proxies(run, proxies)) is not None:
        raise ConfigError(f"forecast --proxies: {why}")
    proxies = [p for p in proxies if p.final_val_loss is not None]
    got = _forecast(run, proxies, using, extrapolate)
    if got is None:
        raise ConfigError(
            f"forecast --proxies: the run has fewer than {MIN_POINTS} validation losses between "
            f"{_window([run, *proxies], using)[0]:.0%} and {using:.0%} of its budget; evaluate more often "
            "(train.eval_every) or forecast later"
        )
    floor, se = got
    by_width: dict[int, list[Curve]] = {}
    for p in proxies:
        by_width.setdefault(p.width, []).append(p)
    widths = sorted(by_width)
    backtest = _relative_miss(
        by_width[widths[-1]], [p for w in widths[:-1] for p in by_width[w]], using, extrapolate
    )
    loo = [m for w in widths if (m := _relative_miss(by_width[w], [p for v in widths if v != w for p in by_width[v]], using, extrapolate)) is not None]  # fmt: skip
    seed_sd = [statistics.stdev([p.final_val_loss for p in c]) / statistics.fmean([p.final_val_loss for p in c])
               for c in by_width.values() if len(c) > 1]  # fmt: skip
    spreads = {
        "backtest": abs(backtest) if backtest is not None else 0.0,
        "leave_one_out": math.sqrt(statistics.fmean(m * m for m in loo)) if loo else 0.0,
        "seeds": statistics.fmean(seed_sd) if seed_sd else 0.0,
        "fit": se / floor if floor > 0 else 0.0,
    }
    half = floor * max(FLOOR, Z * math.sqrt(sum(v * v for v in spreads.values())))
    at = max((s for s, _ in run.val if s / run.final_step <= using + 1e-9), default=0)
    return CollapseForecast(
        final_val_loss=round(floor, 5),
        low=round(floor - half, 5),
        high=round(floor + half, 5),
        final_step=run.final_step,
        at_step=int(at),
        using=using,
        spreads={k: round(v, 5) for k, v in spreads.items()},
        widths=widths,
        method="collapse-width" if extrapolate else "collapse",
    )


def evaluated_share(run: Curve) -> float:
    """How far into its budget the run has validation losses: the `using` of a forecast made now."""
    return max((s for s, _ in run.val), default=0) / run.final_step


def read_proxies(sweep_dir: Path) -> list[Curve]:
    """The proxy curves `sweep --widths` kept in SWEEP_DIR/forecast.json; ConfigError naming the folder when
    there are none."""
    curves = saved_curves(Path(sweep_dir) / "forecast.json")
    if not curves:
        raise ConfigError(
            f"--proxies {sweep_dir}: no proxy curves there ({Path(sweep_dir) / 'forecast.json'} from `hopperlm "
            "sweep --widths` holds them); pass the folder of a sweep with --widths"
        )
    return curves


def saved_curves(path: Path) -> list[Curve]:
    """The curves a forecast.json keeps (none: a file from before they were kept, or not a forecast)."""
    try:
        return [Curve.from_dict(c) for c in json.loads(Path(path).read_text()).get("curves", [])]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
