"""How well do proxy runs forecast the big run? `hopperlm sweep --widths` on a small μP recipe, then the big run
itself, and the forecast's error.

The recipe: 2 blocks, heads of 32, context 64, 256 tokens per step, Muon (spectral rule) with AdamW for the
rest, μP with base width 64, WSD schedule; Gutenberg books from ../shared/data with a 1,024-piece BPE (the
transfer benchmark's data). The big run is width 512 at TOKENS_PER_PARAM tokens per parameter; the sweep picks
the LR on a width-64 proxy (3 LRs x 2 seeds), trains widths 64-256 at that LR and the big run's tokens per
parameter (2 seeds each), and writes the forecast (hopperlm/observe/width_forecast.py); then the big run trains
(2 seeds) with the tuned recipe, and the script reports the forecast against the mean of its seeds, the
interval, and what each law would have said. Goal (issue 39): error <= 1%.

    python3 bench/width_forecast.py --save bench/results/DATE-width-forecast-cpu.json     (~25 min on 2 cores)
    python3 bench/width_forecast.py --smoke                                               (CI: a minute)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml
from harness import bench_command, hopperlm, run_config, save_result, train_process
from transfer import prepare_data  # the same books and tokenizer as the transfer benchmark

FULL = {"target": 512, "widths": "64,96,128,192,256", "tokens_per_param": 0.08, "lrs": "8e-3,1.6e-2,3.2e-2",
        "seeds": "1,2", "sweep_steps": 60}  # fmt: skip
SMOKE = {"target": 128, "widths": "32,64,96", "tokens_per_param": 0.02, "lrs": "8e-3,1.6e-2,3.2e-2",
         "seeds": "1", "sweep_steps": 3}  # fmt: skip


def recipe(data: Path, width: int, steps: int) -> dict:
    return run_config(
        model={
            "dim": width,
            "n_layers": 2,
            "n_heads": width // 32,
            "max_seq_len": 64,
            "parametrization": "mup",
            "base_dim": 64,
        },  # fmt: skip
        data=data,
        optim={"name": "muon", "lr": 1.6e-2, "weight_decay": 0.0},
        muon={"lr_adjust": "spectral"},
        schedule={"name": "wsd", "decay_fraction": 0.4, "min_lr_ratio": 0.0, "warmup_steps": 10},
        train={
            "seq_len": 64,
            "micro_batch": 4,
            "batch_tokens": 256,
            "max_steps": steps,
            "eval_every": 0,
            "eval_windows": 256,
            "log_every": 50,
            "device": "cpu",
            "compile": False,
        },  # fmt: skip
        quiet=True,
    )


def big_run(tuned: Path, out: Path, seed: str) -> float:
    """The big run of the tuned recipe on one seed (one thread: the two seeds train side by side)."""
    log = out.with_suffix(".log")
    code, _ = train_process(tuned, "--train.seed", seed, "--run.out_dir", str(out), cwd=Path.cwd(), log=log,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    if code:
        sys.exit(f"the big run failed:\n{log.read_text()[-3000:]}")
    return json.loads((out / "result.json").read_text())["val_loss"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--work", default="/tmp/width-forecast", help="data, runs (a fresh sweep folder each time)"
    )
    p.add_argument("--smoke", action="store_true", help="tiny widths and budgets: checks the script")
    p.add_argument("--save", help="write the result as JSON here")
    args = p.parse_args(argv)
    spec = SMOKE if args.smoke else FULL
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    data = prepare_data(work, args.smoke)
    from hopperlm.config import load_config
    from hopperlm.train.sweep import model_params

    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe(data, spec["target"], 1), sort_keys=False))
    cfg = load_config(path)
    params = model_params(cfg.model, cfg.data)
    steps = round(spec["tokens_per_param"] * params / 256)  # the big run's budget: tokens per parameter
    path.write_text(yaml.safe_dump(recipe(data, spec["target"], steps), sort_keys=False))
    sweep = work / f"sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    said = hopperlm("sweep", str(path), "--lr", spec["lrs"], "--dim", spec["widths"].split(",")[0],
                    "--widths", spec["widths"], "--seeds", spec["seeds"], "--jobs", "2",
                    "--max-steps", str(spec["sweep_steps"]), "--out", str(sweep))  # fmt: skip
    print(said[-4000:], flush=True)
    tuned = sweep / "recipe.tuned.yaml"
    forecast = json.loads((sweep / "forecast.json").read_text())
    seeds = spec["seeds"].split(",")
    with ThreadPoolExecutor(max_workers=len(seeds)) as pool:
        big = list(pool.map(lambda seed: big_run(tuned, sweep / f"big-seed-{seed}", seed), seeds))
    actual = statistics.fmean(big)
    error = forecast["final_val_loss"] / actual - 1
    from hopperlm.observe.width_forecast import LAWS, mean_by_width

    n, losses = mean_by_width(forecast["points"])  # what each law would have forecast from every proxy
    each = {name: round(float(fit(n, losses)(params)), 4) for name, fit in LAWS.items()}
    result = {
        "command": bench_command("width_forecast.py", argv),
        "smoke": args.smoke,
        "spec": spec,
        "target_params": params,
        "target_steps": steps,
        "forecast": forecast,
        "big_run_final_val_loss": big,
        "big_run_mean": round(actual, 4),
        "error": round(error, 5),
        "inside_interval": forecast["low"] <= actual <= forecast["high"],
        "each_law": each,
        "each_law_error": {name: round(v / actual - 1, 5) for name, v in each.items()},
        "minutes": round((time.perf_counter() - start) / 60, 1),
    }
    print(f"forecast {forecast['final_val_loss']:.4f} ({forecast['low']:.4f}-{forecast['high']:.4f}, "
          f"{forecast['law']} law) vs the big run {actual:.4f} (seeds {', '.join(f'{v:.4f}' for v in big)}): "
          f"error {error:+.2%}, goal 1%: {'met' if abs(error) <= 0.01 else 'missed'}")  # fmt: skip
    if args.save:
        save_result(result, args.save)
    return result


if __name__ == "__main__":
    main()
