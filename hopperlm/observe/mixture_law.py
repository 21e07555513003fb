"""How much of the old language to replay in continued pretraining: a law over (parameters N, replay share r)
fitted on the proxy runs of `hopperlm sweep --mixture`, the big run's two losses predicted from it with intervals,
and the ratio that minimises the new language's loss with the old one's rise over its base at most a limit.

Every proxy trains the new language for as many epochs as the big run would at that ratio (the sweep sets its
steps), so the data term of D-CPT (Que et al. 2024) is the same for all of them and the law has two variables:

    target   L_t(N, r) = E + A n^-alpha + C n^-delta ((1 - r)^-gamma - 1)
    replay   rise(N, r) = L_r(N, r) / L_r0(N) - 1 = C n^-delta (r + eps)^-gamma + D
    base     L_r0(N) = a - b ln n,        n = N / (the widest proxy's parameters)

The new language's loss rises as its share 1 - r falls (D-CPT's domain term: a power of its data), the rise of
the replayed language's loss over each width's own base (L_r0, the base evaluated once per width) falls as a
power of the replayed share (D-CPT's C / (r + eps)^gamma, finite at r = 0), and both ratio terms may shrink or
grow with size (n^-delta: CMR, Gu et al. 2024, found the share of new data a model tolerates growing with size).
The base's own loss is a line in ln N over the proxies' bases (three points: the line, not a law with a floor);
the replayed language's loss is L_r0 (1 + rise). Fitted by least squares on the mean over seeds of each (width,
ratio) cell, with L-BFGS in torch (positive numbers as logs, alpha in (0, 2), delta in (-1, 1)) from a few starts.

Intervals: the 5-95% range of the predictions refitted on bootstrap resamples of the seeds within each cell, each
side widened by the fit's RMS residual on the proxies (added in quadrature): the seeds' noise and the law's misfit.
The replayed language's loss is the base line's times (1 + rise): its interval is the rise's, each side then
widened by the base line's own RMS residual (added, not in quadrature).
The recommendation is made on the swept grid of ratios, from the central predictions.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from hopperlm.config import DataConfig
from hopperlm.errors import ConfigError

MIN_WIDTHS = 3
"""Widths the law needs: its size terms have three numbers (E, A, alpha), seen at three sizes."""
MIN_RATIOS = 3
"""Ratios the law needs: its ratio term has three numbers (C, gamma and eps or D)."""
BOOTSTRAP = 100
"""Bootstrap refits per law: enough for a 5-95% range to a few tenths of a percent of the loss."""
QUANTILES = (0.05, 0.95)
LAW_TEXT = {
    "target": "E + A n^-alpha + C n^-delta ((1 - r)^-gamma - 1)",
    "rise": "C n^-delta (r + eps)^-gamma + D",
    "base": "a - b ln n",
}


def _unpack(p: torch.Tensor) -> list[torch.Tensor]:
    """A law's parameters, one fit ([k]) or a batch of fits ([B, k]), each as a column that broadcasts over the
    cells; clamped where a number is exponentiated, so a wandering line search stays finite."""
    return [x.unsqueeze(-1).clamp(-40.0, 40.0) for x in p.unbind(-1)]


def _target(p: torch.Tensor, n: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    e, log_a, alpha, log_c, delta, log_gamma = _unpack(p)
    share = (1 - r) ** -log_gamma.exp() - 1
    return e + log_a.exp() * n ** -(2 * alpha.sigmoid()) + log_c.exp() * n ** -delta.tanh() * share


def _rise(p: torch.Tensor, n: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    log_c, delta, log_eps, log_gamma, d = _unpack(p)
    return log_c.exp() * n ** -delta.tanh() * (r + log_eps.exp()) ** -log_gamma.exp() + d


LAWS = {"target": _target, "rise": _rise}


def _starts(law: str, y: np.ndarray) -> list[list[float]]:
    spread = max(float(y.max() - y.min()), 1e-3)
    if law == "target":
        return [
            [float(y.min()) - k * spread, math.log(spread), a, math.log(spread / 2), 0.0, g]
            for k, a, g in ((0.5, -1.0, 0.0), (2.0, 0.0, -1.0), (0.2, 1.0, 1.0))
        ]
    return [
        [math.log(spread / 4), 0.0, math.log(eps), g, float(y.min())]
        for eps, g in ((0.05, math.log(0.5)), (0.01, math.log(0.3)), (0.2, 0.0))
    ]


def _fit(law: str, n: np.ndarray, r: np.ndarray, y: np.ndarray, start, iters: int):
    """Least squares of `law` to `y` ([cells], or [B, cells]: B independent fits at once, their errors summed)
    from `start` ([k] or [B, k]): (parameters, RMS residual of each fit)."""
    f = LAWS[law]
    nt, rt, yt = (torch.as_tensor(v, dtype=torch.float64) for v in (n, r, y))
    p = torch.tensor(np.asarray(start, dtype=np.float64), requires_grad=True)
    _minimise(lambda q: ((f(q, nt, rt) - yt) ** 2).mean(-1).sum(), p, iters)
    with torch.no_grad():
        mse = ((f(p, nt, rt) - yt) ** 2).mean(-1)
    return p.detach().numpy(), mse.sqrt().numpy()


def _minimise(objective, p: torch.Tensor, iters: int) -> None:
    """`p` moved to a minimum of `objective(p)` by L-BFGS with a strong-Wolfe line search."""
    opt = torch.optim.LBFGS([p], lr=1.0, max_iter=iters, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-12, tolerance_change=1e-15)  # fmt: skip

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = objective(p)
        loss.backward()
        return loss

    opt.step(closure)


def _eval(law: str, params, n: float, r: float) -> np.ndarray:
    """The law at (n, r) for one parameter set ([k]: a 1-element array) or many ([B, k])."""
    with torch.no_grad():
        p = torch.as_tensor(np.asarray(params, dtype=np.float64))
        out = LAWS[law](p, torch.tensor([n], dtype=torch.float64), torch.tensor([r], dtype=torch.float64))
        return out.reshape(-1).numpy()


def _interval(central: float, samples: list[float], rms: float) -> tuple[float, float]:
    """The bootstrap's 5-95% range around `central`, each side widened by `rms` in quadrature."""
    if samples:
        lo, hi = np.quantile(samples, QUANTILES)
    else:
        lo = hi = central
    return (
        central - math.hypot(max(central - float(lo), 0.0), rms),
        central + math.hypot(max(float(hi) - central, 0.0), rms),
    )


@dataclass
class Prediction:
    """Both losses of one (parameters, ratio), with their intervals; rise as a fraction (0.03 = 3%)."""

    ratio: float
    target_loss: float
    target_low: float
    target_high: float
    replay_rise: float
    rise_low: float
    rise_high: float
    replay_loss: float
    replay_low: float
    replay_high: float
    base_replay_loss: float


@dataclass
class MixtureForecast:
    """The fitted law (its parameters, bootstrap refits and residuals), what it was fitted on, and what it says
    at the big run's size: the predictions on the grid, the recommendation under `max_rise`."""

    replay: str
    """The replayed dataset's name (its folder's name: the key of its val loss)."""
    targets: dict[str, float]
    """The new language's datasets, each with its share of the new language's part of the mixture."""
    grid: list[float]
    target_params: int
    tokens: int
    """The big run's training tokens; every proxy trained as many, for the big run's epochs of the new language."""
    n_ref: int
    """The widest proxy's parameters: n = N / n_ref in the laws."""
    laws: dict[str, list[float]]
    boot: dict[str, list[list[float]]]
    rms: dict[str, float]
    base_line: list[float]
    """(a, b) of L_r0(N) = a - b ln n."""
    rows: list[dict]
    bases: list[dict]
    predictions: list[dict] = field(default_factory=list)
    max_rise: float | None = None
    recommended: float | None = None
    closest: dict | None = None
    """Where no grid ratio meets max_rise: {ratio, replay_rise} of the smallest predicted rise."""

    def base_loss(self, params: float) -> float:
        a, b = self.base_line
        return a - b * math.log(params / self.n_ref)

    def predict(self, params: float, ratio: float) -> Prediction:
        n = params / self.n_ref
        out = {}
        for law in ("target", "rise"):
            central = float(_eval(law, self.laws[law], n, ratio)[0])
            samples = list(_eval(law, self.boot[law], n, ratio)) if self.boot[law] else []
            out[law] = (central, *_interval(central, samples, self.rms[law]))
        base = self.base_loss(params)
        (t, t_lo, t_hi), (rise, r_lo, r_hi) = out["target"], out["rise"]
        spread = self.rms["base"]
        return Prediction(
            ratio=ratio, target_loss=t, target_low=t_lo, target_high=t_hi, replay_rise=rise, rise_low=r_lo,
            rise_high=r_hi, replay_loss=base * (1 + rise), replay_low=base * (1 + r_lo) - spread,
            replay_high=base * (1 + r_hi) + spread, base_replay_loss=base,
        )  # fmt: skip

    def recommend(self, max_rise: float | None) -> None:
        """The grid's predictions at the big run's size, and (with `max_rise`) the ratio with the lowest predicted
        new-language loss whose predicted rise is at most `max_rise`, else the closest one's ratio and rise."""
        preds = [self.predict(self.target_params, r) for r in self.grid]
        self.predictions = [asdict(p) for p in preds]
        self.max_rise, self.recommended, self.closest = max_rise, None, None
        if max_rise is None:
            return
        feasible = [p for p in preds if p.replay_rise <= max_rise]
        if feasible:
            self.recommended = min(feasible, key=lambda p: p.target_loss).ratio
        else:
            low = min(preds, key=lambda p: p.replay_rise)
            self.closest = {"ratio": low.ratio, "replay_rise": low.replay_rise}

    def line(self, ratio: float, *, params: int, tokens: int | None) -> str:
        """What the law predicts for a run at `ratio` of `params` parameters training `tokens` tokens."""
        p = self.predict(params, ratio)
        targets = "+".join(self.targets)
        line = (
            f"mixture forecast at {self.replay} {ratio:.3g}: {targets} {p.target_loss:.4f} ({p.target_low:.4f}-"
            f"{p.target_high:.4f}), {self.replay} {p.replay_loss:.4f} ({p.replay_low:.4f}-{p.replay_high:.4f}), "
            f"{p.replay_rise:+.1%} ({p.rise_low:+.1%} to {p.rise_high:+.1%}) over the base's {p.base_replay_loss:.4f}"
            f" (law of {len(self.rows)} runs of proxies of {min(b['params'] for b in self.bases):,}-{self.n_ref:,} "
            "parameters)"
        )
        if params != self.target_params:
            line += f"; made for {self.target_params:,} parameters, this model has {params:,}"
        if tokens is not None and tokens != self.tokens:
            line += f"; made for {self.tokens:,} tokens, this run trains {tokens:,} (the epochs differ)"
        return line

    def compare(self, ratio: float, val_losses: dict[str, float], *, params: int) -> str:
        """The prediction beside a run's own final evaluation: measured, predicted, interval, error."""
        p = self.predict(params, ratio)
        parts = []
        measured = target_loss(val_losses, self.targets)
        if measured is not None:
            parts.append(
                _against("+".join(self.targets), measured, p.target_loss, p.target_low, p.target_high)
            )
        if self.replay in val_losses:
            parts.append(
                _against(self.replay, val_losses[self.replay], p.replay_loss, p.replay_low, p.replay_high)
            )
        if not parts:
            return "mixture forecast: this run measured none of its datasets' losses"
        return "mixture forecast against this run: " + "; ".join(parts)

    def table(self) -> list[str]:
        """The predictions on the grid at the big run's size, the recommended ratio marked."""
        targets = "+".join(self.targets)[:20]
        lines = [
            f"predicted at {self.target_params:,} parameters and {self.tokens:,} tokens ({len(self.rows)} proxy "
            f"runs, proxies' parameters {min(b['params'] for b in self.bases):,}-{self.n_ref:,}):",
            f"{'ratio':>8}  {targets + ' loss':<26}{self.replay[:20] + ' loss':<26}rise over the base",
        ]
        for p in self.predictions:
            mark = "  <- recommended" if p["ratio"] == self.recommended else ""
            lines.append(
                f"{p['ratio']:>8.4g}  {p['target_loss']:.4f} ({p['target_low']:.4f}-{p['target_high']:.4f})     "
                f"{p['replay_loss']:.4f} ({p['replay_low']:.4f}-{p['replay_high']:.4f})     "
                f"{p['replay_rise']:+.2%} ({p['rise_low']:+.2%} to {p['rise_high']:+.2%}){mark}"
            )
        return lines

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")


def replay_ratio(data: DataConfig, replay: str) -> float | None:
    """The share of the dataset named `replay` in data.mixture (None where the run's data has no such dataset)."""
    mixture = data.mixture or ({data.path: 1.0} if data.path else {})
    weights = {Path(p).name: w for p, w in mixture.items()}
    if replay not in weights:
        return None
    return weights[replay] / sum(mixture.values())


def banner_line(data: DataConfig, *, params: int, tokens: int | None) -> str:
    """data.mixture_forecast's prediction for this run (its ratio, size and tokens), for the training banner; a
    lost or foreign file costs the line, never the run."""
    try:
        forecast = load(data.mixture_forecast)
    except ConfigError as e:
        return f"mixture forecast: none ({e})"
    ratio = replay_ratio(data, forecast.replay)
    if ratio is None:
        return f"mixture forecast: none (this run's data.mixture has no dataset {forecast.replay})"
    return forecast.line(ratio, params=params, tokens=tokens)


def end_line(data: DataConfig, val_losses: dict[str, float], *, params: int) -> str | None:
    """The prediction beside the run's own final evaluation (None where there is no forecast to read)."""
    try:
        forecast = load(data.mixture_forecast)
    except ConfigError:
        return None
    ratio = replay_ratio(data, forecast.replay)
    return None if ratio is None else forecast.compare(ratio, val_losses, params=params)


def _against(name: str, measured: float, predicted: float, low: float, high: float) -> str:
    inside = "inside" if low <= measured <= high else "outside"
    return (
        f"{name} measured {measured:.4f}, predicted {predicted:.4f} ({low:.4f}-{high:.4f}, {inside}; "
        f"{predicted / measured - 1:+.1%})"
    )


def target_loss(val_losses: dict[str, float], targets: dict[str, float]) -> float | None:
    """The new language's loss: its datasets' val losses weighted by their shares; None if one is missing."""
    if any(name not in val_losses for name in targets):
        return None
    return sum(val_losses[name] * share for name, share in targets.items()) / sum(targets.values())


def load(path: str | Path) -> MixtureForecast:
    """The forecast `hopperlm sweep --mixture` saved; ConfigError naming the file otherwise."""
    try:
        return MixtureForecast(**json.loads(Path(path).read_text()))
    except OSError as e:
        raise ConfigError(
            f"data.mixture_forecast {path}: {e.strerror}; rerun the sweep or remove the key"
        ) from None
    except (ValueError, TypeError) as e:
        raise ConfigError(
            f"data.mixture_forecast {path}: not a forecast written by `hopperlm sweep --mixture` ({e}); rerun the "
            "sweep or remove the key"
        ) from None


def _cells(rows: list[dict], key: str) -> dict[tuple[int, float], list[float]]:
    cells: dict[tuple[int, float], list[float]] = {}
    for row in rows:
        if row.get(key) is not None and math.isfinite(row[key]):
            cells.setdefault((row["params"], row["ratio"]), []).append(row[key])
    return cells


def _arrays(cells: dict, pick, n_ref: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    keys = sorted(cells)
    n = np.array([k[0] / n_ref for k in keys], dtype=np.float64)
    r = np.array([k[1] for k in keys], dtype=np.float64)
    return n, r, np.array([pick(cells[k]) for k in keys], dtype=np.float64)


def _fit_with_bootstrap(law: str, cells: dict, n_ref: int, rng: np.random.Generator, times: int):
    """(the law's parameters on the cells' means, those refitted on `times` bootstrap resamples of each cell's
    seeds, the RMS residual); ConfigError where no start fits."""
    n, r, y = _arrays(cells, statistics.fmean, n_ref)
    fits = [_fit(law, n, r, y, start, iters=500) for start in _starts(law, y)]
    fits = [(p, float(rms)) for p, rms in fits if np.isfinite(p).all() and math.isfinite(rms)]
    if not fits:
        raise ConfigError(
            f"mixture law: the {law} law did not fit the proxies' losses (non-finite at every start)"
        )
    params, rms = min(fits, key=lambda fit: fit[1])
    if times == 0 or all(len(v) == 1 for v in cells.values()):  # one seed per cell: no seeds to resample
        return params.tolist(), [], rms
    resampled = np.stack([_arrays(cells, lambda v: statistics.fmean(rng.choice(v, size=len(v))), n_ref)[2]
                          for _ in range(times)])  # fmt: skip
    boot, errors = _fit(law, n, r, resampled, np.tile(params, (times, 1)), iters=300)
    kept = np.isfinite(boot).all(axis=1) & np.isfinite(errors)
    return params.tolist(), boot[kept].tolist(), rms


def fit(
    rows: list[dict],
    bases: list[dict],
    *,
    replay: str,
    targets: dict[str, float],
    grid: list[float],
    target_params: int,
    tokens: int,
    max_rise: float | None = None,
    seed: int = 0,
    bootstrap: int = BOOTSTRAP,
) -> MixtureForecast:
    """The law fitted to the proxies' `rows` ({width, params, ratio, seed, target_loss, replay_rise, ...}) and
    their `bases` ({width, params, replay_loss}), with its predictions at `target_params` on `grid` and the
    recommendation under `max_rise`. ConfigError where the rows cannot determine it."""
    done = [r for r in rows if r.get("target_loss") is not None and r.get("replay_rise") is not None]
    widths = sorted({r["params"] for r in done})
    ratios = sorted({r["ratio"] for r in done})
    if len(widths) < MIN_WIDTHS or len(ratios) < MIN_RATIOS:
        raise ConfigError(
            f"mixture law: needs finished runs at {MIN_WIDTHS} or more widths and {MIN_RATIOS} or more ratios, got "
            f"{len(widths)} and {len(ratios)}; see each run's sweep.log"
        )
    if target_params <= widths[-1]:
        raise ConfigError(
            f"mixture law: the big run's {target_params:,} parameters are not beyond the widest proxy's "
            f"{widths[-1]:,}"
        )
    rng, n_ref = np.random.default_rng(seed), widths[-1]
    laws, boot, rms = {}, {}, {}
    for law, key in (("target", "target_loss"), ("rise", "replay_rise")):
        laws[law], boot[law], rms[law] = _fit_with_bootstrap(law, _cells(done, key), n_ref, rng, bootstrap)
    ln = np.log(np.array([b["params"] / n_ref for b in bases], dtype=np.float64))
    slope, intercept = np.polyfit(ln, np.array([b["replay_loss"] for b in bases], dtype=np.float64), 1)
    residual = intercept + slope * ln - np.array([b["replay_loss"] for b in bases])
    rms["base"] = float(np.sqrt(np.mean(residual**2)))
    forecast = MixtureForecast(
        replay=replay, targets=targets, grid=sorted(grid), target_params=target_params, tokens=tokens,
        n_ref=n_ref, laws=laws, boot=boot, rms=rms, base_line=[float(intercept), float(-slope)], rows=rows,
        bases=bases,
    )  # fmt: skip
    forecast.recommend(max_rise)
    return forecast
