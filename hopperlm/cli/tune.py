"""`sweep`: tune optim.lr on a narrow (or shallow) proxy of a recipe, write the tuned recipe, and with --widths
forecast the recipe's final loss from narrower proxies trained at its tokens per parameter."""

from __future__ import annotations

import argparse
import contextlib
import math
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hopperlm.cli.common import add_verb, int_at_least, log, number, resolve_recipe, run_config
from hopperlm.errors import ConfigError
from hopperlm.files import write_atomic
from hopperlm.folder_lock import LOCK_NAME, hold_folder

if TYPE_CHECKING:  # (the CLI imports torch only when a verb needs it)
    from hopperlm.config import Config


@dataclass(frozen=True)
class SweepPlan:
    """A sweep checked before anything trains: the recipe, the user's overrides, those of every run (`extra`:
    the user's and the budget) and of the proxy's shape (`proxy`), the learning rates and seeds, --widths'
    forecast plan, and the folder."""

    recipe: Path
    cfg: Config
    overrides: list[str]  # the user's, as given (the forecast's big run)
    extra: list[str]
    proxy: list[str]
    lrs: list[float]
    seeds: list[int]
    widths: dict | None
    out: Path


def cmd_sweep(args: argparse.Namespace, overrides: list[str]) -> None:
    """Tune optim.lr on a narrow (or shallow) proxy of a μP recipe and write the recipe with the best one
    (train/sweep.py); with --mixture, the replay ratio of a continued-pretraining recipe (train/mixture_sweep.py)."""
    if args.mixture:
        cmd_mixture_sweep(args, overrides)
        return
    if not args.lr:
        raise ConfigError(
            "sweep: give --lr A,B,C (the learning rates to tune) or --mixture DATASET=r1,r2,... (the replay ratio)"
        )
    plan = plan_sweep(args, overrides)
    with sweep_folder(plan.out, resume=args.resume):
        run_planned_sweep(args, plan)


@contextlib.contextmanager
def sweep_folder(out: Path, *, resume: bool):
    """One sweep per folder for its whole life: held while it runs, and a second one into a folder with runs is
    refused before it writes anything (unless it resumes them)."""
    with hold_folder(out, what="--out", log=log):
        if not resume and any(p.name != LOCK_NAME for p in out.iterdir()):
            raise ConfigError(
                f"{out} exists and is not empty; choose another --out (a sweep never overwrites runs), or "
                "add --resume to go on with a sweep stopped there"
            )
        yield


def parsed_widths(text: str) -> list[int]:
    """--widths W1,W2,...: the widths, sorted and distinct (ConfigError: one line, for anything not a number)."""
    try:
        return sorted({int(w) for w in text.split(",") if w.strip()})
    except ValueError:
        raise ConfigError(f"--widths {text!r}: write widths separated by commas, e.g. 64,128,256") from None


def stopped_by_ctrl_c(line: str | None) -> None:
    """A Ctrl-C stopped the sweep's runs (each saved its step): the line that says how to go on, exit 130."""
    if line is not None:
        log(line)
        sys.exit(130)


def resume_command() -> str:
    """The sweep's own command line, with --resume: what goes on after a Ctrl-C."""
    argv = sys.argv[1:]
    return shlex.join(["hopperlm", *argv, *([] if "--resume" in argv else ["--resume"])])


def plan_sweep(args: argparse.Namespace, overrides: list[str]) -> SweepPlan:
    from hopperlm.train import sweep

    recipe = resolve_recipe(args.config)
    lrs = sweep.parse_lrs(args.lr)
    extra = list(overrides)
    if args.max_steps is not None:
        extra += ["--train.max_steps", str(args.max_steps), "--train.max_hours", "null"]
    if args.max_hours is not None:
        extra += ["--train.max_hours", str(args.max_hours), "--train.max_steps", "null"]
    cfg = run_config(str(recipe), extra)
    if not cfg.sft.path:  # the data is read before anything trains: a mistake is one line, not failed runs
        from hopperlm.data.train_data import resolve_datasets

        resolve_datasets(cfg.data)
    proxy = sweep.proxy_overrides(cfg.model, args.dim, args.depth)
    run_config(str(recipe), extra + proxy)  # the proxy is a valid config before anything trains
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [cfg.train.seed]
    widths = forecast_widths(args, recipe, list(overrides)) if args.widths else None
    out = Path(args.out or f"runs/sweep-{recipe.stem}")
    return SweepPlan(recipe, cfg, list(overrides), extra, proxy, lrs, seeds, widths, out)


def run_planned_sweep(args: argparse.Namespace, plan: SweepPlan) -> None:
    """The sweep itself, into the folder `cmd_sweep` holds: the runs, sweep.json, the plots, the tuned recipe,
    and with --widths the forecast's proxies."""
    from hopperlm.observe.plot import plot_runs
    from hopperlm.train import recipe_edit, sweep

    recipe, cfg, extra, proxy, lrs, seeds, widths, out = (
        plan.recipe, plan.cfg, plan.extra, plan.proxy, plan.lrs, plan.seeds, plan.widths, plan.out
    )  # fmt: skip
    dim, depth = args.dim or cfg.model.dim, args.depth or cfg.model.n_layers
    log(f"sweep: {recipe.name} at width {dim}, {depth} blocks (the recipe's: {cfg.model.dim}, {cfg.model.n_layers}), "
        f"lr {', '.join(map(sweep.lr_text, lrs))}, seeds {', '.join(map(str, seeds))}, {args.jobs} at a time -> {out}")  # fmt: skip
    if cfg.optim.groups:
        log(
            "sweep: "
            + ", ".join(
                f"optim.groups '{g.pattern}' moves with optim.lr ({g.lr:g} x it)" for g in cfg.optim.groups
            )
        )
    runs = sweep.run_sweep(recipe, extra + proxy, lrs=lrs, seeds=seeds, out_dir=out, jobs=args.jobs, log=log,
                           resume=args.resume)  # fmt: skip
    stopped_by_ctrl_c(sweep.interrupted_line(runs, resume_command()))
    best, means = sweep.best_lr(runs)
    command = "hopperlm " + " ".join(sys.argv[1:])
    sweep.save_sweep(out, command=command, runs=runs, means=means, best=best, dim=dim, depth=depth)
    finished = [r.run_dir for r in runs if (Path(r.run_dir) / "metrics.jsonl").is_file()]
    if finished:
        plot_runs([Path(r) for r in finished], out / "plots")
    log("")
    for line in sweep.table(runs, means, best):
        log(line)
    if best is None:
        raise ConfigError(
            f"no learning rate finished with a finite validation loss; each run's log is {out}/*/sweep.log"
        )
    note = (
        f"optim.lr {sweep.lr_text(best)}: the best of {', '.join(map(sweep.lr_text, lrs))} on a width-{dim}, "
        f"depth-{depth} proxy "
        f"(mean final val loss {means[best]:.4f} over seeds {', '.join(map(str, seeds))}): `{command}`, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    # the file alone trains what the sweep tuned: every override of the runs but the proxy's width, depth, budget
    # and out_dir (the recipe's stay), with comments naming the sweep and the proxy
    kept, left_out = sweep.split_overrides(extra)
    tuned = out / f"{recipe.stem}.tuned.yaml"
    note += "\n" + sweep.proxy_note(
        dim=dim,
        depth=depth,
        train=cfg.train,
        seeds=seeds,
        proxy=proxy,
        left_out=left_out,
        tuned=tuned,
        out=out,
    )
    text = recipe_edit.tuned_recipe_text(recipe.read_text(), lr=best, overrides=kept, note=note)
    write_atomic(tuned, text)  # kept whatever the forecast's runs do
    ran = run_config(str(recipe), [*extra, *proxy, *sweep.lr_overrides(best)]).to_dict()
    again = run_config(str(tuned), [*proxy, *left_out]).to_dict()
    if differ := sweep.config_differences(again, ran):
        log(f"warning: {tuned} at the proxy's width and budget differs from the sweep's runs in {', '.join(differ)}; "
            f"set them as {out}/*/config.yaml has them")  # fmt: skip
    if widths:
        saved = forecast_big_run(
            recipe, plan.overrides, widths, lr=best, seeds=seeds, out=out, jobs=args.jobs, resume=args.resume
        )
        text = recipe_edit.set_key(
            text, "train", "forecast_from", str(saved.resolve()), comment=f"`{command}`"
        )
        tuned = write_atomic(tuned, text)
    log(f"best lr {sweep.lr_text(best)}; the recipe with it: {tuned} ({out}/sweep.json, {out}/plots)")


def forecast_widths(args: argparse.Namespace, recipe: Path, overrides: list[str]) -> dict:
    """--widths checked before anything trains: at least three proxies, each narrower than the recipe and a
    valid proxy of it, and the big run's budget in tokens known; {widths, tokens, params, tokens_per_param}."""
    from hopperlm.observe.width_forecast import MIN_WIDTHS
    from hopperlm.train import sweep

    widths = parsed_widths(args.widths)
    target = run_config(str(recipe), overrides)  # the big run as the recipe says, not the LR sweep's budget
    if len(widths) < MIN_WIDTHS or widths[-1] >= target.model.dim:
        raise ConfigError(
            f"--widths {args.widths!r}: give at least {MIN_WIDTHS} widths, all narrower than the recipe's "
            f"model.dim {target.model.dim}, e.g. {target.model.dim // 8},{target.model.dim // 4},{target.model.dim // 2}"
        )
    for w in widths:
        run_config(str(recipe), overrides + sweep.proxy_overrides(target.model, w))
    tokens = sweep.budget_tokens(target.train, args.target_tokens)
    sweep.tokens_per_step(target.train)
    params = sweep.model_params(target.model, target.data)
    return {"widths": widths, "tokens": tokens, "params": params, "tokens_per_param": tokens / params}


def forecast_big_run(
    recipe: Path, overrides: list[str], plan: dict, *, lr: float, seeds, out: Path, jobs: int, resume: bool
):
    """Train the proxies of `plan` at the best LR and the big run's tokens per parameter, and forecast its final
    validation loss (observe/width_forecast.py); the forecast's file. `resume`: run_sweep's."""
    from hopperlm.observe.collapse import curve_of_run
    from hopperlm.observe.width_forecast import forecast
    from hopperlm.train import sweep

    log(f"forecast: widths {', '.join(map(str, plan['widths']))} at lr {sweep.lr_text(lr)} and "
        f"{plan['tokens_per_param']:.3g} tokens per parameter (the recipe's {plan['tokens']:,} tokens / "
        f"{plan['params']:,} parameters)")  # fmt: skip
    points = sweep.run_widths(recipe, overrides, widths=plan["widths"], lr=lr, seeds=seeds,
                              tokens_per_param=plan["tokens_per_param"], out_dir=out, jobs=jobs, log=log,
                              resume=resume)  # fmt: skip
    if any(p["interrupted"] for p in points):  # the LR sweep and the tuned recipe are complete
        stopped_by_ctrl_c(f"sweep: stopped by Ctrl-C while training the widths' proxies (each run in progress "
                          f"saved its step); resume with: {resume_command()}")  # fmt: skip
    result = forecast(points, target_params=plan["params"], tokens_per_param=plan["tokens_per_param"])
    # the whole curves too: `hopperlm forecast RUN --proxies OUT` shapes the big run's forecast with them
    result.curves = [
        curve_of_run(Path(p["run_dir"]), label=f"width-{p['width']} seed {p['seed']}").to_dict()
        for p in points
        if p["final_val_loss"] is not None
    ]
    path = out / "forecast.json"
    result.save(path)
    log(result.line())
    return path


def max_forgetting(text: str | None) -> float | None:
    """--max-forgetting 3% or 0.03 -> 0.03."""
    if text is None:
        return None
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        value = math.nan
    if not -1 < value < 10:  # (a negative limit asks the replayed loss to fall below the base's)
        raise ConfigError(
            f"--max-forgetting {text!r}: write the replayed language's allowed rise over the base's loss, e.g. 3% "
            "or 0.03"
        )
    return value


def cmd_mixture_sweep(args: argparse.Namespace, overrides: list[str]) -> None:
    """The replay ratio of a continued-pretraining recipe on μP proxies of its base (train/mixture_sweep.py),
    fitted by observe/mixture_law.py: OUT/mixture.json and, with --max-forgetting, OUT/RECIPE.tuned.yaml."""
    from hopperlm.train import mixture_sweep

    given = [flag for flag, value in (("--lr", args.lr), ("--dim", args.dim), ("--depth", args.depth),
             ("--max-steps", args.max_steps), ("--max-hours", args.max_hours)) if value is not None]  # fmt: skip
    if given:
        raise ConfigError(
            f"sweep --mixture: drop {', '.join(given)}: its runs take the recipe's LR and budget, its proxies the "
            "--widths"
        )
    if not args.widths:
        raise ConfigError(
            "sweep --mixture needs --widths W1,W2,W3 (at least 3 proxy widths, narrower than the base)"
        )
    widths = parsed_widths(args.widths)
    recipe = resolve_recipe(args.config)
    plan = mixture_sweep.plan_mixture(
        recipe, list(overrides), spec=args.mixture, widths=widths,
        seeds=[int(s) for s in args.seeds.split(",")] if args.seeds else None, base_lr=args.base_lr,
        base_tokens_per_param=args.base_tokens_per_param, max_rise=max_forgetting(args.max_forgetting),
        target_tokens=args.target_tokens, out=Path(args.out or f"runs/sweep-{recipe.stem}"),
        config=lambda extra: run_config(str(recipe), extra),
    )  # fmt: skip
    with sweep_folder(plan.out, resume=args.resume):
        run_mixture_sweep(args, plan)


def run_mixture_sweep(args: argparse.Namespace, plan) -> None:
    """The bases, the continued pretraining, the table, the law and (with a limit) the tuned recipe."""
    from hopperlm.observe import mixture_law
    from hopperlm.train import mixture_sweep, sweep

    replay = plan.names[plan.replay]
    log(f"sweep --mixture: {plan.recipe.name}: {replay} at {', '.join(map(mixture_sweep.ratio_text, plan.ratios))} "
        f"of the mixture, widths {', '.join(map(str, plan.widths))}, seeds {', '.join(map(str, plan.seeds))}; bases "
        f"at lr {sweep.lr_text(plan.base_lr)} and {plan.base_tokens_per_param:g} tokens per parameter, continued at "
        f"lr {sweep.lr_text(plan.lr)} for {plan.tokens:,} tokens; {args.jobs} at a time -> {plan.out}")  # fmt: skip
    bases = sweep.train_runs(plan.recipe, plan.overrides, mixture_sweep.base_runs(plan), jobs=args.jobs, log=log,
                             resume=args.resume)  # fmt: skip
    stopped_by_ctrl_c(sweep.interrupted_line(bases, resume_command()))
    base_rows = mixture_sweep.base_rows(plan, bases)
    runs = sweep.train_runs(plan.recipe, plan.overrides, mixture_sweep.continued_runs(plan), jobs=args.jobs,
                            log=log, resume=args.resume)  # fmt: skip
    stopped_by_ctrl_c(sweep.interrupted_line(runs, resume_command()))
    rows = mixture_sweep.result_rows(plan, runs, base_rows)
    log("")
    for line in mixture_sweep.table(rows, plan):
        log(line)
    forecast = mixture_law.fit(rows, base_rows, replay=replay, targets=plan.targets, grid=plan.ratios,
                               target_params=plan.target_params, tokens=plan.tokens, max_rise=plan.max_rise)  # fmt: skip
    for line in forecast.table():
        log(line)
    if plan.max_rise is not None and forecast.recommended is None:
        raise ConfigError(
            f"--max-forgetting {plan.max_rise:.1%}: no ratio of the grid keeps {replay}'s predicted rise within it at "
            f"{plan.target_params:,} parameters; the smallest, {forecast.closest['replay_rise']:+.2%}, is at ratio "
            f"{mixture_sweep.ratio_text(forecast.closest['ratio'])}: add larger ratios or allow more forgetting"
        )
    saved = plan.out / "mixture.json"
    forecast.save(saved)
    if plan.max_rise is None:
        log(f"the law and its runs: {saved}; add --max-forgetting (e.g. 3%) for the ratio to train with")
        return
    command = "hopperlm " + " ".join(sys.argv[1:])
    note = mixture_sweep.recommendation_note(plan, forecast, command=command, saved=saved,
                                             date=time.strftime("%Y-%m-%d"))  # fmt: skip
    tuned = plan.out / f"{plan.recipe.stem}.tuned.yaml"
    write_atomic(tuned, mixture_sweep.tuned_mixture_text(plan.recipe.read_text(), plan, forecast, note=note,
                                                         saved=saved))  # fmt: skip
    log(f"recommended: {replay} at {mixture_sweep.ratio_text(forecast.recommended)} of the mixture (predicted rise "
        f"at most {plan.max_rise:.1%}); the recipe with it: {tuned} ({saved})")  # fmt: skip


def add_sweep_parser(verbs, common: argparse.ArgumentParser, recipe: str) -> None:
    p = add_verb(
        verbs,
        common,
        "sweep",
        cmd_sweep,
        "tune optim.lr of a mup recipe on a narrow proxy (or, with --mixture, the replay ratio of continued "
        "pretraining); write the tuned recipe",
        overrides="the recipe (every run), e.g. --train.eval_every 50",
        config=recipe,
    )
    p.add_argument("--lr", help="learning rates, comma-separated (at least 3, e.g. 1e-3,2e-3,4e-3)")
    p.add_argument(
        "--mixture",
        metavar="DATASET=R1,R2,...",
        help="instead of --lr: the replay ratio of a continued-pretraining recipe, DATASET's share of data.mixture "
        "(at least 3 in [0, 1)), on μP proxies of its base at --widths",
    )
    p.add_argument(
        "--base-lr",
        type=number(float, low=0, low_open=True),
        help="--mixture: the LR the base's proxies are pretrained at (on DATASET alone)",
    )
    p.add_argument(
        "--base-tokens-per-param",
        type=number(float, low=0, low_open=True),
        default=20.0,
        help="--mixture: the base proxies' pretraining tokens per parameter (default 20)",
    )
    p.add_argument(
        "--max-forgetting",
        help="--mixture: DATASET's loss may rise at most this much over the base's (e.g. 3%%); writes the tuned "
        "recipe with the ratio that minimises the new language's predicted loss within it",
    )
    p.add_argument("--dim", type=int_at_least(1), help="the proxy's width (default: the recipe's)")
    p.add_argument(
        "--depth",
        type=int_at_least(1),
        help="the proxy's number of blocks, under model.depth_parametrization completep (default: the recipe's)",
    )
    p.add_argument("--seeds", help="train.seed values, comma-separated (default: the recipe's)")
    p.add_argument(
        "--max-steps", type=int_at_least(1), help="each run's budget in steps (instead of the recipe's)"
    )
    p.add_argument(
        "--max-hours",
        type=number(float, low=0, low_open=True),
        help="each run's wall-clock budget (instead of the recipe's)",
    )
    p.add_argument("--jobs", type=int_at_least(1), default=1, help="runs side by side (default 1)")
    p.add_argument("--out", help="sweep folder (default runs/sweep-RECIPE)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="go on with a sweep stopped (Ctrl-C) in --out: finished runs are kept, interrupted ones resume "
        "from their checkpoints, the rest start",
    )
    p.add_argument(
        "--widths",
        help="then train the recipe at these narrower widths (at least 3, comma-separated) at the best LR and "
        "the recipe's tokens per parameter, and forecast its final loss (train.forecast_from in the tuned recipe); "
        "with --mixture: the widths of the base's proxies",
    )
    p.add_argument(
        "--target-tokens",
        type=int_at_least(1),
        help="--widths: the big run's training tokens, where its budget is in hours",
    )
