"""Will this run reach its target? A forecast of the final validation loss, with an interval, from the losses
logged so far and the learning-rate schedule the run will follow to the end of its budget.

The law: a power law in the LR area plus the gain that annealing has realised so far,

    L(s) = L0 + A * S1(s)^(-alpha) - B * G(s)

S1 is the forward area (the sum of the LRs so far, normalised by the peak), as in Tissue et al. 2024 ("Scaling
Law with Learning Rate Annealing"). G is the annealing gain realised by step s, in the spirit of the multi-power
law (Luo et al. 2025): each LR drop d_k (at step k, to the LR eta_k) pays off as 1 - exp(-x), x the LR area
trained since the drop, scaled by eta_k^(-GAMMA) / (TAU * N). A drop pays off over LR area, not over steps: after
a fast decay at the end (WSD) the LR is low and its gain arrives slowly. G ends at most at the schedule's total
drop (1 - the floor's share), so B is the whole gain in loss units. For a fixed alpha the law is linear in
(L0, A, B), so a grid over alpha and a small non-negative least squares per alpha fit it without scipy.

Tissue et al.'s own annealing term (C * S2, S2 the LR drops with a momentum over steps) needed a C that differed
by schedule (on the CPU benchmark C*N: WSD 2.4-3.4, cosine 3.4-4.7); B as defined here does not (means 0.17-0.18
per schedule), so one prior serves every schedule.

A schedule whose decay has not begun (WSD in its stable phase, or a cosine early on) shows little or none of its
own annealing gain, so B is not identified by the run itself. The fit holds B to a prior (one pseudo-observation:
the run's own annealing overrides it once it shows): a default measured on the CPU benchmark
(bench/forecast_accuracy.py, whose results file says how well it does), or, asked for (`siblings=True`,
`hopperlm forecast --siblings`), one measured on the finished runs in the same folder (a sweep).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hopperlm.checkpoint.layout import latest_checkpoint, read_state
from hopperlm.config.training import checkpoint_budget, last_step_known_ahead
from hopperlm.errors import ConfigError
from hopperlm.schedule import budget_progress, counted_warmup_steps, lr_at

if TYPE_CHECKING:
    from hopperlm.config import ScheduleConfig, TrainConfig

MIN_POINTS = 4
"""Validation points after warm-up a forecast needs: three parameters and one to check them with."""
ALPHAS = np.geomspace(0.1, 1.5, 40)
"""The exponent's grid. Near 0 the power law turns into a logarithm with a negative L0, which a fit on the first
third of a run can extrapolate too far (benchmark, 28 runs, median error at 30 / 40 / 50 / 60% of the budget:
alpha >= 0.1 1.47 / 1.04 / 1.11 / 0.87%, alpha >= 0.02 1.98 / 1.32 / 1.06 / 0.81%)."""
TAU = 0.1
"""A drop at the peak LR is 63% paid off after 0.1 N steps at the peak (N the run's steps)."""
GAMMA = 2.0
"""How much faster a drop at a lower LR pays off per unit of LR area: eta^-2 (benchmark, tau x gamma grid
0.05-0.2 x 1-3: this pair makes B the same across schedules)."""
GRID = 2048
"""The gain is computed on at most this many blocks of steps and interpolated: a pairwise sum over drops, so
a million-step run costs the same as a 2,048-step one."""


@dataclass(frozen=True)
class Forecast:
    final_val_loss: float
    """Predicted validation loss at the end of the budget."""
    low: float
    """Lower end of the interval (calibrated to cover the final loss in >= 80% of the benchmark's runs)."""
    high: float
    """Upper end of the interval."""
    final_step: int
    """The step at which the budget is predicted to end."""
    at_step: int
    """The last step whose records the forecast used."""
    method: str
    """Where the prior on B came from: `prior` (the built-in default) or `siblings (N runs)` (finished runs in
    the same folder); the run's own annealing, once visible, outweighs either."""

    def line(self, target: float | None = None) -> str:
        """`forecast: 3.052 (3.021-3.094) at step 12000 (the budget's end); target 3.0781: likely` (likely: the
        whole interval is at or below the target; unlikely: all of it above; else possible)."""
        text = (
            f"forecast: {self.final_val_loss:.3f} ({self.low:.3f}-{self.high:.3f}) at step {self.final_step} "
            "(the budget's end)"
        )
        if target is None:
            return text
        if self.high <= target:
            verdict = "likely"
        elif self.low > target:
            verdict = "unlikely"
        else:
            verdict = "possible"
        return f"{text}; target {target:g}: {verdict}"

    def to_dict(self) -> dict:
        return asdict(self)


def planned_lrs(
    tc: TrainConfig,
    sc: ScheduleConfig,
    peak: float,
    *,
    steps_done: int,
    tokens_per_step: int,
    elapsed_s: float,
    schedule: TrainConfig | None = None,
) -> np.ndarray:
    """The LR of every optimizer step from 0 to the budget's predicted end, as the training loop will set it:
    steps end at max_steps, tokens at max_tokens / tokens_per_step, hours at max_hours at the mean step time
    so far (elapsed_s / steps_done); the first budget reached wins. `schedule`: the budget the LR schedule is
    laid over when it is not the run's (a resume with schedule.resume_horizon keep: the LR stays at its floor
    from the original budget's end to the run's)."""
    schedule = schedule or tc
    step_time = elapsed_s / steps_done if steps_done > 0 else None
    known = last_step_known_ahead(tc, tokens_per_step)
    ends = [known] if known is not None else []
    if tc.max_hours is not None and step_time:
        ends.append(math.ceil(tc.max_hours * 3600 / step_time))
    if not ends:
        raise ConfigError(
            "forecast: a wall-clock budget needs at least one finished step to time; "
            "wait for the first log step"
        )
    end = max(1, min(ends))
    warmup = counted_warmup_steps(sc)
    lrs = np.empty(end)
    for i in range(end):  # the loop computes the LR of step i before taking it, at elapsed ~ i * step_time
        progress = budget_progress(i, i * tokens_per_step, i * (step_time or 0.0), schedule, warmup)
        lrs[i] = lr_at(i, progress, sc, peak)
    return lrs


def lr_areas(lrs: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """(S1, G) after s steps, for s = 0..len(lrs): index s holds the areas of steps 0..s-1. LRs are normalised
    by the peak; warm-up rises are not annealing (only drops count). G: the annealing gain realised so far, in
    units of the normalised LR drop (see the module's docstring)."""
    eta = np.asarray(lrs, dtype=float)
    eta = eta / eta.max()
    n = len(eta)
    s1 = np.concatenate([[0.0], np.cumsum(eta)])
    drops = np.concatenate([[0.0], np.maximum(0.0, eta[:-1] - eta[1:])])  # drops[k]: before step k
    # blocks of m steps: a block's drops sit at its start and pay off at the LR its last step trains at
    m = max(1, math.ceil(n / GRID))
    starts = np.arange(0, n, m)
    block_drop = np.add.reduceat(drops, starts)
    block_eta = eta[np.minimum(starts + m, n) - 1]
    dropping = block_drop > 0  # a WSD schedule drops in its last fifth only
    starts, block_drop, block_eta = starts[dropping], block_drop[dropping], block_eta[dropping]
    rate = np.maximum(block_eta, 1e-3) ** -GAMMA / (TAU * n)
    at = np.append(np.arange(0, n, m), n)  # the gain is evaluated at each block boundary
    area = s1[at][:, None] - s1[starts][None, :]  # LR area trained since each block's drops, >= 0 when due
    paid = np.where(area > 0, 1.0 - np.exp(-np.maximum(area, 0.0) * rate), 0.0)
    gain_at = paid @ block_drop
    return s1, np.interp(np.arange(n + 1), at, gain_at)


@dataclass(frozen=True)
class Fit:
    alpha: float
    l0: float
    a: float
    b: float
    sse: float

    def predict(self, s1: np.ndarray, gain: np.ndarray) -> np.ndarray:
        return self.l0 + self.a * s1 ** (-self.alpha) - self.b * gain


def _nnls_small(x: np.ndarray, y: np.ndarray, free: int) -> tuple[np.ndarray, float]:
    """Least squares with columns `free:` non-negative: the unconstrained solution, else the best of the
    sub-problems with some of those columns at zero (there are at most 2, so 4 sub-problems)."""
    n_cols = x.shape[1]
    best, best_sse = None, math.inf
    constrained = list(range(free, n_cols))
    for mask in range(1 << len(constrained)):
        zero = {constrained[j] for j in range(len(constrained)) if mask >> j & 1}
        keep = [j for j in range(n_cols) if j not in zero]
        coef_k, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        coef = np.zeros(n_cols)
        coef[keep] = coef_k
        if any(coef[j] < 0 for j in constrained):
            continue
        sse = float(np.sum((x @ coef - y) ** 2))
        if sse < best_sse - 1e-15:
            best, best_sse = coef, sse
        if mask == 0 and best is not None:
            break  # the unconstrained solution is feasible: it is the optimum
    return best, best_sse


def fit_law(
    steps: np.ndarray,
    losses: np.ndarray,
    s1: np.ndarray,
    gain: np.ndarray,
    *,
    b_prior: tuple[float, float] | None = None,
    weights: np.ndarray | None = None,
    offsets: np.ndarray | None = None,
) -> list[Fit]:
    """One fit per alpha of the grid, best first. `b_prior` = (value, weight): B is pulled towards value by
    one pseudo-observation of that weight (1 / its sd, in the units of the weighted losses). `offsets` (0/1 per
    point) adds a column for a constant offset of those points (train loss vs val loss)."""
    w = np.ones(len(steps)) if weights is None else weights
    sw = np.sqrt(w)
    fits = []
    for alpha in ALPHAS:
        power = s1[steps] ** (-alpha)
        cols = [np.ones(len(steps))]
        if offsets is not None:
            cols.append(offsets)
        free = len(cols)
        cols += [power, -gain[steps]]
        x = np.stack(cols, axis=1) * sw[:, None]
        y = losses * sw
        if b_prior is not None:
            # one pseudo-observation B = prior with weight 1/sd (in units of the loss noise): the run's own
            # annealing overrides the prior once it shows, and a run that shows none falls back to it
            row = np.zeros(x.shape[1])
            row[-1] = b_prior[1]
            x, y = np.vstack([x, row]), np.append(y, b_prior[0] * b_prior[1])
        coef, sse = _nnls_small(x, y, free)
        if coef is None:
            continue
        a = coef[free]
        fits.append(Fit(float(alpha), float(coef[0]), float(a), float(coef[free + 1]), sse))
    return sorted(fits, key=lambda f: f.sse)


@dataclass(frozen=True)
class AnnealingPrior:
    """What the run cannot show itself before its decay: B, the loss its whole annealing gains, with its
    relative spread."""

    gain: float
    spread: float
    source: str


# Measured on bench/forecast_accuracy.py's CPU runs (whole-curve fits, B free): on the 20 of the tuned and
# held-out sets median B 0.172 (means per schedule: 0.171 WSD, 0.181 cosine, 0.182 linear); on the 8 fresh runs
# trained after this was set, median 0.169; the spread (sd / mean) over all 28 is 20%
DEFAULT_PRIOR = AnnealingPrior(gain=0.17, spread=0.2, source="prior")
SKIP_FRACTION = 0.05
"""Points in the first 5% of the budget (and in warm-up) are left out: a transient the law does not model
(benchmark, 28 runs, median error at 30%: 3% skipped 2.78%, 5% 1.47%, 8% 2.05%, 10% 2.18%, 15% 2.56%)."""
NOISE = 0.01
"""Relative noise of one validation loss: how strongly the B prior pulls against the data (benchmark, 28 runs,
median error at 30 / 50%: 0.005 1.53 / 1.12%, 0.01 1.47 / 1.11%, 0.02 1.64 / 1.01%)."""
TRAIN_WEIGHT = 0.0
"""Weight of train-loss points against val points (with a fitted train-val offset). None helped on the
benchmark (28 runs, median error at 30%: 0 1.47%, 0.05 1.67%, 0.2 1.67%, 1 1.87%), so they are left out."""
Z = 1.8  # half-width in units of the combined spread: set on the benchmark's 28 runs for >= 80% coverage at 30%
FLOOR = 0.01


def forecast_curve(
    points: Sequence[tuple[int, float]],
    lrs: Sequence[float],
    *,
    at_step: int,
    train_points: Sequence[tuple[int, float]] = (),
    prior: AnnealingPrior = DEFAULT_PRIOR,
) -> Forecast | None:
    """Fit the law to the validation points (step, val_loss) up to `at_step` and predict the loss after the
    last of `lrs` (the LR of every step to the budget's end). Needs MIN_POINTS (4) validation points past
    warm-up and the first SKIP_FRACTION of the budget, else returns None. `train_points` (step, mean train
    loss) count with TRAIN_WEIGHT and a fitted offset from val."""
    lrs = np.asarray(lrs, dtype=float)
    end = len(lrs)
    skip = max(int(np.argmax(lrs)) + 1, int(SKIP_FRACTION * end))
    val = [(s, v) for s, v in points if skip < s <= min(at_step, end) and math.isfinite(v)]
    if len(val) < MIN_POINTS:
        return None
    train = [(s, v) for s, v in train_points if skip < s <= min(at_step, end) and math.isfinite(v)]
    s1, gain = lr_areas(lrs)
    level = float(np.mean([v for _, v in val]))

    def fit(cut: int) -> Fit | None:
        v = [(s, x) for s, x in val if s <= cut]
        t = [(s, x) for s, x in train if s <= cut] if TRAIN_WEIGHT > 0 else []
        steps = np.array([s for s, _ in v + t], dtype=int)
        losses = np.array([x for _, x in v + t])
        weights = np.concatenate([np.ones(len(v)), np.full(len(t), TRAIN_WEIGHT)])
        offsets = np.concatenate([np.zeros(len(v)), np.ones(len(t))]) if t else None
        b_weight = NOISE * level / (prior.spread * prior.gain)
        b_prior = (prior.gain, b_weight)
        fits = fit_law(steps, losses, s1, gain, b_prior=b_prior, weights=weights, offsets=offsets)
        return fits[0] if fits else None

    best = fit(at_step)
    if best is None:
        return None
    predicted = float(best.predict(s1[end], gain[end]))
    last = val[-1][0]
    # the spread of the prediction, three parts added in quadrature: (1) the annealing gain still to come,
    # as uncertain as the prior on B; (2) a backtest: the fit on the first two thirds of the points misses the
    # last one by some amount, half of which is carried per unit of log-S1 horizon (the law extrapolates in
    # log S1); (3) a 1% floor (the val noise and the law's own misfit)
    gain_sd = prior.spread * best.b * (gain[end] - gain[last])
    cut = val[max(MIN_POINTS, (2 * len(val)) // 3) - 1][0]
    backtest = 0.0
    early = fit(cut) if cut < last else None
    if early is not None:
        miss = abs(float(early.predict(s1[last : last + 1], gain[last : last + 1])[0]) - val[-1][1])
        horizon = math.log(s1[end] / s1[last]) / max(1e-9, math.log(s1[last] / s1[cut]))
        backtest = 0.5 * miss * horizon
    half = Z * math.sqrt(gain_sd**2 + backtest**2 + (FLOOR * predicted) ** 2)
    return Forecast(
        final_val_loss=predicted,
        low=predicted - half,
        high=predicted + half,
        final_step=end,
        at_step=int(at_step),
        method=prior.source,
    )


def read_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl of a run that may still be writing it (a torn last line is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"forecast: {path} not found; pass a run directory that has started training")
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return [r for r in records if "step" in r and "loss" in r]


def read_run_config(run_dir: Path):
    from hopperlm.config import load_config

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"forecast: {path} not found; pass a run directory written by `hopperlm train`")
    return load_config(
        path
    )  # (a run saved by an earlier hopperlm: its moved keys moved, config/moved_keys.py)


def run_target(run_dir: Path) -> float | None:
    """The run's train.target_loss, if it has one."""
    return read_run_config(run_dir).train.target_loss


def _budget_fraction(record: dict, tc) -> float:
    """How much of its budget the run had used at this record (by the budget that ends first), counted from
    step 0 (the loop's own progress counts a step budget from the end of warm-up)."""
    return budget_progress(record["step"], record.get("tokens", 0), record.get("elapsed_s", 0.0), tc)


def run_schedule(cfg, records: list[dict], run_dir: Path) -> np.ndarray:
    """The LR of every step of a run to its budget's end, at the tokens per step and speed its records show."""
    last = records[-1]
    tokens_per_step = max(1, round(last.get("tokens", 0) / max(1, last["step"])))
    return planned_lrs(
        cfg.train,
        cfg.schedule,
        cfg.optim.lr,
        steps_done=last["step"],
        tokens_per_step=tokens_per_step,
        elapsed_s=last.get("elapsed_s", 0.0),
        schedule=kept_schedule(run_dir, cfg.train, cfg.schedule),
    )


def kept_schedule(run_dir: Path, tc: TrainConfig, sc: ScheduleConfig) -> TrainConfig | None:
    """The budget the LR schedule is laid over when a resume kept the original one (schedule.resume_horizon
    keep and a changed budget): its checkpoints' `schedule_budget`. None: the run's own budget (config.yaml)."""
    if sc.resume_horizon != "keep":
        return None
    ckpt = latest_checkpoint(run_dir)
    return checkpoint_budget(read_state(ckpt), tc) if ckpt is not None else None


def validation_points(records: list[dict]) -> list[tuple[int, float]]:
    """(step, val_loss) of the records that hold an evaluation."""
    return [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]


def sibling_prior(run_dir: Path) -> AnnealingPrior | None:
    """B measured on the finished runs beside this one (the same parent folder), fitted on their whole
    curves with B free: a sweep's runs share data and model family, so their annealing gain transfers better
    than the default. None when no sibling has finished a decaying schedule."""
    values = []
    for other in sorted(Path(run_dir).resolve().parent.iterdir()):
        if other == Path(run_dir).resolve() or not (other / "metrics.jsonl").is_file():
            continue
        try:
            cfg, records = read_run_config(other), read_records(other)
        except Exception:  # noqa: BLE001 (a sibling that is not a readable run is simply not one)
            continue
        if not records or cfg.schedule.name == "constant":
            continue
        lrs = run_schedule(cfg, records, other)
        if records[-1]["step"] < 0.98 * len(lrs):
            continue  # not finished: its annealing is not all there
        b = full_fit_gain(validation_points(records), lrs)
        if b is not None:
            values.append(b)
    if not values:
        return None
    median = float(np.median(values))
    spread = float(np.std(values) / median) if len(values) >= 3 else DEFAULT_PRIOR.spread
    return AnnealingPrior(median, max(0.1, spread), f"siblings ({len(values)} runs)")


def full_fit_gain(points: list[tuple[int, float]], lrs: np.ndarray) -> float | None:
    """B fitted, free, on a whole run's validation points (a finished run's annealing is all there)."""
    end = len(lrs)
    skip = max(int(np.argmax(lrs)) + 1, int(SKIP_FRACTION * end))
    val = [(s, v) for s, v in points if skip < s <= end]
    if len(val) < 2 * MIN_POINTS:
        return None
    s1, gain = lr_areas(lrs)
    fits = fit_law(np.array([s for s, _ in val]), np.array([v for _, v in val]), s1, gain)
    return fits[0].b if fits and fits[0].b > 0 else None


def forecast_run(run_dir: Path, *, using: float | None = None, siblings: bool = False) -> Forecast:
    """Forecast RUN_DIR's final validation loss from its metrics.jsonl and config.yaml: from every record, or
    with `using` from those within the first `using` fraction of its budget (steps, tokens or wall-clock,
    whichever the run's budget is). The B prior is DEFAULT_PRIOR, or with `siblings` the finished runs in the
    same folder when there are some.
    Raises ConfigError when there is too little to fit."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"forecast: run directory {run_dir} not found")
    if using is not None and not 0.0 < using <= 1.0:
        raise ConfigError(f"forecast: --using {using} must be a fraction in (0, 1]")
    records, cfg = read_records(run_dir), read_run_config(run_dir)  # no metrics: the likelier mistake
    if using is not None:
        records = [r for r in records if _budget_fraction(r, cfg.train) <= using + 1e-9]
    if not records:
        raise ConfigError(
            f"forecast: {run_dir}/metrics.jsonl has no records yet (within --using); wait for a log step"
        )
    lrs = run_schedule(cfg, records, run_dir)
    prior = (sibling_prior(run_dir) if siblings else None) or DEFAULT_PRIOR
    train = [(r["step"], r["loss"]) for r in records]
    at_step = records[-1]["step"]
    forecast = forecast_curve(
        validation_points(records), lrs, at_step=at_step, train_points=train, prior=prior
    )
    if forecast is None:
        have = len([p for p in validation_points(records)])
        raise ConfigError(
            f"forecast: {run_dir} has {have} validation losses by step {at_step}; the fit needs {MIN_POINTS} "
            f"after warm-up and the first {SKIP_FRACTION:.0%} of the budget (evaluate more often: lower "
            "train.eval_every, or forecast later)"
        )
    return forecast
