"""Time to target at CPU scale: hopperlm's pretraining recipe against the recipes our users start from, every
recipe's learning rate tuned.

Every recipe trains the same model shape on the same real English text (Gutenberg books from ../shared/data,
a 4096-piece BPE tokenizer trained on them, whole books held out for validation):
  (a) users-start   AdamW, cosine, warm-up 1000 of the 1.5-hour run's ~15.7K steps (6.4% of the steps),
                    micro-batch 8 x accumulation 16; torch's AdamW defaults (beta2 0.999, weight decay 0.01)
                    and hopperlm's model defaults (an untied head)
  (b) nanogpt       nanoGPT / llm.c GPT-2: AdamW, beta2 0.95, weight decay 0.1, cosine to 10%, warm-up 700 of
                    llm.c's 19,073 steps (3.7% of the steps), tied embeddings, a small batch
  (c) hopperlm      hopperlm's recipe: nanogpt plus every change the ablation ladder kept (LADDER, KEPT): Muon,
                    WSD to zero, an untied head
  (d) hopperlm-tied hopperlm's recipe with nanogpt's tied embeddings: the baselines' parameter count
Each recipe's LR is tuned with hopperlm's sweep machinery (train/sweep.py: a `hopperlm train` per run, two side
by side on one thread each) over LRS, 2 seeds, on the same budget: SECONDS of one-thread training at the
recipe's own speed, which a probe measures from CPU time before the race (so the other process beside a run
does not change its budget); a run trains the steps that buys. The target is the best tuned baseline's mean final
loss; hopperlm (at its best LR) then trains shorter budgets (SHARES), and its time to the target is the shortest
budget whose finished runs end at or below it on the mean of the seeds (and the interpolation between the
budgets tried): a finished run's final loss, not a point in the middle of a longer schedule.

    python3 bench/time_to_target.py --save bench/results/DATE-time-to-target-cpu.json        (~40 minutes)
    python3 bench/time_to_target.py --reprice FILE --save FILE2     (a quiet probe reprices a finished race)
    python3 bench/time_to_target.py --ablate --seeds 0,1 --save FILE   (the ladder behind bench/NOTES.md)
    python3 bench/time_to_target.py --smoke                            (seconds: tests run it)

The JSON holds `rows`: {recipe, role, lr, seed, budget_share, steps, seconds, wall_s, params, final_val_loss,
curve: [[step, seconds, val_loss], ...]}, and `time_to_target` (hopperlm) and `time_to_target_equal_params`
(hopperlm-tied): the tuned baselines, the target, hopperlm's budgets and the ratios (read by
time_to_target_read.py).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml
from harness import (
    DATA,
    bench_command,
    done,
    hopperlm,
    mark_done,
    save_result,
    start_run,
    val_losses,
)
from harness import (
    prepare_data as prepare_shards,
)
from harness import (
    run_config as yaml_of,
)
from time_to_target_read import best_of, mean_loss, time_to_target

BOOKS = 30  # the first 30 Gutenberg books by file name: 17.7 MB, ~5.2M tokens
VOCAB = 4096
SEQ_LEN = 256
SHORT = 0.6  # hopperlm's second, shorter run, as a share of the race budget
MODEL = {"dim": 128, "n_layers": 4, "n_heads": 2, "max_seq_len": SEQ_LEN}

# name: role, model keys, optim and schedule keys, train keys, warm-up as a share of the steps
RECIPES: dict[str, dict] = {
    "users-start": {
        "role": "baseline",
        "model": {},
        "optim": {"lr": 6e-4, "betas": [0.9, 0.999], "weight_decay": 0.01},
        "schedule": {"name": "cosine"},
        "train": {"micro_batch": 8, "batch_tokens": 8 * 16 * SEQ_LEN},
        "warmup": 1000 / 15_700,
    },
    "nanogpt": {
        "role": "baseline",
        "model": {"tie_embeddings": True},
        "optim": {"lr": 6e-4, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "schedule": {"name": "cosine", "min_lr_ratio": 0.1},
        "train": {"micro_batch": 16},
        "warmup": 700 / 19_073,
    },
}

# The ablation ladder: each rung adds one change to the best recipe so far (starting from nanogpt) and is kept
# only if it beats that recipe at equal wall-clock on every seed; KEPT names the rungs that did (bench/NOTES.md
# has the table), and RECIPES["hopperlm"] is nanogpt with them applied in order.
LADDER: list[tuple[str, dict]] = [
    ("+lr 2e-3", {"optim": {"lr": 2e-3}}),
    ("+wsd", {"schedule": {"name": "wsd", "decay_fraction": 0.4}}),
    ("+untied", {"model": {"tie_embeddings": False}}),
    ("+muon", {"optim": {"name": "muon"}}),
    ("+lr 4e-3", {"optim": {"lr": 4e-3}}),
    ("+zero-init", {"model": {"zero_init_output": True}}),
    ("+qk-norm", {"model": {"qk_norm": True}}),
    ("+lr 8e-3", {"optim": {"lr": 8e-3}}),
    ("+decay to 0", {"schedule": {"min_lr_ratio": 0.0}}),
    ("+micro-batch 8", {"train": {"micro_batch": 8}}),
]
KEPT = ("+lr 2e-3", "+wsd", "+untied", "+muon", "+lr 4e-3", "+decay to 0")

# The race's LR grids, a factor of 2 apart around the best AdamW LR a reviewer found (4e-3), users-start's also
# with its published 6e-4; every (LR, seed) is a finished run, and a grid whose best is at its edge says so.
LRS = {
    "users-start": (6e-4, 1e-3, 2e-3, 4e-3, 8e-3),
    "nanogpt": (1e-3, 2e-3, 4e-3, 8e-3),
    "hopperlm": (2e-3, 4e-3, 8e-3),
}
SHARES = (0.15, 0.2, 0.3, 0.5)  # hopperlm's shorter budgets, as shares of the baselines'
SMOKE_LRS, SMOKE_SHARES = {"users-start": (2e-3,), "nanogpt": (2e-3,), "hopperlm": (2e-3,)}, (0.5,)


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


def prepare_data(cache: Path, books: int) -> Path:
    """The first `books` Gutenberg books with a VOCAB-piece BPE learned on them, whole books held out where
    there are enough of them (once per cache)."""
    files = sorted((DATA / "gutenberg").glob("*.txt"))[:books]
    if len(files) < books:
        sys.exit(f"need {books} Gutenberg books in {DATA / 'gutenberg'}, found {len(files)}")
    return prepare_shards(cache / f"gutenberg-{books}-bpe{VOCAB}", files, tokenizer="bpe", vocab_size=VOCAB,
                          split="docs" if books >= 10 else "tail", val_fraction=0.1)  # fmt: skip


def batch_tokens(recipe: dict) -> int:
    """Tokens per optimizer step: the recipe's, else one micro-batch."""
    return recipe["train"].get("batch_tokens", recipe["train"]["micro_batch"] * SEQ_LEN)


def run_config(recipe: dict, data: Path, out: Path, *, seconds: float, steps: int, seed: int, threads: int,
               eval_windows: int) -> dict:  # fmt: skip
    """The YAML a user would write for `recipe` on this budget."""
    return yaml_of(
        model={**MODEL, **recipe["model"]},
        data=data,
        optim=recipe["optim"],
        schedule={**recipe["schedule"], "warmup_steps": max(1, round(recipe["warmup"] * steps))},
        train={
            "seq_len": SEQ_LEN,
            **recipe["train"],
            "batch_tokens": batch_tokens(recipe),
            "max_hours": seconds / 3600,
            "eval_every": max(1, steps // 10),
            "eval_windows": eval_windows,
            "log_every": max(1, min(50, steps // 20)),
            "threads": threads,
            "seed": seed,
        },
        checkpoint={"every": 0, "keep_last": 1},
        out_dir=out,
    )


def train(cfg: dict, cache: Path, reuse: bool = False) -> dict:
    """Train one run from its YAML (with `reuse`, a finished run of the same YAML is read instead); its row:
    final loss, wall time and the validation curve."""
    out = Path(cfg["run"]["out_dir"])
    if not (reuse and done(out, cfg)):
        start_run(out)
        spec = out.with_suffix(".yaml")
        spec.parent.mkdir(parents=True, exist_ok=True)
        spec.write_text(yaml.safe_dump(cfg, sort_keys=False))
        hopperlm("train", str(spec), cwd=cache)
        mark_done(out, cfg)
    curve = [[round(r["elapsed_s"], 1), round(r["val_loss"], 4)] for r in val_losses(out)]
    result = json.loads((out / "result.json").read_text())
    return {
        "wall_s": round(result["elapsed_s"], 1),
        "steps": result["step"],
        "tokens": result["tokens"],
        "final_val_loss": round(result["val_loss"], 4),
        "curve": curve,
    }


def probe_speed(recipes: dict, data: Path, cache: Path, threads: int) -> dict[int, float]:
    """The ladder's probe: tokens/s of each micro-batch size the recipes use (6 steps, as `probe` reads them)."""
    speeds = {}
    for micro in sorted({r["train"]["micro_batch"] for r in recipes.values()}):
        recipe = {
            "model": {},
            "optim": {"lr": 1e-3},
            "schedule": {},
            "train": {"micro_batch": micro},
            "warmup": 0.0,
        }
        speeds[micro] = probe(recipe, data, cache / "probe" / f"mb{micro}", threads=threads, steps=6)
        print(f"probe: micro-batch {micro}: {speeds[micro]:,.0f} tokens/s", flush=True)
    return speeds


def probe(recipe: dict, data: Path, out: Path, *, threads: int, steps: int) -> float:
    """tokens/s of `recipe` (its model, optimizer and batch layout) alone on `threads` threads: the CPU time of a
    run of `steps` steps less that of a run of steps // 4 (start-up and first steps cancel), so another process
    on the machine does not change a recipe's budget (its wall time would)."""
    cpu = []
    for n in (steps // 4, steps):
        cfg = run_config(recipe, data, out, seconds=3600, steps=n, seed=0, threads=threads, eval_windows=1)
        cfg["train"].update(max_hours=None, max_steps=n, eval_every=0, log_every=n)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        train(cfg, out.parent)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return (steps - steps // 4) * batch_tokens(recipe) / threads / (cpu[1] - cpu[0])


def steps_for(recipe: dict, seconds: float, speeds: dict[int, float]) -> int:
    """Optimizer steps `seconds` buy at the probed speed of the recipe's micro-batch."""
    return max(10, int(seconds * speeds[recipe["train"]["micro_batch"]] / batch_tokens(recipe)))


def params_of(recipe: dict) -> dict[str, int]:
    """The recipe's parameter counts: total and without the input embedding."""
    from hopperlm.config import ModelConfig
    from hopperlm.model.transformer import count_params

    counts = count_params(ModelConfig(**{**MODEL, **recipe["model"], "vocab_size": VOCAB}))
    return {"params": counts["total"], "non_embedding_params": counts["non_embedding"]}


def sweep_recipe(name: str, recipe: dict, *, lrs, seeds, steps: int, seconds_per_step: float, data: Path,
                 out: Path, eval_windows: int, jobs: int) -> list[dict]:  # fmt: skip
    """Train `recipe` for `steps` at every LR and seed with hopperlm's sweep machinery (train/sweep.py: one
    `hopperlm train` per run, `jobs` side by side on one thread each); a row per run with its curve. Finished
    runs of the same recipe and grid point in the cache are read back instead of retrained (a longer grid trains
    its new LRs)."""
    from hopperlm.train import sweep

    cfg = run_config(recipe, data, out / "runs", seconds=3600, steps=steps, seed=0, threads=1,
                     eval_windows=eval_windows)  # fmt: skip
    cfg["train"].update(max_hours=None, max_steps=steps)
    runs = [
        sweep.SweepRun(lr, seed, str(out / f"lr-{sweep.lr_text(lr)}-seed-{seed}"))
        for lr in lrs
        for seed in seeds
    ]

    def point(run: sweep.SweepRun) -> dict:  # what a sweep run is: the recipe at its grid point
        return {**cfg, "sweep_point": {"lr": run.lr, "seed": run.seed}}

    missing = sorted({r.lr for r in runs if not done(Path(r.run_dir), point(r))})
    if missing:
        for r in runs:
            if r.lr in missing:
                start_run(Path(r.run_dir))
        spec = out / "recipe.yaml"
        out.mkdir(parents=True, exist_ok=True)
        spec.write_text(yaml.safe_dump(cfg, sort_keys=False))
        sweep.run_sweep(spec, [], lrs=missing, seeds=list(seeds), out_dir=out, jobs=jobs,
                        log=lambda line: print(f"{name}: {line}", flush=True))  # fmt: skip
        for r in runs:
            if r.lr in missing and (Path(r.run_dir) / "result.json").is_file():
                mark_done(Path(r.run_dir), point(r))
    rows = []
    for r in runs:
        run_dir = Path(r.run_dir)
        result = json.loads((run_dir / "result.json").read_text())
        records = val_losses(run_dir)
        rows.append({
            "recipe": name, "role": recipe["role"], "lr": r.lr, "seed": r.seed, "steps": result["step"],
            "seconds": round(result["step"] * seconds_per_step, 1), "wall_s": round(result["elapsed_s"], 1),
            "final_val_loss": round(result["val_loss"], 4) if result.get("val_loss") is not None else None,
            "curve": [[x["step"], round(x["step"] * seconds_per_step, 1), round(x["val_loss"], 4)]
                      for x in records],
            **params_of(recipe),
        })  # fmt: skip
    return rows


def reprice(result: dict, speeds: dict[str, float], recipes: dict) -> dict:
    """The race's result with every row's seconds (and its curve's) from `speeds` (tokens/s per recipe, e.g. a
    probe on a quiet machine after the race), and the time to target read again."""
    per_step = {name: batch_tokens(recipes[name]) / speeds[name] for name in speeds}
    rows = []
    for r in result["rows"]:
        t = per_step[r["recipe"]]
        curve = [[step, round(step * t, 1), v] for step, _, v in r["curve"]]
        rows.append({**r, "seconds": round(r["steps"] * t, 1), "curve": curve})
    out = {**result, "tokens_per_s_probed": speeds, "seconds_per_step": per_step, "rows": rows,
           "time_to_target": time_to_target(rows, "hopperlm")}  # fmt: skip
    if any(r["recipe"] == "hopperlm-tied" for r in rows):
        out["time_to_target_equal_params"] = time_to_target(rows, "hopperlm-tied")
    return out


def race_recipes() -> dict:
    """The race's recipes: the baselines, hopperlm, and hopperlm tied (the baselines' parameter count)."""
    return {**RECIPES, "hopperlm-tied": merged(RECIPES["hopperlm"], {"model": {"tie_embeddings": True}})}


def probe_all(data: Path, cache: Path, smoke: bool, *, again: bool = False) -> dict[str, float]:
    """Every race recipe's tokens/s alone on one thread (its steps for a budget, its seconds per step), kept in
    the cache so a race that is run again trains the same steps (`again`: probe anew, for --reprice)."""
    saved = cache / "probe" / "speeds.json"
    if saved.is_file() and not again and not smoke:
        speeds = json.loads(saved.read_text())
        print(f"probe: the speeds in {saved}: {speeds}", flush=True)
        return speeds
    speeds = {}
    for name, recipe in race_recipes().items():
        # (not a folder named `hopperlm` where the probe runs `python -m hopperlm`: it would shadow the package)
        out = cache / "probe" / f"recipe-{name}"
        speeds[name] = 5e3 if smoke else probe(recipe, data, out, threads=1, steps=16)
        print(f"probe: {name}: {speeds[name]:,.0f} tokens/s on one thread", flush=True)
    if not smoke and not again:
        saved.write_text(json.dumps(speeds))
    return speeds


def race(data: Path, cache: Path, *, seconds: float, seeds: list[int], lrs: dict, shares: list[float],
         eval_windows: int, jobs: int, smoke: bool) -> dict:  # fmt: skip
    """Every recipe's LR tuned on the full budget, then hopperlm's best LR on shorter budgets (both hopperlm
    variants: untied, and tied at the baselines' parameter count)."""
    recipes = race_recipes()
    speeds = probe_all(data, cache, smoke)
    per_step = {name: batch_tokens(recipes[name]) / speeds[name] for name in recipes}
    rows: list[dict] = []

    def run(name: str, grid, share: float) -> None:
        steps = max(2 if smoke else 10, int(share * seconds / per_step[name]))
        got = sweep_recipe(name, recipes[name], lrs=grid, seeds=seeds, steps=steps, seconds_per_step=per_step[name],
                           data=data, out=cache / "race" / f"{name}-x{share:g}", eval_windows=eval_windows,
                           jobs=jobs)  # fmt: skip
        rows.extend({**r, "budget_share": share} for r in got)

    for name in ("users-start", "nanogpt", "hopperlm"):
        run(name, lrs[name], 1.0)
    lr = best_of(rows, "hopperlm")[0]
    run("hopperlm-tied", [lr], 1.0)  # at hopperlm's tuned LR: the tied variant is not tuned on its own
    for share in shares:
        for name in ("hopperlm", "hopperlm-tied"):
            run(name, [lr], share)
    return {"tokens_per_s_probed": speeds, "seconds_per_step": per_step, "rows": rows,
            "time_to_target": time_to_target(rows, "hopperlm"),
            "time_to_target_equal_params": time_to_target(rows, "hopperlm-tied")}  # fmt: skip


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
    p.add_argument("--seconds", type=float, default=100.0, help="budget of each full race run, in seconds of "
                   "one-thread training at the recipe's probed speed")  # fmt: skip
    p.add_argument("--cache", default="/tmp/time-to-target", help="prepared data and runs (reused)")
    p.add_argument("--ablate", action="store_true", help="the ablation ladder instead of the race")
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds")
    p.add_argument("--jobs", type=int, default=2, help="runs side by side, one thread each")
    p.add_argument("--smoke", action="store_true", help="a few steps per run on 3 books: checks the script")
    p.add_argument("--save", help="write the rows and the result as JSON here")
    p.add_argument("--reprice", metavar="FILE", help="probe every recipe again (on a quiet machine) and read the "
                   "time to target of a finished race's FILE with those speeds; the first probe is kept beside")  # fmt: skip
    args = p.parse_args(argv)
    cache = Path(args.cache).resolve()
    cache.mkdir(parents=True, exist_ok=True)
    books, eval_windows, seconds = (3, 8, 2.0) if args.smoke else (BOOKS, 96, args.seconds)
    seeds = [int(s) for s in args.seeds.split(",")]
    start = time.perf_counter()
    data = prepare_data(cache, books)
    result: dict = {"command": bench_command("time_to_target.py", argv)}
    if args.reprice:
        raced = json.loads(Path(args.reprice).read_text())
        first = {"tokens_per_s_probed": raced["tokens_per_s_probed"], "command": raced["command"]}
        result = {**reprice(raced, probe_all(data, cache, args.smoke, again=True), race_recipes()), "race": first,
                  "command": result["command"]}  # fmt: skip
        report(result)
    elif args.ablate:
        saved = cache / "ablate" / "speeds.json"  # the ladder's warm-ups stay the same across reruns
        if args.smoke:
            speeds = {8: 5e3, 16: 5e3}  # an assumed speed instead of the probe
        elif saved.is_file():
            speeds = {int(k): v for k, v in json.loads(saved.read_text()).items()}
        else:
            speeds = probe_speed(RECIPES, data, cache, 1)
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_text(json.dumps(speeds))
        result["tokens_per_s_probed"] = speeds
        result["ablation"] = ablate(data, cache, seconds, seeds, args.jobs, eval_windows, speeds)
    else:
        lrs, shares = (SMOKE_LRS, SMOKE_SHARES) if args.smoke else (LRS, SHARES)
        result.update(race(data, cache, seconds=seconds, seeds=seeds[:1] if args.smoke else seeds, lrs=lrs,
                           shares=shares, eval_windows=eval_windows, jobs=args.jobs, smoke=args.smoke))  # fmt: skip
        report(result)
    result["bench_wall_s"] = round(time.perf_counter() - start, 1)
    if args.save:
        save_result(result, args.save)
    return result


def report(result: dict) -> None:
    """The sweeps' table and the two time-to-target readings."""
    rows = result["rows"]
    print(f"\n{'recipe':<15}{'params':>10}{'lr':>9}{'budget':>8}  mean final val loss (seeds)")
    for name in dict.fromkeys(r["recipe"] for r in rows):
        for share in sorted({r["budget_share"] for r in rows if r["recipe"] == name}, reverse=True):
            for lr in sorted({r["lr"] for r in rows if r["recipe"] == name and r["budget_share"] == share}):
                sel = [
                    r for r in rows if r["recipe"] == name and r["budget_share"] == share and r["lr"] == lr
                ]
                seeds = ", ".join(
                    "-" if r["final_val_loss"] is None else f"{r['final_val_loss']:.4f}" for r in sel
                )
                print(
                    f"{name:<15}{sel[0]['params']:>10,}{lr:>9.1e}{share:>8.2f}  {mean_loss(sel):.4f} ({seeds})"
                )
    edges = [n for n, v in result["time_to_target"]["tuned_baselines"].items() if v["at_grid_edge"]]
    edges += ["hopperlm"] if result["time_to_target"]["lr_at_grid_edge"] else []
    for name in edges:
        print(f"warning: {name}'s best LR is at the edge of its grid; a wider grid may find a better one")
    for key in ("time_to_target", "time_to_target_equal_params"):
        if key not in result:
            continue
        t = result[key]
        reached = (f"reached it with {t['ratio_reached']:.2f}x the budget (interpolated {t['ratio_interpolated']:.2f}x)"
                   if t["ratio_reached"] is not None else "did not reach it")  # fmt: skip
        print(f"{t['recipe']} ({t['params']:,} params, lr {t['lr']:.1e}) against {t['best_baseline']} "
              f"({t['baseline_params']:,} params, tuned lr {t['best_baseline_lr']:.1e}, val {t['target_val_loss']:.4f}): "
              f"{reached}")  # fmt: skip


if __name__ == "__main__":
    main()
