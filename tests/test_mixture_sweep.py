"""`hopperlm sweep RECIPE --mixture DATASET=r1,r2,...`: the replay ratio of continued pretraining tuned on μP proxies
of the base (train/mixture_sweep.py), the law fitted to them (observe/mixture_law.py), the recommendation under
--max-forgetting written into the tuned recipe, and the banner's prediction against the run's own losses; bad
inputs one line each, nothing written."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hopperlm.cli import main
from hopperlm.config import load_config
from hopperlm.data.prepare import PrepareOptions, prepare
from hopperlm.errors import ConfigError
from hopperlm.observe import mixture_law
from hopperlm.train.loop import train
from hopperlm.train.mixture_sweep import mixture_at, parse_mixture

REPO = Path(__file__).resolve().parents[1]
QUIET = lambda line: None  # noqa: E731
BASE = """model:
  dim: 64
  n_layers: 1
  n_heads: 4
  max_seq_len: 32
  parametrization: mup
  base_dim: 16
data:
  path: {eng}
optim:
  lr: 1.0e-2
schedule:
  warmup_steps: 0
train:
  seq_len: 32
  micro_batch: 4
  max_steps: 3
  eval_every: 0
  eval_windows: 4
  log_every: 1
log:
  report: false
  tensorboard: false
run:
  out_dir: {out}
"""
RECIPE = """# continued pretraining of a tiny English base on Tigrinya, English replayed
model:
  init_from: {base}
data:
  mixture:
    {tir}: 0.9  # the new language
    {eng}: 0.1
optim:
  lr: 3.0e-3
schedule:
  warmup_steps: 0
train:
  seq_len: 32
  micro_batch: 4
  batch_tokens: 128
  max_tokens: 512
  eval_every: 0
  eval_windows: 4
  log_every: 1
checkpoint:
  every: 0
log:
  report: false
  tensorboard: false
"""
SWEEP = [
    "--mixture",
    "eng=0,0.1,0.3",
    "--widths",
    "16,32,48",
    "--base-lr",
    "1e-2",
    "--base-tokens-per-param",
    "0.05",
]


@pytest.fixture(scope="module")
def tiny(data_dir, tmp_path_factory) -> dict[str, Path]:
    """HornMT English and Tigrinya as bytes (English also without a val split), a 3-step English base at width
    64 (μP, base_dim 16), and a recipe that continues it on {tir: 0.9, eng: 0.1} for 4 steps."""
    root = tmp_path_factory.mktemp("mixture")
    for name, source, val in (("eng", "eng", 0.1), ("tir", "tir", 0.1), ("eng-noval", "eng", 0.0)):
        prepare(
            [data_dir / "hornmt" / f"{source}.txt"],
            root / name,
            PrepareOptions(val_fraction=val),
            progress=False,
        )
    (root / "base.yaml").write_text(BASE.format(eng=root / "eng", out=root / "base"))
    train(load_config(root / "base.yaml"), log=QUIET)
    (root / "cpt.yaml").write_text(RECIPE.format(base=root / "base", tir=root / "tir", eng=root / "eng"))
    return {
        "root": root,
        "recipe": root / "cpt.yaml",
        **{n: root / n for n in ("eng", "tir", "eng-noval", "base")},
    }


def hopperlm(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hopperlm", *map(str, args)], capture_output=True, text=True, cwd=REPO
    )


# ---- the law ---------------------------------------------------------------------------------------------------
def law_rows(noise: float = 0.0, seeds=(1, 2)):
    """Rows from a law of the fitted family, with +-noise between the seeds."""
    target = lambda n, r: 2.0 + 1.5 * n**-0.3 + 0.4 * n**-0.1 * ((1 - r) ** -0.8 - 1)  # noqa: E731
    rise = lambda n, r: 0.5 * n**-0.2 * (r + 0.02) ** -0.5 - 0.3  # noqa: E731
    rows, bases = [], []
    for params in (200_000, 400_000, 800_000):
        n = params / 1e6
        bases.append({"width": params // 10_000, "params": params, "replay_loss": 4 - 0.2 * math.log(n)})
        for ratio in (0.0, 0.05, 0.1, 0.2, 0.3, 0.5):
            for seed, sign in zip(seeds, (1, -1), strict=False):
                rows.append({"width": params // 10_000, "params": params, "ratio": ratio, "seed": seed,
                             "target_loss": target(n, ratio) + sign * noise,
                             "replay_rise": rise(n, ratio) + sign * noise / 10})  # fmt: skip
    return rows, bases, target, rise


def test_the_law_recovers_its_own_family_at_four_times_the_parameters_with_intervals_around_it(tmp_path):
    rows, bases, target, rise = law_rows(noise=0.01)
    got = mixture_law.fit(rows, bases, replay="eng", targets={"tir": 1.0}, grid=[0, 0.05, 0.1, 0.2, 0.3, 0.5],
                          target_params=3_200_000, tokens=1000, bootstrap=40)  # fmt: skip
    for p in got.predictions:
        r = p["ratio"]
        assert p["target_loss"] == pytest.approx(target(3.2, r), rel=0.01)
        assert p["target_low"] < target(3.2, r) < p["target_high"]
        assert p["replay_rise"] == pytest.approx(rise(3.2, r), abs=0.01)
        assert p["rise_low"] <= p["replay_rise"] <= p["rise_high"] and p["rise_high"] > p["rise_low"]
        base = 4 - 0.2 * math.log(3.2)
        assert p["base_replay_loss"] == pytest.approx(base) and p["replay_loss"] == pytest.approx(
            base * (1 + p["replay_rise"])
        )
    got.save(tmp_path / "mixture.json")
    again = mixture_law.load(tmp_path / "mixture.json")
    assert again.predict(3_200_000, 0.1) == got.predict(3_200_000, 0.1)


def test_the_recommendation_is_the_lowest_target_loss_within_the_limit_else_the_smallest_rise():
    rows, bases, target, rise = law_rows(noise=0.0, seeds=(1,))
    grid = [0, 0.05, 0.1, 0.2, 0.3, 0.5]
    got = mixture_law.fit(rows, bases, replay="eng", targets={"tir": 1.0}, grid=grid, target_params=3_200_000,
                          tokens=1000, max_rise=0.5)  # fmt: skip
    rises = {p["ratio"]: p["replay_rise"] for p in got.predictions}
    # the target loss rises with the ratio, the replay's rise falls: the smallest ratio within the limit
    assert got.recommended == min(r for r in grid if rises[r] <= 0.5) and got.closest is None
    assert got.boot == {
        "target": [],
        "rise": [],
    }  # one seed per cell: nothing to resample, the residual alone
    got.recommend(min(rises.values()) - 0.01)
    assert got.recommended is None and got.closest == {"ratio": 0.5, "replay_rise": rises[0.5]}
    assert "<- recommended" not in "\n".join(got.table())


def test_what_the_law_cannot_fit_is_one_clear_error(tmp_path):
    rows, bases, _, _ = law_rows()
    narrow = [r for r in rows if r["params"] < 800_000]
    with pytest.raises(ConfigError, match="3 or more widths and 3 or more ratios, got 2 and 6"):
        mixture_law.fit(
            narrow, bases, replay="eng", targets={"tir": 1}, grid=[0], target_params=10**7, tokens=1
        )
    with pytest.raises(ConfigError, match="not beyond the widest proxy"):
        mixture_law.fit(
            rows, bases, replay="eng", targets={"tir": 1}, grid=[0], target_params=800_000, tokens=1
        )
    (tmp_path / "bad.json").write_text(json.dumps({"replay": "eng"}))
    with pytest.raises(ConfigError, match="not a forecast written by `hopperlm sweep --mixture`"):
        mixture_law.load(tmp_path / "bad.json")


def test_a_mixture_spec_names_a_dataset_of_the_recipe_and_ratios_in_0_1():
    mixture = {"data/tir": 0.6, "data/amh": 0.2, "data/eng": 0.2}
    assert parse_mixture("eng=0.1,0,0.25", mixture) == ("data/eng", [0.0, 0.1, 0.25])
    assert parse_mixture("data/eng=0,0.1,0.25", mixture)[0] == "data/eng"
    # the others share 1 - r in the recipe's proportions; r = 0 is a 0 weight (validated, never trained on)
    assert mixture_at(mixture, "data/eng", 0.2) == {"data/tir": 0.6, "data/amh": 0.2, "data/eng": 0.2}
    assert mixture_at(mixture, "data/eng", 0.0) == {"data/tir": 0.75, "data/amh": 0.25, "data/eng": 0.0}
    for spec, message in (
        ("eng", "write DATASET=r1,r2"),
        ("fra=0,0.1,0.2", "not a dataset of the recipe's data.mixture"),
        ("eng=0,0.1,1", "ratio 1 is outside [0, 1)"),
        ("eng=-0.1,0.1,0.2", "ratio -0.1 is outside [0, 1)"),
        ("eng=0,0.1", "at least 3 distinct ratios"),
        ("eng=0,x,0.1", "numbers separated by commas"),
    ):
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(")", r"\)")):
            parse_mixture(spec, mixture)


# ---- the sweep -------------------------------------------------------------------------------------------------
def test_bad_mixture_sweeps_are_one_line_each_and_write_nothing(tiny, tinyllama_hf, tmp_path, capsys):
    root = tiny["root"]
    foreign = tmp_path / "foreign.yaml"  # a base whose tokenizer (TinyLlama's) is not the data's (bytes)
    foreign.write_text(tiny["recipe"].read_text().replace(str(tiny["base"]), str(tinyllama_hf)))
    noval = tmp_path / "noval.yaml"  # the replayed dataset has no validation split
    noval.write_text(tiny["recipe"].read_text().replace(f"{tiny['eng']}:", f"{tiny['eng-noval']}:"))
    scratch = tmp_path / "scratch.yaml"  # no base to continue
    scratch.write_text(tiny["recipe"].read_text().replace(f"init_from: {tiny['base']}", "dim: 64"))
    spec = SWEEP[2:]  # the widths and the bases' settings
    for args, message in (
        ([tiny["recipe"], "--mixture", "eng=0,0.1,1", *spec], "ratio 1 is outside [0, 1)"),
        (
            [tiny["recipe"], "--mixture", "fra=0,0.1,0.3", *spec],
            "fra: not a dataset of the recipe's data.mixture",
        ),
        ([foreign, *SWEEP], "nor an extension of it"),
        (
            [noval, "--mixture", "eng-noval=0,0.1,0.3", *spec, "--max-forgetting", "3%"],
            "has no validation split, so --max-forgetting 0.03 cannot be held",
        ),
        ([scratch, *SWEEP], "the recipe needs model.init_from"),
        ([tiny["recipe"], *SWEEP, "--lr", "1e-3,2e-3,4e-3"], "drop --lr"),
        ([tiny["recipe"], *SWEEP[:2], "--base-lr", "1e-2"], "needs --widths"),
        ([tiny["recipe"], *SWEEP[:4]], "needs --base-lr"),
        (
            [tiny["recipe"], *SWEEP[:2], "--widths", "16,32,64", "--base-lr", "1e-2"],
            "narrower than the base's",
        ),
        ([tiny["recipe"], *SWEEP, "--max-forgetting", "three"], "e.g. 3% or 0.03"),
        ([tiny["recipe"]], "give --lr A,B,C"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["sweep", *map(str, args), "--out", str(root / "never")])
        lines = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(lines) == 1 and message in lines[0], (message, lines)
        assert not (root / "never").exists()


@pytest.mark.slow
def test_a_mixture_sweep_trains_bases_and_ratios_fits_the_law_and_writes_the_tuned_recipe(tiny, tmp_path):
    out = tmp_path / "sweep"
    done = hopperlm("sweep", tiny["recipe"], *SWEEP, "--jobs", "2", "--out", out)
    assert done.returncode == 0, done.stderr[-3000:]
    forecast = json.loads((out / "mixture.json").read_text())
    assert "add --max-forgetting" in done.stdout and not (out / "cpt.tuned.yaml").exists()
    bases = {b["width"]: b for b in forecast["bases"]}
    assert sorted(bases) == [16, 32, 48] and bases[16]["params"] < bases[32]["params"] < bases[48]["params"]
    for (
        width,
        base,
    ) in bases.items():  # pretrained on English alone, at 0.05 tokens per parameter; both evaluated
        cfg = yaml.safe_load((Path(base["run_dir"]) / "config.yaml").read_text())
        assert (
            cfg["model"]["dim"] == width
            and cfg["model"]["base_dim"] == 16
            and cfg["model"]["init_from"] is None
        )
        assert cfg["data"]["mixture"] == {str(tiny["tir"]): 0.0, str(tiny["eng"]): 1.0}
        assert base["steps"] == max(1, round(0.05 * base["params"] / 128)) and base["target_loss"] > 0
    rows = forecast["rows"]
    assert [(r["width"], r["ratio"]) for r in rows] == [(w, r) for w in (16, 32, 48) for r in (0, 0.1, 0.3)]
    for row in rows:  # the recipe's 512 tokens (4 steps) from each width's base, its epochs of Tigrinya
        run = Path(row["run_dir"])
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        assert cfg["model"]["init_from"] == bases[row["width"]]["run_dir"] and cfg["optim"]["lr"] == 3e-3
        assert cfg["data"]["mixture"][str(tiny["eng"])] == row["ratio"]
        assert json.loads((run / "result.json").read_text())["step"] == 4 and row["tokens"] == 512
        tir_tokens = json.loads((tiny["tir"] / "manifest.json").read_text())["tokens"]["train"]
        assert row["epochs_of_target"] == pytest.approx((1 - row["ratio"]) * 512 / tir_tokens)
        assert row["replay_rise"] == pytest.approx(
            row["replay_loss"] / bases[row["width"]]["replay_loss"] - 1
        )
        last = [
            r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "val_losses" in r
        ][-1]
        assert (row["target_loss"], row["replay_loss"]) == (
            last["val_losses"]["tir"],
            last["val_losses"]["eng"],
        )
    assert (
        forecast["target_params"] > max(b["params"] for b in forecast["bases"]) and forecast["tokens"] == 512
    )
    rises = [p["replay_rise"] for p in forecast["predictions"]]
    again = [str(tiny["recipe"]), *SWEEP, "--out", str(out), "--resume"]
    # a limit no ratio meets: one line naming the smallest rise and its ratio, exit 2, nothing written
    saved = (out / "mixture.json").read_text()
    refused = hopperlm("sweep", *again, f"--max-forgetting={min(rises) - 0.01}")
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr[-2000:]
    smallest = min(forecast["predictions"], key=lambda p: p["replay_rise"])
    assert f"the smallest, {smallest['replay_rise']:+.2%}, is at ratio {smallest['ratio']:.4g}" in lines[0]
    assert "finished before" in refused.stdout and (out / "mixture.json").read_text() == saved
    assert not (out / "cpt.tuned.yaml").exists()
    # a limit every ratio meets: the ratio of the lowest predicted Tigrinya loss, written with its predictions
    done = hopperlm("sweep", *again, f"--max-forgetting={max(rises) + 0.01}")
    assert done.returncode == 0, done.stderr[-3000:]
    best = min(forecast["predictions"], key=lambda p: p["target_loss"])["ratio"]
    tuned = out / "cpt.tuned.yaml"
    text = tuned.read_text()
    assert "# continued pretraining of a tiny English base" in text and "  # the new language" in text
    assert f"# data.mixture: eng at {best:.4g} of 0, 0.1, 0.3" in text and "<- recommended" in text
    cfg = load_config(tuned)
    assert cfg.data.mixture == mixture_at(
        {str(tiny["tir"]): 0.9, str(tiny["eng"]): 0.1}, str(tiny["eng"]), best
    )
    assert cfg.data.mixture_forecast == str((out / "mixture.json").resolve())
    # trained, it prints the prediction in its banner and sets it beside its own losses at the end
    shutil.rmtree(tmp_path / "run", ignore_errors=True)
    run = hopperlm("train", tuned, "--run.out_dir", tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    banner = next(line for line in run.stdout.splitlines() if line.startswith("mixture forecast at eng"))
    assert f"at eng {best:.3g}: tir " in banner and "over the base's" in banner
    end = next(
        line for line in run.stdout.splitlines() if line.startswith("mixture forecast against this run")
    )
    measured = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["val_losses"]
    assert f"tir measured {measured['tir']:.4f}" in end and f"eng measured {measured['eng']:.4f}" in end
