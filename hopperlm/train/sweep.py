"""`hopperlm sweep RECIPE --lr A,B,C [--dim D] [--depth L] [--seeds S,...]`: tune the learning rate of a μP
recipe on a narrow (and, under CompleteP, shallow) proxy of it, and write the recipe back with the best LR.

The proxy is the recipe at width D (heads of the same size: model.n_heads and n_kv_heads scaled with the
width; model.base_dim, depth, data, batch, schedule and budget as the recipe says) and, with --depth, L blocks.
Under model.parametrization mup the best optim.lr of the proxy is the best of the recipe's width (model/mup.py),
under model.depth_parametrization completep also of the recipe's depth (model/completep.py): that is why a
recipe that is not mup is refused, and --depth on one that is not completep. Each (LR, seed) trains as its own `hopperlm train` process, one after another or
`--jobs` side by side (threads as `train` chooses them, shared among the jobs), into OUT/lr-LR-seed-S; the best LR has the lowest final
validation loss averaged over seeds. The table, an overlay plot of the runs (OUT/plots) and OUT/sweep.json say
what was measured. The recipe is written to OUT/RECIPE.tuned.yaml (ruamel.yaml's round trip: its comments and key
order kept) with the best LR and every override the runs had but the proxy's width, budget and out_dir, which stay
the recipe's; comments above optim.lr name the sweep and the proxy, so the file alone trains what was tuned (and,
at the proxy's width and budget, reproduces the sweep's run).
With `--widths`, the recipe is then trained at each of those widths at the best LR and the recipe's own tokens per
parameter (run_widths), and observe/width_forecast.py forecasts the recipe's final loss from them
(OUT/forecast.json, named by train.forecast_from in the tuned recipe).
Ctrl-C loses no run (train/sweep_interrupt.py): the runs in progress save their step, no new one starts, and one
line gives the sweep's own command with --resume, which keeps the finished runs, resumes the interrupted ones
from their checkpoints and starts the rest.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from hopperlm.config import DataConfig, ModelConfig, TrainConfig
from hopperlm.errors import ConfigError, last_line
from hopperlm.files import write_atomic
from hopperlm.plan.choices import threads_beside_load
from hopperlm.train.recipe_edit import override_items
from hopperlm.train.sweep_interrupt import SweepInterrupt
from hopperlm.train.sweep_progress import wait_reporting
from hopperlm.train.warm_start import starter_for

MIN_LRS = 3  # fewer cannot show that the best lies inside the grid


@dataclass
class SweepRun:
    lr: float
    seed: int
    run_dir: str
    final_val_loss: float | None = None
    stopped_by: str | None = None
    seconds: float | None = None
    error: str | None = None
    threads: int | None = None  # OMP_NUM_THREADS of its process: a CPU run's losses depend on it
    step: int | None = None  # the step it ended at (stopped by Ctrl-C: the step it saved)
    label: str | None = None  # how the log names it (default: its LR and seed)
    extra: list[str] | None = None  # its own overrides beside the sweep's (a mixture sweep's data and base)

    @property
    def name(self) -> str:
        return self.label or f"lr {lr_text(self.lr)} seed {self.seed}"

    @property
    def interrupted(self) -> bool:
        """Stopped by Ctrl-C (saved, to resume) or kept from starting by it: no result yet."""
        return self.stopped_by == "signal SIGINT" or self.error == NOT_STARTED


NOT_STARTED = "not started (Ctrl-C)"


def parse_lrs(text: str) -> list[float]:
    try:
        lrs = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(
            f"--lr {text!r}: write positive numbers separated by commas, e.g. 1e-3,2e-3,4e-3"
        ) from None
    if len(lrs) < MIN_LRS or any(lr <= 0 for lr in lrs):
        raise ConfigError(
            f"--lr {text!r}: give at least {MIN_LRS} distinct positive learning rates (a factor of 2 apart, e.g. "
            "1e-3,2e-3,4e-3), so the sweep can show the best is inside the grid"
        )
    return lrs


def proxy_overrides(model: ModelConfig, dim: int | None, depth: int | None = None) -> list[str]:
    """The --model.* overrides that make the recipe its proxy at width `dim` and `depth` blocks (none for the
    recipe's own); ConfigError for a recipe whose best LR does not transfer, or a proxy that is not smaller."""
    if model.parametrization != "mup":
        raise ConfigError(
            "the recipe uses model.parametrization standard, under which the best LR moves with width: a proxy's "
            "would not transfer; set model.parametrization mup and model.base_dim (the proxy's width)"
        )
    out = depth_overrides(model, depth)
    if dim is None or dim == model.dim:
        return out
    if dim > model.dim:
        raise ConfigError(
            f"--dim {dim} is wider than the recipe's model.dim {model.dim}: the proxy must be narrower"
        )
    if dim <= 0 or dim % model.head_dim:
        raise ConfigError(
            f"--dim {dim} is not a positive multiple of the head size {model.head_dim}: width grows by heads"
        )
    heads = dim // model.head_dim
    out = ["--model.dim", str(dim), "--model.n_heads", str(heads), *out]
    if model.n_kv_heads is not None:
        kv = max(1, round(model.n_kv_heads * dim / model.dim))
        while heads % kv:
            kv -= 1
        out += ["--model.n_kv_heads", str(kv)]
    if model.ffn_dim is not None:
        out += ["--model.ffn_dim", str(max(model.multiple_of, round(model.ffn_dim * dim / model.dim)))]
    return out


def depth_overrides(model: ModelConfig, depth: int | None) -> list[str]:
    """The --model.n_layers override of a proxy `depth` blocks deep (none for the recipe's own depth)."""
    if depth is None or depth == model.n_layers:
        return []
    if depth > model.n_layers:
        raise ConfigError(
            f"--depth {depth} is deeper than the recipe's model.n_layers {model.n_layers}: the proxy must be "
            "shallower"
        )
    if model.depth_parametrization != "completep":
        raise ConfigError(
            f"--depth {depth}: the recipe uses model.depth_parametrization standard, under which the best LR moves "
            "with depth: a proxy's would not transfer; set model.depth_parametrization completep and "
            "model.base_depth (the proxy's depth)"
        )
    return ["--model.n_layers", str(depth)]


def lr_text(lr: float) -> str:
    return f"{lr:.3g}"


def lr_overrides(lr: float) -> list[str]:
    """The override that sets optim.lr to `lr`; the groups of optim.groups are multiples of it, so a sweep tunes
    one multiplier of all the recipe's LRs."""
    return ["--optim.lr", repr(lr)]


def run_sweep(
    recipe: Path,
    overrides: list[str],
    *,
    lrs: list[float],
    seeds: list[int],
    out_dir: Path,
    jobs: int = 1,
    log: Callable[[str], None] = print,
    resume: bool = False,
) -> list[SweepRun]:
    """Train every (LR, seed) as a `hopperlm train` process; each run's final validation loss from result.json.
    optim.groups' LRs follow each run's LR (they are multiples of it). `resume`: a run that finished
    before is kept as it is, the others go on from their checkpoints (or start). After a Ctrl-C the runs it
    stopped, or kept from starting, say so (`SweepRun.interrupted`)."""
    runs = [
        SweepRun(lr, seed, str(out_dir / f"lr-{lr_text(lr)}-seed-{seed}")) for lr in lrs for seed in seeds
    ]
    return train_runs(recipe, overrides, runs, jobs=jobs, log=log, resume=resume)


def train_runs(
    recipe: Path,
    overrides: list[str],
    runs: list[SweepRun],
    *,
    jobs: int = 1,
    log: Callable[[str], None] = print,
    resume: bool = False,
) -> list[SweepRun]:
    """Train each of `runs` (the recipe with `overrides`, the run's own `extra`, its LR and seed) as a `hopperlm
    train` process, `jobs` at a time; run_sweep's `resume` and Ctrl-C."""
    choice = threads_beside_load(os.cpu_count() or 1, jobs=jobs, what="the sweep")  # as `train` chooses
    threads = choice.count
    log(f"sweep: threads per run: {choice.why}")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}

    def train(run: SweepRun) -> SweepRun:
        if resume and finished_before(run):
            log(f"sweep: {run.name}: val {run.final_val_loss:.4f} (finished before)")
            return run
        cmd = [sys.executable, "-m", "hopperlm", "train", str(recipe), *overrides, *(run.extra or []), *lr_overrides(run.lr),
               "--train.seed", str(run.seed), "--run.out_dir", run.run_dir, "--log.report", "false",
               *(["--resume", "auto"] if resume else [])]  # fmt: skip
        run.threads = threads
        t0 = time.monotonic()
        proc = interrupt.start(cmd, env, warm=lambda: starter_for(env, lambda line: log(f"sweep: {line}")))
        if proc is None:
            run.error = NOT_STARTED
            return run
        stdout, stderr = wait_reporting(proc, Path(run.run_dir), run.name, log)
        interrupt.ended(proc)
        run.seconds = round(time.monotonic() - t0, 1)
        Path(run.run_dir).mkdir(parents=True, exist_ok=True)
        # a resumed run's log goes on after its first part's
        with open(Path(run.run_dir) / "sweep.log", "a" if resume else "w") as f:
            f.write(stdout + stderr)
        read_result(run, stdout + stderr, proc.returncode)
        log(f"sweep: {run.name}: {run_state(run)} ({run.seconds:.0f} s)")
        return run

    with SweepInterrupt(log) as interrupt, ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(train, runs))


def finished_before(run: SweepRun) -> bool:
    """The run's result.json says it ended by its budget (not a signal); its result is then read into `run`."""
    try:
        result = json.loads((Path(run.run_dir) / "result.json").read_text())
    except (OSError, ValueError):
        return False
    if str(result.get("stopped_by", "signal")).startswith("signal"):
        return False
    run.final_val_loss, run.stopped_by = result.get("val_loss"), result["stopped_by"]
    run.step = result.get("step")
    return True


def read_result(run: SweepRun, output: str, returncode: int) -> None:
    """How the run's process ended: its result.json (a run stopped by Ctrl-C has one too, but its loss is not a
    final one), else its last line of output."""
    try:
        result = json.loads((Path(run.run_dir) / "result.json").read_text())
        run.stopped_by, run.step = result.get("stopped_by"), result.get("step")
        run.final_val_loss = None if run.interrupted else result.get("val_loss")
        if not run.interrupted and str(run.stopped_by).startswith("signal"):  # a signal from elsewhere
            run.final_val_loss = None  # (its val loss is not a final one, perhaps from steps before)
            run.error = (
                f"stopped by {run.stopped_by} at step {run.step}; --resume goes on from its checkpoint"
            )
    except (OSError, ValueError):
        run.error = (last_line(output) or f"exit {returncode}")[:300]


def run_state(run: SweepRun) -> str:
    if run.interrupted:
        return f"stopped by Ctrl-C, step {run.step} saved" if run.step is not None else str(run.error)
    return f"val {run.final_val_loss:.4f}" if run.final_val_loss is not None else f"failed: {run.error}"


def interrupted_line(runs: list[SweepRun], again: str) -> str | None:
    """After a Ctrl-C: what finished, what was saved, and the command that goes on (`again`: the sweep's own,
    with --resume); None when no run was interrupted."""
    if not any(r.interrupted for r in runs):
        return None
    saved = [r for r in runs if r.stopped_by == "signal SIGINT"]
    waiting = sum(r.error == NOT_STARTED for r in runs)
    done = sum(not r.interrupted and r.final_val_loss is not None for r in runs)
    where = ", ".join(f"{r.name} at step {r.step}" for r in saved)
    return (
        f"sweep: stopped by Ctrl-C: {done} of {len(runs)} runs finished, {len(saved)} saved mid-run"
        f"{f' ({where})' if where else ''}, {waiting} not started; resume with: {again}"
    )


def model_params(model: ModelConfig, data: DataConfig) -> int:
    """The recipe's parameter count with the vocabulary its prepared data gives it (as `train` builds it)."""
    from hopperlm.data.train_data import resolve_datasets
    from hopperlm.model.transformer import count_params
    from hopperlm.train.data_and_plan import resolve_model_config

    vocab = resolve_datasets(data)[0].manifest["vocab_size"]
    return count_params(resolve_model_config(model, vocab))["total"]


def tokens_per_step(tc: TrainConfig) -> int:
    """Tokens per optimizer step as the recipe fixes them; ConfigError where the plan would choose them."""
    if tc.batch_tokens or tc.micro_batch:
        return tc.batch_tokens or tc.micro_batch * tc.seq_len
    raise ConfigError(
        "--widths: the recipe leaves train.batch_tokens and train.micro_batch to the plan, so the proxies' tokens "
        "per parameter cannot be set; give train.batch_tokens"
    )


def budget_tokens(tc: TrainConfig, target_tokens: int | None) -> int:
    """The training tokens of the run a forecast is for: --target-tokens, else the recipe's own budget."""
    if target_tokens:
        return target_tokens
    if tc.max_tokens:
        return tc.max_tokens
    if tc.max_steps and (tc.batch_tokens or tc.micro_batch):
        return tc.max_steps * tokens_per_step(tc)
    raise ConfigError(
        "--widths: the recipe's budget in tokens is not known (a train.max_hours budget, or no train.batch_tokens);"
        " give --target-tokens N, the tokens the big run will train on (`hopperlm diagnose RECIPE` says what its "
        "budget buys)"
    )


def run_widths(
    recipe: Path,
    overrides: list[str],
    *,
    widths: list[int],
    lr: float,
    seeds: list[int],
    tokens_per_param: float,
    out_dir: Path,
    jobs: int = 1,
    log: Callable[[str], None] = print,
    resume: bool = False,
) -> list[dict]:
    """The recipe at each width (proxy_overrides) and `lr`, trained for `tokens_per_param` tokens per parameter,
    every seed; a point per run: {width, params, seed, final_val_loss, steps, run_dir, interrupted} (loss None
    where it failed or a Ctrl-C stopped it; no width starts after a Ctrl-C). `resume`: run_sweep's."""
    from hopperlm.config import load_config

    points, model = [], load_config(recipe, overrides).model
    for width in widths:
        proxy = proxy_overrides(model, width)
        cfg = load_config(recipe, overrides + proxy)
        params = model_params(cfg.model, cfg.data)
        steps = max(1, round(tokens_per_param * params / tokens_per_step(cfg.train)))
        budget = ["--train.max_steps", str(steps), "--train.max_hours", "null", "--train.max_tokens", "null"]
        runs = run_sweep(recipe, overrides + proxy + budget, lrs=[lr], seeds=seeds, out_dir=out_dir / f"width-{width}",
                         jobs=jobs, log=lambda line, w=width: log(f"width {w}: {line}"), resume=resume)  # fmt: skip
        points += [
            {
                "width": width,
                "params": params,
                "seed": r.seed,
                "steps": steps,
                "final_val_loss": r.final_val_loss,
                "run_dir": str(r.run_dir),
                "interrupted": r.interrupted,
            }
            for r in runs
        ]
        if any(r.interrupted for r in runs):  # Ctrl-C: the widths after it never start
            break
    return points


def seed_mean(losses: list[float | None]) -> float:
    """The mean final validation loss over seeds; a failed or diverged seed (no finite loss) makes it infinite."""
    ok = all(v is not None and math.isfinite(v) for v in losses)
    return statistics.fmean(losses) if ok else math.inf


def best_lr(runs: list[SweepRun]) -> tuple[float | None, dict[float, float]]:
    """(the LR with the lowest final validation loss averaged over its seeds, {lr: that mean}); an LR with a
    failed or diverged seed (no finite loss) counts as infinitely bad."""
    means = {
        lr: seed_mean([r.final_val_loss for r in runs if r.lr == lr]) for lr in sorted({r.lr for r in runs})
    }
    finite = {lr: v for lr, v in means.items() if math.isfinite(v)}
    return (min(finite, key=finite.get) if finite else None), means


def table(runs: list[SweepRun], means: dict[float, float], best: float | None) -> list[str]:
    seeds = sorted({r.seed for r in runs})
    lines = [f"{'lr':>10}" + "".join(f"{'seed ' + str(s):>12}" for s in seeds) + f"{'mean':>10}"]
    for lr, mean in means.items():
        cells = []
        for seed in seeds:
            v = next(r.final_val_loss for r in runs if r.lr == lr and r.seed == seed)
            cells.append(f"{v:>12.4f}" if v is not None else f"{'failed':>12}")
        mark = "  <- best" if lr == best else ""
        lines.append(
            f"{lr_text(lr):>10}"
            + "".join(cells)
            + (f"{mean:>10.4f}" if math.isfinite(mean) else f"{'-':>10}")
            + mark
        )
    if best is not None and best in (min(means), max(means)):
        lines.append(
            f"warning: the best LR {lr_text(best)} is at the edge of the grid; extend --lr past it to be sure"
        )
    return lines


# what a tuned recipe keeps as the recipe wrote it: the sweep's budget and run folders are the proxy's, not the
# big run's (the proxy's width and depth never are overrides of the sweep: proxy_overrides adds them to each run)
RECIPE_KEEPS = {("train", "max_steps"), ("train", "max_tokens"), ("train", "max_hours"), ("run", "out_dir")}


def split_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(the overrides a tuned recipe holds, those it leaves to the proxy: budget and out_dir), each as arguments."""
    kept, left_out = [], []
    for section, key, text in override_items(overrides):
        (left_out if (section, key) in RECIPE_KEEPS else kept).extend([f"--{section}.{key}", text])
    return kept, left_out


def budget_text(tc: TrainConfig) -> str:
    """The run's budget in words, e.g. `20 steps (train.max_steps)`."""
    parts = [
        f"{value:,} {unit} (train.{key})"
        for key, unit in (("max_steps", "steps"), ("max_tokens", "tokens"), ("max_hours", "hours"))
        if (value := getattr(tc, key))
    ]
    return " or ".join(parts)


def proxy_note(
    *,
    dim: int,
    depth: int,
    train: TrainConfig,
    seeds: list[int],
    proxy: list[str],
    left_out: list[str],
    tuned: Path,
    out: Path,
) -> str:
    """The comment that names what the tuned recipe leaves to the proxy: its width and depth (`proxy`, its
    overrides), budget (`train`; `left_out`, the sweep's budget and out_dir overrides) and seeds, and how to run it again."""
    again = [
        f"--{section}.{key} {shlex.quote(text)}"
        for section, key, text in override_items([*proxy, *left_out])
        if (section, key) != ("run", "out_dir")
    ]
    return (
        f"sweep proxy: dim {dim}, depth {depth}, {budget_text(train)}, seeds {', '.join(map(str, seeds))}; see "
        f"{out}/sweep.json. This file holds the sweep's other overrides, and its own width, depth, budget and "
        "out_dir. A proxy run again:\n"
        f"  hopperlm train {tuned} {' '.join(again)} --train.seed {seeds[0]}"
    )


def config_differences(ours: dict, theirs: dict) -> list[str]:
    """The `section.key` names whose values differ between two configs' to_dict()."""
    return [
        f"{section}.{key}"
        for section in sorted(set(ours) | set(theirs))
        for key in sorted(set(ours.get(section) or {}) | set(theirs.get(section) or {}))
        if (ours.get(section) or {}).get(key) != (theirs.get(section) or {}).get(key)
    ]


def save_sweep(
    out_dir: Path, *, command: str, runs: list[SweepRun], means: dict[float, float], best, dim, depth
) -> None:
    record = {
        "command": command,
        "proxy_dim": dim,
        "proxy_depth": depth,
        "best_lr": best,
        "mean_final_val_loss": {lr_text(k): (v if math.isfinite(v) else None) for k, v in means.items()},
        "rows": [asdict(r) for r in runs],
    }
    write_atomic(out_dir / "sweep.json", json.dumps(record, indent=1))
