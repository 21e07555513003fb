"""Time to target at CPU scale: hopperlm's pretraining recipe against the recipes our users start from.

Every recipe trains the same model shape on the same real English text (Gutenberg books from ../shared/data,
a 4096-piece BPE tokenizer trained on them, whole books held out for validation) for the same wall-clock
budget, one after another with the machine to itself:
  (a) users-start   AdamW lr 6e-4, cosine, warm-up 1000 of the 1.5-hour run's ~15.7K steps (6.4% of the
                    steps), micro-batch 8 x accumulation 16; what the optimizer and model do not name keeps
                    torch's AdamW defaults (beta2 0.999, weight decay 0.01) and hopperlm's model defaults
  (b) nanogpt       nanoGPT / llm.c GPT-2: AdamW lr 6e-4, beta2 0.95, weight decay 0.1, cosine to 10%, warm-up
                    700 of llm.c's 19,073 steps (3.7% of the steps), tied embeddings, a small batch
  (c) hopperlm      hopperlm's recipe: nanogpt plus every change the ablation ladder kept (LADDER, KEPT)
and hopperlm's recipe once more on a shorter budget (SHORT of the others'), so "reaches the best baseline's
loss in less time" is a finished run's final loss, not a point in the middle of a longer schedule.
A recipe's warm-up is a share of its steps; the steps a budget buys come from a 6-step speed probe of each
batch layout before the race.

    python3 bench/time_to_target.py --save bench/results/DATE-time-to-target-cpu.json      (~13 minutes)
    python3 bench/time_to_target.py --ablate --seeds 0,1 --save FILE   (the ladder behind bench/NOTES.md)
    python3 bench/time_to_target.py --smoke                            (seconds: tests run it)

The JSON holds `rows`: {recipe, role, seed, wall_s, final_val_loss, curve: [[seconds, val_loss], ...]}, and
`time_to_target`: the best baseline's final loss, the first time a hopperlm row reached it, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("HOPPERLM_DATA", REPO.parent / "shared" / "data"))
BOOKS = 30  # the first 30 Gutenberg books by file name: 17.7 MB, ~5.2M tokens
VOCAB = 4096
SEQ_LEN = 256
SHORT = 0.6  # hopperlm's second, shorter run, as a share of the race budget
MODEL = {"dim": 128, "n_layers": 4, "n_heads": 2, "max_seq_len": SEQ_LEN}

# name: role, model keys, optim keys, train keys, warm-up as a share of the steps
RECIPES: dict[str, dict] = {
    "users-start": {
        "role": "baseline",
        "model": {},
        "optim": {"lr": 6e-4, "schedule": "cosine", "beta2": 0.999, "weight_decay": 0.01},
        "train": {"micro_batch": 8, "batch_tokens": 8 * 16 * SEQ_LEN},
        "warmup": 1000 / 15_700,
    },
    "nanogpt": {
        "role": "baseline",
        "model": {"tie_embeddings": True},
        "optim": {"lr": 6e-4, "schedule": "cosine", "beta2": 0.95, "weight_decay": 0.1, "min_lr_ratio": 0.1},
        "train": {"micro_batch": 16},
        "warmup": 700 / 19_073,
    },
}

# The ablation ladder: each rung adds one change to the best recipe so far (starting from nanogpt) and is kept
# only if it beats that recipe at equal wall-clock on every seed; KEPT names the rungs that did (bench/NOTES.md
# has the table), and RECIPES["hopperlm"] is nanogpt with them applied in order.
LADDER: list[tuple[str, dict]] = [
    ("+lr 2e-3", {"optim": {"lr": 2e-3}}),
    ("+wsd", {"optim": {"schedule": "wsd", "decay_fraction": 0.4}}),
    ("+untied", {"model": {"tie_embeddings": False}}),
    ("+muon", {"optim": {"name": "muon"}}),
    ("+lr 4e-3", {"optim": {"lr": 4e-3}}),
    ("+zero-init", {"model": {"zero_init_output": True}}),
    ("+qk-norm", {"model": {"qk_norm": True}}),
    ("+lr 8e-3", {"optim": {"lr": 8e-3}}),
    ("+decay to 0", {"optim": {"min_lr_ratio": 0.0}}),
    ("+micro-batch 8", {"train": {"micro_batch": 8}}),
]
KEPT = ("+lr 2e-3", "+wsd", "+untied", "+muon", "+lr 4e-3", "+decay to 0")


def merged(base: dict, change: dict) -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for section, keys in change.items():
        out[section] = {**out[section], **keys}
    return out


def kept_recipe() -> dict:
    """hopperlm's recipe: nanogpt with the kept rungs of the ladder, in order."""
    recipe = merged(RECIPES["nanogpt"], {})
    for rung, change in LADDER:
        if rung in KEPT:
            recipe = merged(recipe, change)
    return {**recipe, "role": "hopperlm"}


RECIPES["hopperlm"] = kept_recipe()


def cli(*args: str, cwd: Path) -> None:
    """The hopperlm CLI in a child process, as a user runs it."""
    proc = subprocess.run([sys.executable, "-m", "hopperlm", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"hopperlm {args[0]} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def prepare_data(cache: Path, books: int) -> Path:
    out = cache / f"gutenberg-{books}-bpe{VOCAB}"
    if not (out / "manifest.json").is_file():
        files = sorted(str(p) for p in (DATA / "gutenberg").glob("*.txt"))[:books]
        if len(files) < books:
            sys.exit(f"need {books} Gutenberg books in {DATA / 'gutenberg'}, found {len(files)}")
        cli("prepare", *files, "--out", str(out), "--tokenizer", "bpe", "--vocab-size", str(VOCAB),
            "--split", "docs" if books >= 10 else "tail", "--val-fraction", "0.1", cwd=cache)  # fmt: skip
    return out


def batch_tokens(recipe: dict) -> int:
    """Tokens per optimizer step: the recipe's, else one micro-batch."""
    return recipe["train"].get("batch_tokens", recipe["train"]["micro_batch"] * SEQ_LEN)


def run_config(recipe: dict, data: Path, out: Path, *, seconds: float, steps: int, seed: int, threads: int,
               eval_windows: int) -> dict:  # fmt: skip
    """The YAML a user would write for `recipe` on this budget."""
    return {
        "model": {**MODEL, **recipe["model"]},
        "data": {"path": str(data)},
        "optim": {**recipe["optim"], "warmup_steps": max(1, round(recipe["warmup"] * steps))},
        "train": {
            "seq_len": SEQ_LEN,
            **recipe["train"],
            "batch_tokens": batch_tokens(recipe),
            "max_hours": seconds / 3600,
            "eval_every": max(1, steps // 10),
            "eval_windows": eval_windows,
            "log_every": max(1, min(50, steps // 20)),
            "ckpt_every": 0,
            "keep_last": 1,
            "threads": threads,
            "seed": seed,
        },
        "run": {"out_dir": str(out)},
    }


def train(cfg: dict, cache: Path, reuse: bool = False) -> dict:
    """Train one run from its YAML (with `reuse`, a finished run of the same YAML is read instead); its row:
    final loss, wall time and the validation curve."""
    out = Path(cfg["run"]["out_dir"])
    spec = out.with_suffix(".yaml")
    text = yaml.safe_dump(cfg, sort_keys=False)
    if not (reuse and spec.is_file() and spec.read_text() == text and (out / "result.json").is_file()):
        shutil.rmtree(out, ignore_errors=True)  # the bench's own cache: train afresh
        spec.parent.mkdir(parents=True, exist_ok=True)
        spec.write_text(text)
        cli("train", str(spec), cwd=cache)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curve = [[round(r["elapsed_s"], 1), round(r["val_loss"], 4)] for r in records if "val_loss" in r]
    result = json.loads((out / "result.json").read_text())
    return {
        "wall_s": round(result["elapsed_s"], 1),
        "steps": result["step"],
        "tokens": result["tokens"],
        "final_val_loss": round(result["val_loss"], 4),
        "curve": curve,
    }


def probe_speed(recipes: dict, data: Path, cache: Path, threads: int) -> dict[int, float]:
    """tokens/s of each micro-batch size the recipes use, from 6 training steps (the first is warm-up)."""
    speeds = {}
    for micro in sorted({r["train"]["micro_batch"] for r in recipes.values()}):
        recipe = {"model": {}, "optim": {"lr": 1e-3}, "train": {"micro_batch": micro}, "warmup": 0.0}
        cfg = run_config(recipe, data, cache / "probe" / f"mb{micro}", seconds=3600, steps=6, seed=0,
                         threads=threads, eval_windows=1)  # fmt: skip
        cfg["train"].update(max_hours=None, max_steps=6, eval_every=0, log_every=3)
        out = Path(cfg["run"]["out_dir"])
        train(cfg, cache)
        last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
        speeds[micro] = last["tokens_per_s"]
        print(f"probe: micro-batch {micro}: {speeds[micro]:,.0f} tokens/s", flush=True)
    return speeds


def steps_for(recipe: dict, seconds: float, speeds: dict[int, float]) -> int:
    """Optimizer steps `seconds` buy at the probed speed of the recipe's micro-batch."""
    return max(10, int(seconds * speeds[recipe["train"]["micro_batch"]] / batch_tokens(recipe)))


def time_to_target(rows: list[dict]) -> dict:
    """The best baseline's final loss and the first moment a hopperlm run's validation reached it."""
    baselines = [r for r in rows if r["role"] == "baseline"]
    best = min(baselines, key=lambda r: r["final_val_loss"])
    target = best["final_val_loss"]
    reached = [
        seconds for r in rows if r["role"] == "hopperlm" for seconds, loss in r["curve"] if loss <= target
    ]
    seconds = min(reached) if reached else None
    return {
        "best_baseline": best["recipe"],
        "target_val_loss": target,
        "baseline_wall_s": best["wall_s"],
        "hopperlm_s": seconds,
        "ratio": None if seconds is None else round(seconds / best["wall_s"], 3),
        "met": seconds is not None and seconds <= 0.67 * best["wall_s"],
    }


def race(data: Path, cache: Path, seconds: float, seed: int, threads: int, eval_windows: int,
         speeds: dict[int, float]) -> list[dict]:  # fmt: skip
    entries = [(name, RECIPES[name], seconds) for name in RECIPES]
    entries.append(("hopperlm-short", RECIPES["hopperlm"], SHORT * seconds))
    rows = []
    for name, recipe, budget in entries:
        cfg = run_config(recipe, data, cache / "race" / name, seconds=budget, seed=seed, threads=threads,
                         steps=steps_for(recipe, budget, speeds), eval_windows=eval_windows)  # fmt: skip
        row = {"recipe": name, "role": recipe["role"], "seed": seed, "budget_s": round(budget, 1)}
        row.update(train(cfg, cache), config=cfg)
        rows.append(row)
        print(f"{name:<15} {row['steps']:>5} steps {row['wall_s']:>6.1f} s  val {row['final_val_loss']:.4f}",
              flush=True)  # fmt: skip
    return rows


def ablate(data: Path, cache: Path, seconds: float, seeds: list[int], jobs: int, eval_windows: int,
           speeds: dict[int, float]) -> list[dict]:  # fmt: skip
    """The ladder: every rung on every seed, `jobs` runs side by side on one thread each (the same conditions
    for every rung: the comparison is between rungs, not with the race). Finished runs of the same YAML in the
    cache are reused, so a longer ladder trains only its new rungs."""
    pool = ThreadPoolExecutor(max_workers=jobs)

    def run_all(rung: str, recipe: dict) -> list[dict]:
        def one(seed: int) -> dict:
            slug = rung.replace("+", "").replace(" ", "-")
            cfg = run_config(recipe, data, cache / "ablate" / f"{slug}-s{seed}", seconds=seconds, seed=seed,
                             threads=1, steps=steps_for(recipe, seconds, speeds), eval_windows=eval_windows)  # fmt: skip
            return {"rung": rung, "seed": seed, **train(cfg, cache, reuse=True), "config": cfg}

        return list(pool.map(one, seeds))

    best_rung, best = "nanogpt", RECIPES["nanogpt"]
    best_rows = run_all(best_rung, best)
    rows = [*best_rows]
    print(f"{'rung':<15} " + " ".join(f"{'seed ' + str(s):>9}" for s in seeds) + "   against")
    print(f"{best_rung:<15} " + " ".join(f"{r['final_val_loss']:>9.4f}" for r in best_rows), flush=True)
    for rung, change in LADDER:
        candidate = merged(best, change)
        new = run_all(rung, candidate)
        wins = sum(n["final_val_loss"] < b["final_val_loss"] for n, b in zip(new, best_rows, strict=True))
        kept = wins == len(seeds)
        for r in new:
            r.update(against=best_rung, kept=kept)
        rows += new
        print(f"{rung:<15} " + " ".join(f"{r['final_val_loss']:>9.4f}" for r in new)
              + f"   {best_rung}: wins on {wins}/{len(seeds)} seeds, {'kept' if kept else 'dropped'}", flush=True)  # fmt: skip
        if kept:
            best_rung, best, best_rows = rung, candidate, new
    pool.shutdown()
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=200.0, help="wall-clock budget of each race run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads of each race run")
    p.add_argument("--cache", default="/tmp/time-to-target", help="prepared data and runs (reused)")
    p.add_argument("--ablate", action="store_true", help="the ablation ladder instead of the race")
    p.add_argument("--seeds", default="0,1", help="--ablate: comma-separated seeds")
    p.add_argument("--jobs", type=int, default=2, help="--ablate: runs side by side, one thread each")
    p.add_argument("--smoke", action="store_true", help="a few seconds per run on 3 books: checks the script")
    p.add_argument("--save", help="write the rows and the result as JSON here")
    args = p.parse_args(argv)
    cache = Path(args.cache).resolve()
    cache.mkdir(parents=True, exist_ok=True)
    books, eval_windows, seconds = (3, 8, 2.0) if args.smoke else (BOOKS, 96, args.seconds)
    start = time.perf_counter()
    data = prepare_data(cache, books)
    result: dict = {"command": " ".join(["python3", "bench/time_to_target.py", *(argv or sys.argv[1:])])}
    threads = 1 if args.ablate else args.threads
    # smoke: an assumed speed instead of the probe (the warm-ups it sets do not matter there)
    saved = cache / "ablate" / "speeds.json"  # the ladder's configs (warm-ups) stay the same across reruns
    if args.smoke:
        speeds = {8: 5e3, 16: 5e3}
    elif args.ablate and saved.is_file():
        speeds = {int(k): v for k, v in json.loads(saved.read_text()).items()}
    else:
        speeds = probe_speed(RECIPES, data, cache, threads)
        if args.ablate:
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_text(json.dumps(speeds))
    result["tokens_per_s_probed"] = speeds
    if args.ablate:
        seeds = [int(s) for s in args.seeds.split(",")]
        result["ablation"] = ablate(data, cache, seconds, seeds, args.jobs, eval_windows, speeds)
    else:
        rows = race(data, cache, seconds, args.seed, threads, eval_windows, speeds)
        result.update(rows=rows, time_to_target=time_to_target(rows))
        t = result["time_to_target"]
        reached = "never" if t["hopperlm_s"] is None else f"after {t['hopperlm_s']:.0f} s (x{t['ratio']:.2f})"
        print(f"\nbest baseline {t['best_baseline']}: val {t['target_val_loss']:.4f} in {t['baseline_wall_s']:.0f} s; "
              f"hopperlm reached it {reached}: target x0.67 {'met' if t['met'] else 'NOT met'}")  # fmt: skip
    result["bench_wall_s"] = round(time.perf_counter() - start, 1)
    if args.save:
        from hopperlm.provenance import save_result

        save_result(result, args.save)
    return result


if __name__ == "__main__":
    main()
