"""How well does `hopperlm forecast` predict a run's final validation loss from its first 30%?

Trains small CPU runs on real text (Tiny Shakespeare, two Gutenberg books, WikiText-2; byte tokenizer) that
differ in learning rate, width, schedule (cosine, WSD, linear) and budget kind, into a cache folder that is
reused (so the forecast can be iterated on without retraining), then forecasts each run from the records of its
first `--using` of the budget and compares with the final validation loss it actually reached.

    python3 bench/forecast_accuracy.py --runs /tmp/forecast-runs --save bench/results/DATE-forecast-cpu.json
    python3 bench/forecast_accuracy.py --smoke --runs /tmp/fc-smoke      # 2 tiny runs, seconds (tests run it)

Runs train in `--jobs` processes of one thread each: on a small CPU, two one-thread runs side by side do
more work than one two-thread run (the matrices are too small to split well).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

DATA = Path(os.environ.get("HOPPERLM_DATA", "/work/shared/data"))
TEXTS = {
    "shakespeare": [DATA / "tinyshakespeare" / "input.txt"],
    "gutenberg": [
        DATA / "gutenberg" / "pg00011_Alices_Adventures_in_Wonderland.txt",
        DATA / "gutenberg" / "pg01661_The_Adventures_of_Sherlock_Holmes.txt",
    ],
    "wikitext": [DATA / "wikitext-2" / "wiki.valid.tokens", DATA / "wikitext-2" / "wiki.test.tokens"],
}


def model(dim: int, n_layers: int) -> dict:
    return {
        "dim": dim,
        "n_layers": n_layers,
        "n_heads": 4,
        "n_kv_heads": 4,
        "ffn_dim": 3 * dim,
        "max_seq_len": 256,
    }


# name: (data, model, optim, budget). Every run evaluates ~25 times, so the first 30% holds 7 evaluations.
RUNS = {
    "shk-cos-w128": ("shakespeare", model(128, 4), {"lr": 3e-3, "schedule": "cosine"}, {"max_steps": 800}),
    "shk-wsd-w128": ("shakespeare", model(128, 4), {"lr": 3e-3, "schedule": "wsd"}, {"max_steps": 800}),
    "shk-lin-w96": ("shakespeare", model(96, 3), {"lr": 1.5e-3, "schedule": "linear"}, {"max_steps": 1000}),
    "shk-cos-tok-w64": (
        "shakespeare",
        model(64, 2),
        {"lr": 6e-3, "schedule": "cosine"},
        {"max_tokens": 1_000_000},
    ),
    "gut-cos-w96": ("gutenberg", model(96, 3), {"lr": 2e-3, "schedule": "cosine"}, {"max_steps": 1000}),
    "gut-wsd-w128": (
        "gutenberg",
        model(128, 4),
        {"lr": 1e-3, "schedule": "wsd", "decay_fraction": 0.3},
        {"max_steps": 800},
    ),
    "wiki-cos-w64": ("wikitext", model(64, 2), {"lr": 4e-3, "schedule": "cosine"}, {"max_steps": 1200}),
    "wiki-wsd-w96": ("wikitext", model(96, 3), {"lr": 2e-3, "schedule": "wsd"}, {"max_steps": 1000}),
    "wiki-lin-w128": (
        "wikitext",
        model(128, 4),
        {"lr": 2e-3, "schedule": "linear", "min_lr_ratio": 0.05},
        {"max_steps": 800},
    ),
    "gut-lin-w64": ("gutenberg", model(64, 2), {"lr": 4e-3, "schedule": "linear"}, {"max_steps": 1200}),
    "shk-wsd-w64": (
        "shakespeare",
        model(64, 2),
        {"lr": 6e-3, "schedule": "wsd", "decay_fraction": 0.25},
        {"max_steps": 1200},
    ),
    "wiki-cos-w128": ("wikitext", model(128, 4), {"lr": 1e-3, "schedule": "cosine"}, {"max_steps": 800}),
}
SMOKE_RUNS = {
    "smoke-cos": ("shakespeare", model(32, 1), {"lr": 5e-3, "schedule": "cosine"}, {"max_steps": 100}),
    "smoke-wsd": ("shakespeare", model(32, 1), {"lr": 5e-3, "schedule": "wsd"}, {"max_steps": 100}),
}
SEQ_LEN, MICRO_BATCH = 128, 8


def run_config(name: str, spec: tuple, data_dir: Path, run_dir: Path, *, smoke: bool) -> dict:
    data, model_cfg, optim, budget = spec
    steps = budget.get("max_steps") or budget["max_tokens"] // (SEQ_LEN * MICRO_BATCH)
    return {
        "model": model_cfg,
        "data": {"path": str(data_dir / data)},
        "optim": {"warmup_steps": max(5, steps // 30), **optim},
        "train": {
            "seq_len": SEQ_LEN,
            "micro_batch": MICRO_BATCH,
            **budget,
            "eval_every": max(5, steps // 25),
            "eval_windows": 32 if smoke else 128,
            "log_every": 5 if smoke else 10,
            "ckpt_every": 0,
            "keep_last": 1,
            "threads": 1,
        },
        "run": {"out_dir": str(run_dir / name)},
    }


def hopperlm(*args: str, cwd: Path) -> None:
    """The CLI in a child process, from outside the repository (PYTHONPATH picks which hopperlm trains)."""
    subprocess.run([sys.executable, "-m", "hopperlm", *args], cwd=cwd, check=True, capture_output=True)


def prepare_data(cache: Path, names: set[str]) -> Path:
    data_dir = cache / "data"
    for name in sorted(names):
        if not (data_dir / name / "manifest.json").is_file():
            files = [str(p) for p in TEXTS[name]]
            hopperlm("prepare", *files, "--out", str(data_dir / name), "--tokenizer", "byte", cwd=cache)
    return data_dir


def finished(run_dir: Path) -> bool:
    result = run_dir / "result.json"
    return result.is_file() and json.loads(result.read_text()).get("stopped_by", "").startswith("max_")


def train_runs(runs: dict, cache: Path, *, jobs: int, smoke: bool) -> None:
    data_dir = prepare_data(cache, {spec[0] for spec in runs.values()})
    todo = []
    for name, spec in runs.items():
        if finished(cache / "runs" / name):
            continue
        spec_file = cache / "specs" / f"{name}.yaml"
        spec_file.parent.mkdir(parents=True, exist_ok=True)
        cfg = run_config(name, spec, data_dir, cache / "runs", smoke=smoke)
        spec_file.write_text(yaml.safe_dump(cfg, sort_keys=False))
        todo.append((name, spec_file))

    def train_one(item: tuple[str, Path]) -> None:
        name, spec_file = item
        start = time.perf_counter()
        hopperlm("train", str(spec_file), cwd=cache)
        print(f"trained {name} in {time.perf_counter() - start:.0f} s", flush=True)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(train_one, todo))


def final_val(run_dir: Path) -> float:
    from hopperlm.train.metrics import read_metrics

    vals = [r["val_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in r]
    return vals[-1]


def forecast_all(runs: dict, cache: Path, *, using: float, siblings: bool) -> list[dict]:
    """With `siblings`, the C prior of each run comes from the other runs of the folder (leave-one-out, as a
    sweep would have it); without, from the built-in default."""
    from hopperlm.observe.forecast import forecast_run

    rows = []
    for name, spec in runs.items():
        run_dir = cache / "runs" / name
        f = forecast_run(run_dir, using=using, siblings=siblings)
        actual = final_val(run_dir)
        rows.append(
            {
                "run": name,
                "data": spec[0],
                "schedule": spec[2]["schedule"],
                "lr": spec[2]["lr"],
                "dim": spec[1]["dim"],
                **f.to_dict(),
                "actual": actual,
                "error_pct": 100 * (f.final_val_loss - actual) / actual,
                "covered": f.low <= actual <= f.high,
            }
        )
    return rows


def summary(rows: list[dict]) -> dict:
    errors = [abs(r["error_pct"]) for r in rows]
    return {
        "runs": len(rows),
        "median_abs_error_pct": statistics.median(errors),
        "max_abs_error_pct": max(errors),
        "coverage": sum(r["covered"] for r in rows) / len(rows),
        "mean_interval_width_pct": statistics.mean(100 * (r["high"] - r["low"]) / r["actual"] for r in rows),
    }


def print_table(rows: list[dict], stats: dict, using: float) -> None:
    print(f"\nforecast at {using:.0%} of the budget vs the final validation loss")
    head = f"{'run':<17} {'sched':<7} {'at':>5} {'final':>5} {'predicted':>9} {'low-high':>13} "
    print(head + f"{'actual':>7} {'error':>7} covered  method")
    for r in rows:
        print(
            f"{r['run']:<17} {r['schedule']:<7} {r['at_step']:>5} {r['final_step']:>5} "
            f"{r['final_val_loss']:>9.4f} {r['low']:>6.3f}-{r['high']:<6.3f} {r['actual']:>7.4f} "
            f"{r['error_pct']:>+6.2f}% {'yes' if r['covered'] else 'NO':<8} {r['method']}"
        )
    print(
        f"median |error| {stats['median_abs_error_pct']:.2f}% (max {stats['max_abs_error_pct']:.2f}%), "
        f"coverage {stats['coverage']:.0%} of {stats['runs']} runs, "
        f"mean interval width {stats['mean_interval_width_pct']:.2f}%"
    )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", required=True, help="cache folder for data and runs (reused when present)")
    p.add_argument("--using", type=float, default=0.3, help="fraction of each budget the forecast sees")
    p.add_argument("--jobs", type=int, default=2, help="runs trained side by side (one thread each)")
    p.add_argument("--smoke", action="store_true", help="2 tiny runs (seconds): checks the script works")
    p.add_argument("--save", help="write the table and summary as JSON here")
    args = p.parse_args(argv)
    runs = SMOKE_RUNS if args.smoke else RUNS
    cache = Path(args.runs).resolve()
    cache.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    train_runs(runs, cache, jobs=args.jobs, smoke=args.smoke)
    trained_s = time.perf_counter() - start
    results = {}
    for label, siblings in (("default prior", False), ("sibling prior", True)):
        rows = forecast_all(runs, cache, using=args.using, siblings=siblings)
        results[label] = {"summary": summary(rows), "rows": rows}
        print(f"\n== C prior: {label}")
        print_table(rows, results[label]["summary"], args.using)
    result = {
        "command": " ".join(["python3", "bench/forecast_accuracy.py", *(argv or sys.argv[1:])]),
        "using": args.using,
        "train_wall_s": round(trained_s, 1),
        "methods": results,
    }
    if args.save:
        from hopperlm.provenance import save_result

        save_result(result, args.save)
    return result


if __name__ == "__main__":
    main()
