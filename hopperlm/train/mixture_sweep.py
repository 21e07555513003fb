"""`hopperlm sweep RECIPE --mixture DATASET=r1,r2,... --widths W1,W2,W3 --base-lr LR`: how much of its old language
a continued-pretraining recipe should replay, tuned on μP proxies of its base.

The recipe continues model.init_from (the base) on data.mixture; DATASET is the replayed dataset (the base's
language) and the other datasets are the new language. A ratio r is DATASET's share of the training mixture, the
other datasets sharing 1 - r in their own proportions (r = 0: DATASET weighs 0, validated and never trained on).

1. Bases: for each width, the base's shape at that width under μP (heads of the same size; model.base_dim the
   base's own if it is mup, else the recipe's width, where mup is the base's standard exactly) is pretrained on
   DATASET alone (the new language in the mixture at weight 0), at the recipe's batch and schedule, --base-lr and
   --base-tokens-per-param; its final evaluation is the base's own loss on both languages before continued
   pretraining (OUT/bases/width-W).
2. Continued pretraining: for each width, ratio and seed, the recipe continues that base (its model.init_from) at
   the recipe's LR, for as many steps as give it the recipe's epochs of the new language at that ratio (the
   recipe's budget times 1 - r over the new language's training tokens): it trains the recipe's tokens
   (OUT/width-W/ratio-R/seed-S). Its final loss on each dataset, and the rise of DATASET's over its base's, are a
   row of the result.
observe/mixture_law.py fits the law to the rows and predicts the recipe's own run; cli/tune.py writes OUT/mixture.json
and, with --max-forgetting, the tuned recipe. Every run is a `hopperlm train` process of train/sweep.py's
`train_runs`: --jobs, --resume and Ctrl-C behave as for an LR sweep.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hopperlm.config import Config, ModelConfig, load_config
from hopperlm.data.tokenizer import load_tokenizer
from hopperlm.data.train_data import Dataset, resolve_datasets
from hopperlm.errors import ConfigError
from hopperlm.train import recipe_edit, sweep
from hopperlm.train.initial_model import base_tokenizer, check_tokenizer_fits
from hopperlm.train.sweep import SweepRun

MIN_RATIOS = 3  # the law's ratio term has three numbers
MIN_WIDTHS = 3  # and its size term three (observe/mixture_law.py)
NOT_A_SHAPE = (
    "preset",
    "init_from",
    "vocab_size",
)  # a base proxy has no preset or checkpoint; its vocabulary: the data's


@dataclass(frozen=True)
class MixturePlan:
    """A mixture sweep checked before anything trains (plan_mixture)."""

    recipe: Path
    overrides: list[str]  # the user's: every run's, and the tuned recipe's
    mixture: dict[str, float]  # the recipe's data.mixture as written (path: weight)
    replay: str  # DATASET's path as the mixture writes it
    names: dict[str, str]  # path -> the name its val loss goes by
    ratios: list[float]
    widths: list[int]
    seeds: list[int]
    lr: float  # the recipe's optim.lr: every continued-pretraining run's
    base_lr: float
    base_tokens_per_param: float
    base_model: ModelConfig  # the base's shape under μP at its own width
    tokens: int  # the recipe's training tokens
    tokens_per_step: int
    target_tokens: int  # the new language's training tokens, all its datasets
    target_params: int  # the recipe's model's parameters
    base_seed: int
    max_rise: float | None
    out: Path

    @property
    def targets(self) -> dict[str, float]:
        """The new language's datasets by name, each with its share of the new language's part."""
        others = {p: w for p, w in self.mixture.items() if p != self.replay}
        total = sum(others.values())
        return {self.names[p]: w / total for p, w in others.items()}


def parse_mixture(text: str, mixture: dict[str, float]) -> tuple[str, list[float]]:
    """`DATASET=r1,r2,...` -> (DATASET's path as the mixture writes it, the ratios sorted); DATASET may be given
    as written in data.mixture or by its folder's name."""
    name, eq, values = text.partition("=")
    if not eq or not name.strip():
        raise ConfigError(f"--mixture {text!r}: write DATASET=r1,r2,... e.g. data/eng=0,0.05,0.1,0.25")
    found = [p for p in mixture if name.strip() in (p, Path(p).name, str(Path(p)))]
    if not found:
        raise ConfigError(
            f"--mixture {name.strip()}: not a dataset of the recipe's data.mixture ({', '.join(mixture)}); name the "
            "replayed one as the mixture writes it"
        )
    try:
        ratios = sorted({float(v) for v in values.split(",") if v.strip()})
    except ValueError:
        raise ConfigError(
            f"--mixture {text!r}: write ratios as numbers separated by commas, e.g. 0,0.05,0.1"
        ) from None
    bad = [r for r in ratios if not 0 <= r < 1]
    if bad:
        raise ConfigError(
            f"--mixture {text!r}: ratio {bad[0]:g} is outside [0, 1); a ratio is {Path(found[0]).name}'s share of "
            "the training mixture (0: not replayed at all; below 1: the new language keeps a share)"
        )
    if len(ratios) < MIN_RATIOS:
        raise ConfigError(
            f"--mixture {text!r}: give at least {MIN_RATIOS} distinct ratios, e.g. 0,0.05,0.1,0.25"
        )
    return found[0], ratios


def mixture_at(mixture: dict[str, float], replay: str, ratio: float) -> dict[str, float]:
    """data.mixture with `replay` at share `ratio` and the other datasets sharing 1 - ratio as the recipe
    weighs them."""
    others = sum(w for p, w in mixture.items() if p != replay)
    return {p: round(ratio if p == replay else (1 - ratio) * w / others, 6) for p, w in mixture.items()}


def base_shape(model: ModelConfig) -> ModelConfig:
    """The base's shape (model.init_from resolved) as a model trained from scratch under μP: the base's base_dim
    if it is mup, else its own width (mup at base_dim is standard exactly: the proxies then transfer to it)."""
    if model.parametrization == "mup":
        return dataclasses.replace(model, init_from=None, preset=None, vocab_size=None)
    return dataclasses.replace(
        model, init_from=None, preset=None, vocab_size=None, parametrization="mup", base_dim=model.dim
    )


def override_text(value) -> str:
    return json.dumps(value) if isinstance(value, dict | list | bool) or value is None else str(value)


def model_overrides(model: ModelConfig, width: int) -> list[str]:
    """The --model.* overrides that train `model` (a base_shape) from scratch at `width`."""
    values = {k: v for k, v in dataclasses.asdict(model).items() if k not in NOT_A_SHAPE}
    proxy = sweep.proxy_overrides(model, width)
    values.update({arg[len("--model.") :]: text for arg, text in zip(proxy[::2], proxy[1::2], strict=True)})
    out = ["--model.init_from", "null", "--model.preset", "null", "--model.vocab_size", "null"]
    for key, value in values.items():
        out += [f"--model.{key}", value if isinstance(value, str) else override_text(value)]
    return out


def budget(steps: int) -> list[str]:
    return ["--train.max_steps", str(steps), "--train.max_tokens", "null", "--train.max_hours", "null"]


def base_overrides(
    model: ModelConfig, mixture: dict[str, float], replay: str, *, width: int, steps: int
) -> list[str]:
    """A base proxy of `model` (a base_shape) at `width`: `replay` alone (the other datasets of `mixture`
    validated, weight 0), `steps` steps, evaluated at the end only, no embedding warm-up (it has no base)."""
    data = {p: (1.0 if p == replay else 0.0) for p in mixture}
    return [*model_overrides(model, width), "--data.mixture", json.dumps(data), "--data.mixture_forecast", "null",
            *budget(steps), "--train.embed_warmup_steps", "0", "--train.target_loss", "null",
            "--train.eval_every", "0"]  # fmt: skip


def plan_base_overrides(plan: MixturePlan, width: int, steps: int) -> list[str]:
    return base_overrides(plan.base_model, plan.mixture, plan.replay, width=width, steps=steps)


def base_steps(params: int, tokens_per_param: float, tokens_per_step: int) -> int:
    return max(1, round(tokens_per_param * params / tokens_per_step))


def epochs_of_target(plan: MixturePlan, ratio: float, steps: int) -> float:
    """The new language's epochs in `steps` steps at `ratio`."""
    return (1 - ratio) * steps * plan.tokens_per_step / plan.target_tokens


def continued_steps(plan: MixturePlan, ratio: float) -> int:
    """Steps that give a proxy the recipe's epochs of the new language at `ratio` (the proxies keep the recipe's
    batch, so these are the recipe's own steps)."""
    epochs = (1 - ratio) * plan.tokens / plan.target_tokens
    return max(1, math.ceil(epochs * plan.target_tokens / ((1 - ratio) * plan.tokens_per_step) - 1e-9))


def continued_overrides(
    mixture: dict[str, float], replay: str, *, ratio: float, base_dir: Path, steps: int
) -> list[str]:
    """Continued pretraining of the base in `base_dir` with `replay` at share `ratio`, for `steps` steps."""
    return ["--model.init_from", str(base_dir), "--data.mixture", json.dumps(mixture_at(mixture, replay, ratio)),
            "--data.mixture_forecast", "null", *budget(steps)]  # fmt: skip


def plan_continued_overrides(plan: MixturePlan, ratio: float, base_dir: Path) -> list[str]:
    return continued_overrides(
        plan.mixture, plan.replay, ratio=ratio, base_dir=base_dir, steps=continued_steps(plan, ratio)
    )


def ratio_text(ratio: float) -> str:
    return f"{ratio:.4g}"


def check_data(init_from: str, replay: str, datasets: list[Dataset], max_rise: float | None) -> None:
    """The tokenizer of the data is the base's (`init_from`'s, or an extension of it) and every dataset has a
    validation split: the law fits the final loss of each."""
    check_tokenizer_fits(
        init_from, base_tokenizer(init_from), load_tokenizer(datasets[0].path), "the recipe's data"
    )
    for d in datasets:
        if d.manifest["tokens"].get("val", 0) <= 0:
            why = (
                f"--max-forgetting {max_rise:.3g} cannot be held"
                if max_rise is not None and str(d.path) == str(Path(replay))
                else "its loss, which the law fits, cannot be measured"
            )
            raise ConfigError(
                f"--mixture: {d.path} has no validation split, so {why}; re-prepare it with --val-fraction above 0"
            )


def plan_mixture(
    recipe: Path,
    overrides: list[str],
    *,
    spec: str,
    widths: list[int],
    seeds: list[int] | None,
    base_lr: float | None,
    base_tokens_per_param: float,
    max_rise: float | None,
    target_tokens: int | None,
    out: Path,
    config: Callable[[list[str]], Config],
) -> MixturePlan:
    """Every check a mixture sweep makes before anything trains (ConfigError / DataError: one line, nothing
    written). `config(overrides)`: the recipe with them and model.init_from resolved (cli/common.py's)."""
    cfg = config(overrides)
    if not cfg.model.init_from:
        raise ConfigError(
            "--mixture tunes the replay of continued pretraining: the recipe needs model.init_from (the base)"
        )
    mixture = dict(cfg.data.mixture or {cfg.data.path: 1.0})
    replay, ratios = parse_mixture(spec, mixture)
    if len(mixture) < 2:
        raise ConfigError(
            f"--mixture {Path(replay).name}: the recipe's data has no other dataset (the new language) beside it; "
            "list both in data.mixture"
        )
    if base_lr is None or base_lr <= 0:
        raise ConfigError("--mixture needs --base-lr LR (> 0): the LR the base proxies are pretrained at")
    datasets = resolve_datasets(cfg.data)
    check_data(cfg.model.init_from, replay, datasets, max_rise)
    model = base_shape(cfg.model)
    if len(widths) < MIN_WIDTHS or widths[-1] >= model.dim:
        raise ConfigError(
            f"--widths {','.join(map(str, widths))}: give at least 3 widths, all narrower than the base's "
            f"model.dim {model.dim}"
        )
    names = {str(p): d.name for p, d in zip(mixture, datasets, strict=True)}
    targets = [d for p, d in zip(mixture, datasets, strict=True) if p != replay]
    plan = MixturePlan(
        recipe=recipe, overrides=overrides, mixture=mixture, replay=replay, names=names, ratios=ratios,
        widths=widths, seeds=seeds or [cfg.train.seed], lr=cfg.optim.lr, base_lr=base_lr,
        base_tokens_per_param=base_tokens_per_param, base_model=model,
        tokens=sweep.budget_tokens(cfg.train, target_tokens), tokens_per_step=sweep.tokens_per_step(cfg.train),
        target_tokens=sum(d.manifest["tokens"]["train"] for d in targets),
        target_params=sweep.model_params(cfg.model, cfg.data), base_seed=cfg.train.seed, max_rise=max_rise, out=out,
    )  # fmt: skip
    for width in widths:  # each proxy and its continued pretraining is a valid config before anything trains
        load_config(recipe, [*overrides, *plan_base_overrides(plan, width, 1)])
        load_config(
            recipe, [*overrides, *plan_continued_overrides(plan, ratios[0], out / "bases" / f"width-{width}")]
        )
    return plan


def proxy_params(plan: MixturePlan, width: int) -> int:
    cfg = load_config(plan.recipe, [*plan.overrides, *plan_base_overrides(plan, width, 1)])
    return sweep.model_params(cfg.model, cfg.data)


def base_runs(plan: MixturePlan) -> list[SweepRun]:
    """One base proxy per width, at the base's tokens per parameter."""
    runs = []
    for width in plan.widths:
        steps = base_steps(proxy_params(plan, width), plan.base_tokens_per_param, plan.tokens_per_step)
        runs.append(SweepRun(plan.base_lr, plan.base_seed, str(plan.out / "bases" / f"width-{width}"),
                             label=f"base width {width}", extra=plan_base_overrides(plan, width, steps)))  # fmt: skip
    return runs


def continued_runs(plan: MixturePlan) -> list[SweepRun]:
    """Every (width, ratio, seed) of continued pretraining, from its width's base."""
    runs = []
    for width in plan.widths:
        base = plan.out / "bases" / f"width-{width}"
        for ratio in plan.ratios:
            for seed in plan.seeds:
                where = plan.out / f"width-{width}" / f"ratio-{ratio_text(ratio)}" / f"seed-{seed}"
                label = f"width {width} ratio {ratio_text(ratio)} seed {seed}"
                runs.append(
                    SweepRun(
                        plan.lr,
                        seed,
                        str(where),
                        label=label,
                        extra=plan_continued_overrides(plan, ratio, base),
                    )
                )
    return runs


def final_losses(run_dir: Path) -> dict[str, float]:
    """Each dataset's loss at the run's last evaluation (metrics.jsonl); {} where it has none."""
    from hopperlm.observe.metrics import read_metrics

    path = Path(run_dir) / "metrics.jsonl"
    evals = [r for r in read_metrics(path) if "val_loss" in r] if path.is_file() else []
    if not evals:
        return {}
    last = evals[-1]
    return dict(last.get("val_losses") or {"": last["val_loss"]})


def base_rows(plan: MixturePlan, runs: list[SweepRun]) -> list[dict]:
    """{width, params, replay_loss, target_loss} of each base that finished; ConfigError naming a failed one."""
    from hopperlm.observe.mixture_law import target_loss

    rows = []
    for width, run in zip(plan.widths, runs, strict=True):
        losses = final_losses(Path(run.run_dir))
        replay = losses.get(plan.names[plan.replay])
        if run.final_val_loss is None or replay is None or not math.isfinite(replay):
            raise ConfigError(
                f"the base proxy at width {width} did not finish with a validation loss ({sweep.run_state(run)}); "
                f"its log is {run.run_dir}/sweep.log"
            )
        rows.append({"width": width, "params": proxy_params(plan, width), "replay_loss": replay,
                     "target_loss": target_loss(losses, plan.targets), "steps": run.step, "run_dir": run.run_dir})  # fmt: skip
    return rows


def result_rows(plan: MixturePlan, runs: list[SweepRun], bases: list[dict]) -> list[dict]:
    """The issue's rows: {width, params, ratio, seed, target_loss, replay_loss, replay_rise, tokens,
    epochs_of_target} of every continued-pretraining run (losses None where it failed)."""
    from hopperlm.observe.mixture_law import target_loss

    base = {b["width"]: b for b in bases}
    rows, it = [], iter(runs)
    for width in plan.widths:
        for ratio in plan.ratios:
            steps = continued_steps(plan, ratio)
            for seed in plan.seeds:
                run = next(it)
                losses = final_losses(Path(run.run_dir)) if run.final_val_loss is not None else {}
                replay = losses.get(plan.names[plan.replay])
                rows.append({
                    "width": width, "params": base[width]["params"], "ratio": ratio, "seed": seed,
                    "target_loss": target_loss(losses, plan.targets), "replay_loss": replay,
                    "replay_rise": None if replay is None else replay / base[width]["replay_loss"] - 1,
                    "tokens": steps * plan.tokens_per_step, "epochs_of_target": epochs_of_target(plan, ratio, steps),
                    "run_dir": run.run_dir, "error": run.error,
                })  # fmt: skip
    return rows


def table(rows: list[dict], plan: MixturePlan) -> list[str]:
    """Mean over seeds of each (width, ratio): the new language's loss, the replayed one's and its rise."""
    replay = plan.names[plan.replay]
    lines = [f"{'width':>6}{'ratio':>8}{'new language':>14}{replay[:12]:>14}{'rise':>9}{'epochs':>8}"]
    for width in plan.widths:
        for ratio in plan.ratios:
            cell = [r for r in rows if r["width"] == width and r["ratio"] == ratio]
            ok = [r for r in cell if r["target_loss"] is not None and r["replay_loss"] is not None]
            if len(ok) < len(cell) or not ok:
                lines.append(f"{width:>6}{ratio_text(ratio):>8}{'failed':>14}")
                continue
            mean = {
                k: statistics.fmean(r[k] for r in ok) for k in ("target_loss", "replay_loss", "replay_rise")
            }
            lines.append(
                f"{width:>6}{ratio_text(ratio):>8}{mean['target_loss']:>14.4f}{mean['replay_loss']:>14.4f}"
                f"{mean['replay_rise']:>+9.2%}{ok[0]['epochs_of_target']:>8.3g}"
            )
    return lines


def recommendation_note(plan: MixturePlan, forecast, *, command: str, saved: Path, date: str) -> str:
    """The comment above the tuned recipe's data.mixture: what was chosen, under which limit, by which command,
    and the predictions of every ratio of the grid with their intervals."""
    replay = plan.names[plan.replay]
    return "\n".join([
        f"data.mixture: {replay} at {ratio_text(forecast.recommended)} of {', '.join(map(ratio_text, plan.ratios))}: "
        f"the lowest predicted loss of the new language with {replay}'s predicted rise over the base's at most "
        f"{plan.max_rise:.3g} ({plan.max_rise:.1%}), `{command}`, {date}; the law and its runs: {saved}",
        *forecast.table(),
        "(data.mixture_forecast: the banner prints the prediction; the run's end compares it with its own losses)",
    ])  # fmt: skip


def tuned_mixture_text(text: str, plan: MixturePlan, forecast, *, note: str, saved: Path) -> str:
    """The recipe's YAML with the user's overrides as the sweep's runs had them (but budget and out_dir), data.mixture
    at the recommended ratio with `note` above it, and data.mixture_forecast naming `saved`; comments, key order
    and everything else as written (ruamel.yaml's round trip, as the LR sweep writes its tuned recipe)."""
    from ruamel.yaml.comments import CommentedMap

    kept, _ = sweep.split_overrides(plan.overrides)
    yaml, doc = recipe_edit.round_trip(text)
    for section, key, written in recipe_edit.override_items(kept):
        recipe_edit.set_value(doc, section, key, recipe_edit.override_value(yaml, written))
    weights = mixture_at(plan.mixture, plan.replay, forecast.recommended)
    written = (doc.get("data") or {}).get("mixture")
    if isinstance(written, CommentedMap) and {str(k) for k in written} == set(weights):
        for key in written:  # the same datasets: their weights replaced in place, their comments kept
            written[key] = weights[str(key)]
        weights = written
    recipe_edit.set_value(doc, "data", "mixture", CommentedMap(weights) if weights is not written else written,
                    comment=note, indent=yaml.map_indent)  # fmt: skip
    recipe_edit.set_value(doc, "data", "mixture_forecast", str(saved.resolve()))
    return recipe_edit.dump(yaml, doc)
