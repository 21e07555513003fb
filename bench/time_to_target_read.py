"""How bench/time_to_target.py reads its race: each recipe's best LR and mean final loss as `hopperlm sweep`
chooses them (train/sweep.py), whether that LR sits at its grid's edge, and hopperlm's time to the best tuned
baseline's loss over its budgets."""

from __future__ import annotations

import math
import statistics

from harness import at_grid_edge


def mean_loss(rows: list[dict]) -> float:
    """The mean final loss over seeds, as the sweep reads it (a failed or diverged seed makes it infinite)."""
    from hopperlm.train.sweep import seed_mean

    return seed_mean([r["final_val_loss"] for r in rows])


def best_of(rows: list[dict], recipe: str) -> tuple[float, float]:
    """(the recipe's best LR, its mean final loss over seeds) among the rows of its LR sweep, chosen as
    `hopperlm sweep` chooses (train/sweep.py's best_lr)."""
    from hopperlm.train.sweep import SweepRun, best_lr

    runs = [SweepRun(r["lr"], r["seed"], "", r["final_val_loss"]) for r in rows
            if r["recipe"] == recipe and r.get("budget_share", 1.0) == 1.0]  # fmt: skip
    best, means = best_lr(runs)
    lr = best if best is not None else min(means)  # every LR failed: its loss is infinite, said as such
    return lr, means[lr]


def at_edge(rows: list[dict], recipe: str) -> bool:
    """Whether the recipe's best LR is the smallest or largest of its sweep: the true best may lie beyond."""
    grid = {r["lr"] for r in rows if r["recipe"] == recipe and r.get("budget_share", 1.0) == 1.0}
    return at_grid_edge(grid, best_of(rows, recipe)[0])


def time_to_target(rows: list[dict], recipe: str = "hopperlm") -> dict:
    """The target is the best tuned baseline's final loss (mean over seeds at its best LR); hopperlm's time to
    it is the shortest budget whose finished runs (mean over seeds, at hopperlm's best LR) end at or below it,
    and, between the budgets tried, the log-linear interpolation of the mean final loss against the seconds.
    Seconds are each row's steps at its recipe's probed seconds per step. The earliest point of the full-budget
    runs' curves that reaches the target is reported beside it: it is the middle of a longer schedule, not a
    finished run, so it is not the claim."""
    baselines = sorted({r["recipe"] for r in rows if r["role"] == "baseline"})
    tuned = {name: best_of(rows, name) for name in baselines}
    best = min(tuned, key=lambda name: tuned[name][1])
    target = tuned[best][1]
    baseline_rows = [r for r in rows if r["recipe"] == best and r["lr"] == tuned[best][0]]
    baseline_s = statistics.fmean(r["seconds"] for r in baseline_rows)
    lr = best_of(rows, recipe)[0]
    mine = [r for r in rows if r["recipe"] == recipe and r["lr"] == lr]
    budgets = []  # (mean seconds, mean final loss) per budget share, shortest first
    for share in sorted({r.get("budget_share", 1.0) for r in mine}):
        runs = [r for r in mine if r.get("budget_share", 1.0) == share]
        budgets.append((statistics.fmean(r["seconds"] for r in runs), mean_loss(runs), share))
    reached = next((i for i, (_, loss, _) in enumerate(budgets) if loss <= target), None)
    seconds = interpolated = None
    if reached is not None:
        seconds = interpolated = budgets[reached][0]  # reached at the shortest budget tried: at most this
        if reached > 0:
            (t0, a, _), (t1, b, _) = (
                budgets[reached - 1],
                budgets[reached],
            )  # a above the target, b at or below
            x = (a - target) / (a - b)
            interpolated = math.exp(math.log(t0) + x * (math.log(t1) - math.log(t0)))
    full = [r for r in mine if r.get("budget_share", 1.0) == 1.0]
    mid = [min((s for _, s, v in r["curve"] if v <= target), default=None) for r in full]
    return {
        "recipe": recipe,
        "best_baseline": best,
        "best_baseline_lr": tuned[best][0],
        "tuned_baselines": {
            name: {"lr": v[0], "mean_final_val_loss": round(v[1], 4), "at_grid_edge": at_edge(rows, name)}
            for name, v in tuned.items()
        },  # fmt: skip
        "lr_at_grid_edge": at_edge(rows, recipe),
        "target_val_loss": round(target, 4),
        "baseline_s": round(baseline_s, 1),
        "lr": lr,
        "budgets": [
            {"budget_share": f, "seconds": round(t, 1), "mean_final_val_loss": round(v, 4)}
            for t, v, f in budgets
        ],  # fmt: skip
        "hopperlm_s": None if seconds is None else round(seconds, 1),
        "ratio_reached": None if seconds is None else round(seconds / baseline_s, 3),
        "ratio_interpolated": None if interpolated is None else round(interpolated / baseline_s, 3),
        "curve_ratio_full_run": None if None in mid else round(max(mid) / baseline_s, 3),
        "params": mine[0]["params"],
        "baseline_params": baseline_rows[0]["params"],
        "met": seconds is not None and seconds <= 0.67 * baseline_s,
    }
