"""Does scaling collapse forecast a run's final loss from its first 30% and its μP proxies' curves? A
pre-registered CPU benchmark (issue 50): PLAN below was committed before any of its runs trained.

For each corpus and schedule: μP proxies at four widths and a big run twice as wide as the widest, every run at
the same tokens per parameter and schedule shape, two seeds each. Then, for each big run, three forecasts of its
final validation loss:
- collapse: `hopperlm forecast RUN --using U --proxies ...` (observe/collapse.py) at U = 10, 20, 30, 50%;
- law: today's in-run law (observe/forecast.py, `hopperlm forecast RUN --using U`) at the same U;
- proxies: the proxy-only forecast before the run (observe/width_forecast.py, `sweep --widths`).
Every forecast is a row {corpus, schedule, run, width, seed, method, using, forecast, low, high, final}; the
summary gives the median and max |error| per method and share, the interval's coverage, and the medians per
schedule. Goals: collapse at 30% median |error| <= 1% with coverage >= 80%; proxies median <= 2%.

    python3 bench/forecast_collapse.py --save bench/results/DATE-forecast-collapse-cpu.json   (~40 min, 2 cores)
    python3 bench/forecast_collapse.py --smoke                                                 (CI: seconds)
    python3 bench/forecast_collapse.py --pilot --variant collapse-width --save bench/results/DATE-forecast-collapse-pilot-cpu.json
                                                              (PILOT below: 20 runs, 26 min on 2 cores)
    python3 bench/forecast_collapse.py --confirm --variant collapse-width --save bench/results/DATE-forecast-collapse-confirm-cpu.json
                                                              (CONFIRM below: 40 runs, ~55 min on 2 cores)

Runs train in worker processes (one thread each), into --work/runs/...; a run whose result.json exists is not
trained again, so a killed benchmark continues where it stopped.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from harness import (
    DATA,
    bench_command,
    done,
    mark_done,
    prepare_data,
    save_result,
    schedule_section,
    start_run,
    train_here,
)
from harness import run_config as yaml_of

# ---- pre-registered (2026-11-27, before the first run): change it only with a new results file -------------
PLAN = {
    "corpora": {
        "shakespeare": "tinyshakespeare/input.txt",
        "wikitext": "wikitext-2/wiki.valid.tokens",
        "gutenberg": "gutenberg/pg00158_Emma.txt",
    },
    "tokenizer": "bytes",
    "schedules": {
        "cosine": {"schedule": "cosine", "min_lr_ratio": 0.1},
        "wsd": {"schedule": "wsd", "decay_fraction": 0.2, "min_lr_ratio": 0.0},
    },
    "proxy_widths": [24, 32, 48, 64],
    "big_width": 128,
    "seeds": [1, 2],
    "n_layers": 2,
    "head_dim": 8,
    "base_dim": 32,
    "seq_len": 64,
    "micro_batch": 16,
    "tokens_per_param": 4.0,
    "optimizer": {"name": "adamw", "lr": 4e-3, "weight_decay": 0.0},
    "warmup_fraction": 0.02,
    "evaluations": 80,
    "eval_windows": 64,
    "usings": [0.1, 0.2, 0.3, 0.5],
    "collapse_z": 1.5,
}
# ---- pre-registered second (2026-11-27, after the first result, before this method's first forecast) -------
# One variant, on the same 60 runs (`--variant collapse-width --work` the first run's folder: nothing retrains).
VARIANT = {
    "method": "collapse-width",
    "what": "the proxies' normalised curves not averaged over widths but extrapolated: at each fraction of the "
    "budget a line through the widths' curves against log(parameters), read at the run's parameters "
    "(observe/collapse.py shape(at_params)); the interval built as collapse's, its backtest and leave-one-out "
    "extrapolating too",
    "why": "collapse missed by +5.5..+8.6% where it missed (Shakespeare, WikiText): the width-128 runs gain more "
    "after their first 30% than the narrower proxies' normalised curves, so the curves drift with size instead "
    "of collapsing; a drift that is smooth in log(parameters) is carried to the big run's size",
    "decision": "collapse-width replaces collapse as the method of `forecast --proxies` and train.forecast_from if "
    "its median |error| at 30% is below collapse's on the same rows; it replaces the in-run law as the default "
    "forecast only if its median |error| at 30% is below the law's and its coverage at 30% is >= 80%",
}
# ---- pre-registered pilot (2026-11-27 night, before any of its runs trained) ----------------------------------
# Qiu et al. find the collapse in compute-optimally trained models (about 20 tokens per parameter); PLAN trained at
# 4, and at 20 its width-128 run needs 10.2M tokens: Tiny Shakespeare and WikiText-2's valid file (1.1 MB each)
# would be repeated about 9 times. Gutenberg alone holds enough text to see each byte once, so this pilot is one
# corpus, not the three: it says whether the collapse holds at compute-optimal budgets on these small
# models, and so whether the full set is worth larger corpora.
PILOT_BOOKS = 28  # Gutenberg's first 28 books by file name: 15.8 MB, 14.2M training bytes after the 10% tail
PILOT = {
    **PLAN,
    "corpora": {"gutenberg-28": [p.relative_to(DATA).as_posix() for p in
                                 sorted((DATA / "gutenberg").glob("pg*.txt"))[:PILOT_BOOKS]]},
    "tokens_per_param": 20.0,
}  # fmt: skip
PILOT_DECISION = {
    "what": "PLAN at 20 tokens per parameter on Gutenberg's first 28 books (no byte seen twice): both schedules, "
    "the same widths, seeds, learning rate and evaluations; collapse, collapse-width, the law and the proxy-only "
    "forecast on its rows",
    "decision": "a pilot: it changes no default (one corpus is not the issue's set). If collapse's median |error| "
    "at 30% is <= 1% here, the full set at 20 tokens per parameter is worth three corpora large enough for it; "
    "if it is no better than at 4 tokens per parameter, budget was not what broke the collapse on these models",
}


# ---- pre-registered confirmation (2026-11-27 night, after the pilot's result, before any of its runs trained) ------
# The pilot (bench/results/2026-11-27-forecast-collapse-pilot-cpu.json) at 30%: collapse-width 0.65% median |error|
# (coverage 100%), collapse 2.40%, the law 5.20%, proxies-only 4.66%, on 4 big runs of one book set. Confirmed on
# fresh text: the next Gutenberg books by file name, in two sets of at least 14 MB each (no byte seen twice).
def _book_sets(start: int, n_sets: int, min_bytes: float = 14e6) -> dict[str, list[str]]:
    books, sets = sorted((DATA / "gutenberg").glob("pg*.txt")), {}
    while len(sets) < n_sets and start < len(books):
        end, size = start, 0
        while end < len(books) and size < min_bytes:
            size, end = size + books[end].stat().st_size, end + 1
        sets[f"gutenberg-{start + 1}-{end}"] = [b.relative_to(DATA).as_posix() for b in books[start:end]]
        start = end
    return sets


CONFIRM = {**PILOT, "corpora": _book_sets(PILOT_BOOKS, 2)}  # books 29-46 (15.9 MB) and 47-59 (15.1 MB)
CONFIRM_DECISION = {
    "what": "the pilot's plan on two fresh book sets of Gutenberg (books 29-46 and 47-59 by file name), both "
    "schedules, 2 seeds: 8 big runs; collapse, collapse-width, the law and the proxy-only forecast on their rows",
    "decision": "collapse-width is confirmed for proxies trained at 20 tokens per parameter if, on these rows, its "
    "median |error| at 30% is <= 1% with coverage >= 80% and below the law's; then a later change makes it the "
    "method of `forecast --proxies` and train.forecast_from for such proxies (this run changes no code). Reported "
    "with the pilot's rows beside, never pooled into them; the first plan's rows (4 tokens per parameter) stand",
}
SMOKE = {**PLAN, "corpora": {"shakespeare": "tinyshakespeare/input.txt"}, "schedules": {"wsd": PLAN["schedules"]["wsd"]},
         "proxy_widths": [16, 24, 32], "big_width": 48, "seeds": [1], "tokens_per_param": 2.0, "micro_batch": 4,
         "evaluations": 40, "eval_windows": 8, "usings": [0.3, 0.5]}  # fmt: skip


def prepare(work: Path, name: str, source: str | list[str]) -> Path:
    """The corpus (a file, or a list of files) as bytes (once per --work)."""
    sources = [DATA / source] if isinstance(source, str) else [DATA / s for s in source]
    return prepare_data(work / "data" / name, sources)


def run_config(plan: dict, data: Path, schedule: str, width: int, seed: int, out_dir: Path) -> dict:
    """The run's recipe: μP at base width PLAN.base_dim, trained PLAN.tokens_per_param tokens per parameter."""
    from hopperlm.config import config_from_dict
    from hopperlm.train.sweep import model_params

    model = {"dim": width, "n_layers": plan["n_layers"], "n_heads": width // plan["head_dim"],
             "max_seq_len": plan["seq_len"], "parametrization": "mup", "base_dim": plan["base_dim"]}  # fmt: skip
    tokens_per_step = plan["micro_batch"] * plan["seq_len"]

    def build(steps: int) -> dict:
        every = max(1, steps // plan["evaluations"])
        return yaml_of(
            model=model,
            data=data,
            optim=dict(plan["optimizer"]),
            schedule={
                **schedule_section(plan["schedules"][schedule]),
                "warmup_steps": max(1, round(plan["warmup_fraction"] * steps)),
            },  # fmt: skip
            train={
                "seq_len": plan["seq_len"],
                "micro_batch": plan["micro_batch"],
                "max_steps": steps,
                "seed": seed,
                "eval_every": every,
                "eval_windows": plan["eval_windows"],
                "log_every": every,
                "device": "cpu",
                "compile": False,
            },  # fmt: skip
            quiet=True,
            out_dir=out_dir,
        )

    cfg = config_from_dict(build(1))
    params = model_params(cfg.model, cfg.data)
    return build(max(10, round(plan["tokens_per_param"] * params / tokens_per_step)))


def train_one(spec: dict) -> str:
    """One run in a worker process (one thread); its folder. Skipped when it finished before."""
    out = Path(spec["run"]["out_dir"])
    if not done(out, spec):
        start_run(out)
        train_here(spec)
        mark_done(out, spec)
    return str(out)


def error_row(base: dict, method: str, using: float | None, forecast, low, high, final: float) -> dict:
    return {**base, "method": method, "using": using, "forecast": round(forecast, 5), "low": round(low, 5),
            "high": round(high, 5), "final": round(final, 5), "error": round(forecast / final - 1, 5),
            "covered": low <= final <= high}  # fmt: skip


def forecasts(
    plan: dict, corpus: str, schedule: str, proxies: list[Path], bigs: list[Path], variant: str | None = None
) -> list[dict]:
    """Every forecast of the big runs of one (corpus, schedule) group (and VARIANT's, with `variant`)."""
    from hopperlm.observe import collapse, width_forecast
    from hopperlm.observe.forecast import forecast_run

    curves = [collapse.curve_of_run(p, label=p.name) for p in proxies]
    points = [{"width": c.width, "params": c.params, "seed": c.seed, "final_val_loss": c.final_val_loss}
              for c in curves]  # fmt: skip
    rows = []
    for big in bigs:
        run = collapse.curve_of_run(big)
        base = {"corpus": corpus, "schedule": schedule, "run": big.name, "width": run.width, "seed": run.seed}
        final = run.final_val_loss
        before = width_forecast.forecast(
            points, target_params=run.params, tokens_per_param=run.tokens_per_param
        )
        rows.append(error_row(base, "proxies", None, before.final_val_loss, before.low, before.high, final))
        for using in plan["usings"]:
            got = collapse.collapse_forecast(run, curves, using=using)
            rows.append(error_row(base, "collapse", using, got.final_val_loss, got.low, got.high, final))
            if variant == "collapse-width":
                got = collapse.collapse_forecast(run, curves, using=using, extrapolate=True)
                rows.append(error_row(base, variant, using, got.final_val_loss, got.low, got.high, final))
            try:
                law = forecast_run(big, using=using)
                rows.append(error_row(base, "law", using, law.final_val_loss, law.low, law.high, final))
            except Exception as e:  # noqa: BLE001 (too few points early on: a row without a forecast)
                rows.append({**base, "method": "law", "using": using, "forecast": None, "low": None,
                             "high": None, "final": round(final, 5), "error": None, "note": str(e)})  # fmt: skip
    return rows


def summary(rows: list[dict]) -> dict:
    """Median and max |error|, coverage, per method and share; per schedule medians."""
    out = {}
    keys = sorted({(r["method"], r["using"]) for r in rows}, key=lambda k: (k[0], k[1] or 0))
    for method, using in keys:
        got = [r for r in rows if r["method"] == method and r["using"] == using and r["error"] is not None]
        if not got:
            continue
        name = f"{method}@{using:.0%}" if using is not None else method
        errors = [abs(r["error"]) for r in got]
        out[name] = {
            "n": len(got),
            "median_abs_error": round(statistics.median(errors), 5),
            "max_abs_error": round(max(errors), 5),
            "coverage": round(sum(r["covered"] for r in got) / len(got), 3),
            "median_by_schedule": {
                s: round(statistics.median(abs(r["error"]) for r in got if r["schedule"] == s), 5)
                for s in sorted({r["schedule"] for r in got})
            },
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default="/tmp/forecast-collapse", help="prepared data and runs")
    p.add_argument(
        "--smoke", action="store_true", help="one corpus, one schedule, tiny runs: checks the script"
    )
    p.add_argument(
        "--pilot",
        action="store_true",
        help="the pre-registered pilot instead: PLAN at 20 tokens per parameter on Gutenberg alone",
    )
    p.add_argument(
        "--confirm",
        action="store_true",
        help="the pre-registered confirmation: the pilot's plan on two fresh Gutenberg book sets",
    )
    p.add_argument("--jobs", type=int, default=2, help="runs side by side (one thread each)")
    p.add_argument("--save", help="write the result as JSON here")
    p.add_argument(
        "--variant",
        choices=[VARIANT["method"]],
        help="also forecast by the pre-registered VARIANT (point --work at the first run's folder: no run retrains)",
    )
    args = p.parse_args(argv)
    if args.pilot and args.confirm:
        p.error("--pilot and --confirm are two plans: give one")
    plan = SMOKE if args.smoke else PILOT if args.pilot else CONFIRM if args.confirm else PLAN
    folder = "pilot" if args.pilot else "confirm" if args.confirm else "full"
    work = Path(args.work).resolve() / ("smoke" if args.smoke else folder)
    start = time.perf_counter()
    specs, groups = [], []
    for corpus, source in plan["corpora"].items():
        data = prepare(work, corpus, source)
        for schedule in plan["schedules"]:
            folder = work / "runs" / corpus / schedule
            proxies = [folder / f"width-{w}-seed-{s}" for w in plan["proxy_widths"] for s in plan["seeds"]]
            bigs = [folder / f"big-{plan['big_width']}-seed-{s}" for s in plan["seeds"]]
            for path in proxies + bigs:
                width, seed = int(path.name.split("-")[-3]), int(path.name.split("-")[-1])
                specs.append(run_config(plan, data, schedule, width, seed, path))
            groups.append((corpus, schedule, proxies, bigs))
    print(f"forecast-collapse: {len(specs)} runs, {args.jobs} at a time -> {work}/runs", flush=True)
    specs.sort(key=lambda s: -s["model"]["dim"])  # the widest first: the pool ends on short runs
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for k, done in enumerate(pool.map(train_one, specs), 1):
            print(f"  {k}/{len(specs)} {Path(done).relative_to(work)}", flush=True)
    rows = [
        r
        for corpus, schedule, proxies, bigs in groups
        for r in forecasts(plan, corpus, schedule, proxies, bigs, args.variant)
    ]
    result = {
        "command": bench_command("forecast_collapse.py", argv),
        "smoke": args.smoke,
        "plan": plan,
        **({"variant": VARIANT} if args.variant else {}),
        **({"pilot": PILOT_DECISION} if args.pilot and not args.smoke else {}),
        **({"confirm": CONFIRM_DECISION} if args.confirm and not args.smoke else {}),
        "summary": summary(rows),
        "rows": rows,
        "minutes": round((time.perf_counter() - start) / 60, 1),
    }  # fmt: skip
    for name, s in result["summary"].items():
        print(f"{name:>14}: median |error| {s['median_abs_error']:.2%}, max {s['max_abs_error']:.2%}, "
              f"coverage {s['coverage']:.0%} ({s['n']} forecasts)")  # fmt: skip
    if args.save:
        save_result(result, args.save)
    return result


if __name__ == "__main__":
    main()
