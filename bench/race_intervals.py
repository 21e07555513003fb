"""Time-to-target ratios with their uncertainty: a bootstrap over seeds that re-selects each recipe's best LR.

A race's ratio (hopperlm's FLOPs to reach the tuned baseline's final loss, over the baseline's FLOPs:
race_3tpp.py's `flops_to_target`) rests on a handful of seeds, and on two choices made from them: the
baseline's best LR (which sets the target) and hopperlm's. One draw resamples the seeds with replacement and
computes the ratio anew, both LRs re-chosen on the draw. Two ways, both reported:
  paired       the same seeds for every recipe, LR and budget (seed i is one data order everywhere, so the
               noise the recipes share cancels, as in the race's own paired rule);
  independent  each recipe's seeds drawn on their own (its LRs and budgets still share them): wider, and the
               one a claim is held to.
With `exact`, and at most EXACT_LIMIT resamplings, every resampling is taken once instead of random draws
(4 seeds: 256 paired, 65,536 independent for two recipes): the exact bootstrap distribution, with no draw noise.
The interval is the draws' 5th to 95th percentile. A draw in which hopperlm's budgets never reach the target counts as an infinite ratio,
so an interval whose upper end is infinite says the target was missed in more than 5% of the draws.

A claim "at most X x" is made only where the interval's upper end is at most X (`at_most`).

    python3 bench/race_intervals.py RESULTS.json [--draws 2000] [--save OUT.json]

recomputes the intervals of a finished race's results file (its rows and its time_to_target blocks).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
from collections.abc import Callable
from pathlib import Path

from harness import bench_command, save_result

LEVEL = 0.9  # the interval's coverage
DRAWS = 2000
EXACT_LIMIT = 100_000  # resamplings enumerated whole under `exact` (4 seeds, two recipes: 65,536)


def resampled(rows: list[dict], picks_of: Callable[[str], list[int]]) -> list[dict]:
    """The rows of one draw: in each (recipe, LR, budget) cell, the rows of the seeds picked for its recipe (a seed
    picked twice counts twice)."""
    cells: dict[tuple, dict[int, dict]] = {}
    for r in rows:
        cells.setdefault((r["recipe"], r["lr"], r["budget_share"]), {})[r["seed"]] = r
    out = []
    for (recipe, _, _), by_seed in cells.items():
        out += [by_seed[s] for s in picks_of(recipe) if s in by_seed]
    return out


def percentile(values: list[float], q: float) -> float:
    """The q-quantile by linear interpolation between order statistics (numpy's default); inf stays inf."""
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low, high = math.floor(at), math.ceil(at)
    if math.isinf(ordered[high]):
        return math.inf if at > low or math.isinf(ordered[low]) else ordered[low]
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def seed_picks(seeds: list[int], recipes: list[str], *, paired: bool, draws: int | None, rng_seed: int = 0):
    """Each resampling as {recipe: the seeds picked for it}: `draws` random ones, or (draws None) every one."""
    if draws is None:
        one = [list(c) for c in itertools.product(seeds, repeat=len(seeds))]
        if paired:
            yield from (dict.fromkeys(recipes, c) for c in one)
        else:
            yield from (
                dict(zip(recipes, cs, strict=True)) for cs in itertools.product(one, repeat=len(recipes))
            )
        return
    rng = random.Random(rng_seed)
    for _ in range(draws):
        if paired:
            yield dict.fromkeys(recipes, [rng.choice(seeds) for _ in seeds])
        else:
            yield {recipe: [rng.choice(seeds) for _ in seeds] for recipe in recipes}


def seed_bootstrap(
    rows: list[dict],
    ratio_of: Callable[[list[dict]], dict],
    *,
    draws: int = DRAWS,
    level: float = LEVEL,
    paired: bool = True,
    rng_seed: int = 0,
    exact: bool = False,
) -> dict:
    """The intervals of `ratio_of(rows)`'s `ratio_reached` and `ratio_interpolated` (flops_to_target's) over
    `draws` resamplings of the seeds (`paired`: one draw for every recipe; else one per recipe), or over every
    resampling (`exact`, where there are at most EXACT_LIMIT); each draw's ratio recomputed whole, so each
    recipe's best LR is re-chosen."""
    seeds = sorted({r["seed"] for r in rows})
    recipes = sorted({r["recipe"] for r in rows})
    enumerated = exact and len(seeds) ** (len(seeds) * (1 if paired else len(recipes))) <= EXACT_LIMIT
    got: dict[str, list[float]] = {"reached": [], "interpolated": []}
    for picks in seed_picks(
        seeds, recipes, paired=paired, draws=None if enumerated else draws, rng_seed=rng_seed
    ):
        ratio = ratio_of(resampled(rows, picks.__getitem__))
        for kind in got:
            value = ratio[f"ratio_{kind}"]
            got[kind].append(math.inf if value is None else value)
    tail = (1 - level) / 2
    draws = len(got["reached"])
    out = {"draws": draws, "level": level, "seeds": seeds, "paired": paired, "exact": enumerated}
    for kind, values in got.items():
        low, high = percentile(values, tail), percentile(values, 1 - tail)
        out[f"interval_{kind}"] = [round(low, 3), None if math.isinf(high) else round(high, 3)]
        out[f"missed_share_{kind}"] = round(sum(math.isinf(v) for v in values) / draws, 4)
    return out


def at_most(interval: list[float | None], bars: tuple[float, ...] = (0.25, 0.33, 0.5, 0.67, 0.8, 1.0, 1.1)):
    """The smallest bar X that the interval's upper end stays under (None: none of them, or no upper end)."""
    high = interval[1]
    return next((x for x in bars if high is not None and high <= x), None)


def intervals_of(
    result: dict,
    flops_to_target: Callable[[list[dict], str, str], dict],
    *,
    draws: int = DRAWS,
    exact: bool = False,
):
    """Each time_to_target block of a race's results file with its bootstrap intervals (`flops_to_target`:
    race_3tpp.py's, which the race's ratios came from)."""
    out = {}
    for baseline, block in result["time_to_target"].items():
        mine = block["hopperlm_recipe"]

        def ratio_of(rows, mine=mine, baseline=baseline):
            return flops_to_target(rows, mine, baseline)

        rows = [r for r in result["rows"] if r["recipe"] in (mine, baseline)]
        paired = seed_bootstrap(rows, ratio_of, draws=draws, paired=True, exact=exact)
        independent = seed_bootstrap(rows, ratio_of, draws=draws, paired=False, exact=exact)
        out[baseline] = {
            "hopperlm_recipe": mine,
            "ratio_reached": block["ratio_reached"],
            "ratio_interpolated": block["ratio_interpolated"],
            "paired": paired,
            "independent": independent,
            # the claim: held to the wider (independent) interval
            "at_most_reached": at_most(independent["interval_reached"]),
            "at_most_interpolated": at_most(independent["interval_interpolated"]),
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", help="a race's results file (bench/race_3tpp.py --save)")
    p.add_argument("--draws", type=int, default=DRAWS, help=f"bootstrap draws (default: {DRAWS})")
    p.add_argument("--save", help="write the intervals as JSON here")
    args = p.parse_args(argv)
    from race_3tpp import (
        flops_to_target,  # (race_3tpp calls intervals_of itself: imported here, not at the top)
    )

    result = json.loads(Path(args.results).read_text())
    record = {
        "command": bench_command("race_intervals.py", argv),
        "results": args.results,
        "results_plan_commit": result.get("plan_commit"),
        "time_to_target": intervals_of(result, flops_to_target, draws=args.draws),
    }
    for baseline, block in record["time_to_target"].items():
        for kind in ("reached", "interpolated"):
            for how in ("paired", "independent"):
                boot = block[how]
                low, high = boot[f"interval_{kind}"]
                shown = f"[{low}, {'not reached' if high is None else high}]"
                print(f"vs {baseline}: {kind} {block[f'ratio_{kind}']}x, {how} 90% interval {shown}, target "
                      f"missed in {boot[f'missed_share_{kind}']:.1%} of draws")  # fmt: skip
            print(f"vs {baseline}: {kind}: at most {block[f'at_most_{kind}']}x")
    if args.save:
        save_result(record, args.save)
    return record


if __name__ == "__main__":
    main()
