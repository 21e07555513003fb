"""`hopperlm sweep`: a μP recipe's LR tuned on a narrow proxy, end to end on the CPU (3 LRs, a few steps), the
best LR by final validation loss, the recipe written back with it; bad inputs one line each."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hopperlm.cli import main
from hopperlm.config import load_config
from hopperlm.train.recipe_edit import set_key, tuned_recipe_text
from hopperlm.train.sweep import SweepRun, best_lr, finished_before, read_result, run_state

REPO = Path(__file__).resolve().parents[1]
# RECIPE is mup; PLAIN is standard until a sweep's overrides make it mup
TEMPLATE = """# a tiny {head} recipe
model:
  preset: null
  dim: 64
  n_layers: 2
  n_heads: 4  # heads of 16
{mup}  max_seq_len: 64
data:
  path: {data}
optim:
  lr: 1.0e-3   # a guess
schedule:
  warmup_steps: 2
train:
  seq_len: 64
  micro_batch: 8
  max_steps: 6
  eval_every: 0
  eval_windows: 4
  log_every: 3
checkpoint:
  every: 0
{run}"""
RECIPE = TEMPLATE.format(head="mup", mup="  parametrization: mup\n  base_dim: 32\n", data="{data}", run="")
PLAIN = TEMPLATE.format(head="standard", mup="", data="not/prepared", run="run:\n  out_dir: runs/tiny\n")


def hopperlm(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hopperlm", *map(str, args)], capture_output=True, text=True, cwd=REPO
    )


@pytest.fixture
def recipe(shakespeare_bytes, tmp_path) -> Path:
    path = tmp_path / "tiny-mup.yaml"
    path.write_text(RECIPE.format(data=shakespeare_bytes))
    return path


@pytest.mark.slow
def test_sweep_trains_the_proxy_picks_the_best_lr_and_writes_the_recipe(recipe, tmp_path):
    out = tmp_path / "sweep"
    done = hopperlm("sweep", recipe, "--lr", "3e-3,1e-2,3e-4", "--dim", "32", "--max-steps", "5", "--out", out,
                    "--widths", "16,32,48")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((out / "sweep.json").read_text())
    rows = record["rows"]
    assert [r["lr"] for r in rows] == [3e-4, 3e-3, 1e-2] and record["proxy_dim"] == 32
    assert all(r["final_val_loss"] is not None and r["stopped_by"] == "max_steps" for r in rows)
    best = min(rows, key=lambda r: r["final_val_loss"])["lr"]
    assert record["best_lr"] == best
    proxy = yaml.safe_load((Path(rows[0]["run_dir"]) / "config.yaml").read_text())["model"]
    assert proxy["dim"] == 32 and proxy["n_heads"] == 2 and proxy["base_dim"] == 32  # heads of the same size
    table = done.stdout[done.stdout.index("        lr") :]
    assert "<- best" in table and f"{best:.3g}" in table
    assert any((out / "plots").glob("*.png"))
    tuned = out / "tiny-mup.tuned.yaml"
    text = tuned.read_text()
    assert "# optim.lr" in text and "hopperlm sweep" in text and "# a tiny mup recipe" in text
    # the proxy's width is named, not kept: a run of the proxy again is in the comment
    assert "# sweep proxy: dim 32, depth 2, 5 steps" in text and "--model.dim 32 --model.n_heads 2" in text
    cfg = load_config(tuned, [])
    assert cfg.optim.lr == pytest.approx(best) and cfg.model.dim == 64  # the target's width, the proxy's LR
    # --widths: each width trained at the best LR and the recipe's tokens per parameter (6 steps x 512 tokens),
    # the forecast written, and the tuned recipe pointing at it; diagnose shows it beside the budget
    forecast = json.loads((out / "forecast.json").read_text())
    assert cfg.train.forecast_from == str((out / "forecast.json").resolve())
    assert [(p["width"], p["final_val_loss"] is not None) for p in forecast["points"]] == [
        (16, True), (32, True), (48, True)
    ]  # fmt: skip
    tpp = 6 * 512 / forecast["target_params"]
    assert forecast["tokens_per_param"] == pytest.approx(tpp)
    for point in forecast["points"]:
        run = Path(out / f"width-{point['width']}" / f"lr-{best:.3g}-seed-1337")
        assert (
            json.loads((run / "result.json").read_text())["step"]
            == point["steps"]
            == max(1, round(tpp * point["params"] / 512))
        )
    assert forecast["low"] <= forecast["final_val_loss"] <= forecast["high"]
    # and the proxies' whole curves, for `forecast --proxies` and the training forecast (observe/collapse.py)
    curves = forecast["curves"]
    assert [c["width"] for c in curves] == [16, 32, 48] and all(
        c["val"][-1][0] == c["final_step"] for c in curves
    )
    shown = hopperlm("diagnose", tuned, "--train.max_steps", "12")
    assert shown.returncode == 0, shown.stderr[-2000:]
    line = next(x for x in shown.stdout.splitlines() if x.startswith("forecast from proxies"))
    assert f"{forecast['final_val_loss']:.3f}" in line and "not the proxies'" in line  # twice the tokens


@pytest.mark.slow
def test_a_sweep_moves_the_group_lrs_with_optim_lr(recipe, tmp_path):
    """optim.groups' LRs keep their ratio to optim.lr in every run and in the tuned recipe (they are multiples of
    it): the sweep tunes one multiplier of all the recipe's LRs."""
    text = recipe.read_text()
    assert "\noptim:\n" in text
    recipe.write_text(
        text.replace(
            "\noptim:\n",
            "\noptim:\n  groups: [{pattern: embed.weight, lr: 10}, {pattern: lm_head.weight, lr: 0.5}]\n",
        )
    )
    out = tmp_path / "sweep"
    done = hopperlm(
        "sweep", recipe, "--lr", "1e-3,2e-3,4e-3", "--dim", "32", "--max-steps", "2", "--out", out
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "optim.groups 'embed.weight' moves with optim.lr (10 x it)" in done.stdout
    lrs = set()
    for run in out.glob("lr-*-seed-*"):
        optim = yaml.safe_load((run / "config.yaml").read_text())["optim"]
        assert [(g["pattern"], g["lr"]) for g in optim["groups"]] == [
            ("embed.weight", 10),
            ("lm_head.weight", 0.5),
        ]
        lrs.add(optim["lr"])
    assert len(lrs) == 3  # each run its own optim.lr, the table the same multiples of it
    tuned = load_config(out / "tiny-mup.tuned.yaml", []).optim
    assert [(g.pattern, g.lr) for g in tuned.groups] == [("embed.weight", 10), ("lm_head.weight", 0.5)]
    assert "differs from the sweep's runs" not in done.stdout  # the tuned recipe at the proxy: the best run


@pytest.mark.slow
def test_the_tuned_recipe_alone_reproduces_the_sweeps_best_run(shakespeare_bytes, tmp_path):
    """Issue 48: the tuned recipe held the LR only (no mup, no base_dim, no data path), so run alone it trained
    something else at an LR tuned for mup. Now it holds every override but width, budget and out_dir: trained
    alone at the proxy's budget (the sweep's --dim is the recipe's width here) it gives the best run's loss."""
    recipe, out = tmp_path / "plain.yaml", tmp_path / "sweep"
    recipe.write_text(PLAIN)
    done = hopperlm("sweep", recipe, "--lr", "3e-4,3e-3,1e-2", "--dim", "64", "--max-steps", "4",
                    "--model.parametrization", "mup", "--model.base_dim", "32", "--data.path", shakespeare_bytes,
                    "--optim.weight_decay", "1e-2", "--out", out)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "differs from the sweep's runs" not in done.stdout, done.stdout[-2000:]
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    best = min(rows, key=lambda r: r["final_val_loss"])
    tuned = out / "plain.tuned.yaml"
    text = tuned.read_text()
    # the recipe's comments and key order kept, the sweep's overrides added after its keys
    for line in (
        "# a tiny standard recipe",
        "preset: null\n",
        "n_heads: 4  # heads of 16",
        "# a guess",
    ):
        assert line in text, text
    ours, theirs = yaml.safe_load(PLAIN), yaml.safe_load(text)
    assert list(theirs) == list(ours)
    assert all(list(theirs[section])[: len(keys)] == list(keys) for section, keys in ours.items())
    assert "# optim.lr" in text and "hopperlm sweep" in text
    assert "# sweep proxy: dim 64, depth 2, 4 steps (train.max_steps), seeds 1337" in text, text
    # every override of the runs; the recipe's own width, budget and out_dir
    assert theirs["model"] == {**ours["model"], "parametrization": "mup", "base_dim": 32}
    # (1e-2 as written: PyYAML reads it as text, load_config as the number, as from the command line)
    assert theirs["data"]["path"] == str(shakespeare_bytes) and theirs["optim"]["weight_decay"] == "1e-2"
    assert theirs["train"] == ours["train"] and theirs["run"] == ours["run"]
    # alone, with the proxy's budget, a fresh out_dir and the run's threads (a CPU's losses depend on them)
    again = subprocess.run(
        [sys.executable, "-m", "hopperlm", "train", tuned, "--train.max_steps", "4", "--run.out_dir", tmp_path / "again"],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": str(best["threads"])},
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert best["seed"] == 1337  # the recipe's: the sweep's default seeds
    assert json.loads((tmp_path / "again" / "result.json").read_text())["val_loss"] == best["final_val_loss"]


@pytest.mark.slow
def test_a_depth_sweep_trains_a_shallow_proxy_and_names_it_in_the_tuned_recipe(recipe, tmp_path):
    """Under CompleteP the proxy may be shallower too: --depth 1 of a 2-block recipe (--dim 32 of its 64)."""
    out = tmp_path / "sweep"
    completep = ["--model.depth_parametrization", "completep", "--model.base_depth", "1"]
    done = hopperlm("sweep", recipe, *completep, "--lr", "3e-3,1e-2,3e-4", "--dim", "32", "--depth", "1",
                    "--max-steps", "3", "--out", out)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((out / "sweep.json").read_text())
    assert record["proxy_dim"] == 32 and record["proxy_depth"] == 1
    assert all(r["final_val_loss"] is not None for r in record["rows"])
    proxy = yaml.safe_load((Path(record["rows"][0]["run_dir"]) / "config.yaml").read_text())["model"]
    assert (proxy["dim"], proxy["n_layers"], proxy["depth_parametrization"], proxy["base_depth"]) == (
        32,
        1,
        "completep",
        1,
    )
    text = (out / "tiny-mup.tuned.yaml").read_text()
    assert "width-32, depth-1 proxy" in text and "# sweep proxy: dim 32, depth 1, 3 steps" in text
    assert "--model.dim 32 --model.n_heads 2 --model.n_layers 1" in text  # the proxy run again
    cfg = load_config(out / "tiny-mup.tuned.yaml", [])
    assert (cfg.model.dim, cfg.model.n_layers) == (64, 2)  # the recipe's own size, with CompleteP kept
    assert (cfg.model.depth_parametrization, cfg.model.base_depth) == ("completep", 1)
    assert cfg.optim.lr == pytest.approx(record["best_lr"])


def test_bad_sweeps_are_one_line_each(recipe, tmp_path, capsys):
    standard = tmp_path / "standard.yaml"
    standard.write_text(recipe.read_text().replace("parametrization: mup", "parametrization: standard"))
    hours = tmp_path / "hours.yaml"
    hours.write_text(recipe.read_text().replace("max_steps: 6", "max_hours: 1.5"))
    for args, message in (
        ([recipe, "--lr", "1e-3,2e-3"], "give at least 3 distinct positive learning rates"),
        ([recipe, "--lr", "1e-3,2e-3,x"], "write positive numbers separated by commas"),
        ([standard, "--lr", "1e-3,2e-3,4e-3"], "model.parametrization standard"),
        (
            [recipe, "--lr", "1e-3,2e-3,4e-3", "--dim", "128"],
            "--dim 128 is wider than the recipe's model.dim 64",
        ),
        ([recipe, "--lr", "1e-3,2e-3,4e-3", "--dim", "24"], "not a positive multiple of the head size 16"),
        ([recipe, "--lr", "1e-3,2e-3,4e-3", "--widths", "16,32"], "give at least 3 widths, all narrower"),
        (
            [recipe, "--lr", "1e-3,2e-3,4e-3", "--widths", "16,32,64"],
            "all narrower than the recipe's model.dim 64",
        ),
        ([recipe, "--lr", "1e-3,2e-3,4e-3", "--widths", "16,32,x"], "write widths separated by commas"),
        (
            [recipe, "--lr", "1e-3,2e-3,4e-3", "--widths", "16,24,32"],
            "not a positive multiple of the head size",
        ),
        ([hours, "--lr", "1e-3,2e-3,4e-3", "--widths", "16,32,48"], "give --target-tokens N"),
        (
            [recipe, "--lr", "1e-3,2e-3,4e-3", "--depth", "4"],
            "--depth 4 is deeper than the recipe's model.n_layers 2",
        ),
        (
            [recipe, "--lr", "1e-3,2e-3,4e-3", "--depth", "1"],
            "the recipe uses model.depth_parametrization standard",
        ),
        # the data is read before any run trains: one line, not a grid of failed runs (issue 61)
        ([recipe, "--lr", "1e-3,2e-3,4e-3", "--data.path", str(tmp_path / "nowhere")], "does not exist"),
    ):  # in this process (a process each took 2 s), the first one also as the command a user runs
        with pytest.raises(SystemExit) as exit_:
            main(["sweep", *map(str, args), "--out", str(tmp_path / "never")])
        lines = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(lines) == 1 and message in lines[0], (message, lines)
    done = hopperlm("sweep", recipe, "--lr", "1e-3,2e-3", "--out", tmp_path / "never")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "at least 3 distinct" in lines[0], done.stderr
    assert not (tmp_path / "never").exists()


def test_the_best_lr_averages_seeds_and_a_failed_seed_disqualifies():
    runs = [
        SweepRun(1e-3, 1, "a", 2.0), SweepRun(1e-3, 2, "b", 2.2),
        SweepRun(2e-3, 1, "c", 1.9), SweepRun(2e-3, 2, "d", 2.4),
        SweepRun(4e-3, 1, "e", 1.0), SweepRun(4e-3, 2, "f", None, error="diverged"),
    ]  # fmt: skip
    best, means = best_lr(runs)
    assert best == 1e-3 and means[1e-3] == pytest.approx(2.1) and means[4e-3] == float("inf")


def test_a_run_stopped_by_a_signal_from_elsewhere_has_no_final_loss(tmp_path):
    """A run's SIGTERM that was not the sweep's Ctrl-C (a scheduler, a person): its val loss is no final one
    (a signal's stop is validated only where the schedule has it due) and it is not taken as finished."""
    result = {"stopped_by": "signal SIGTERM", "step": 7, "val_loss": 2.5, "val_step": 6}
    (tmp_path / "result.json").write_text(json.dumps(result))
    run = SweepRun(1e-3, 1, str(tmp_path))
    read_result(run, "", 0)
    assert run.final_val_loss is None and not run.interrupted
    assert (
        run_state(run) == "failed: stopped by signal SIGTERM at step 7; --resume goes on from its checkpoint"
    )
    assert not finished_before(SweepRun(1e-3, 1, str(tmp_path)))
    result["stopped_by"] = "max_steps"
    (tmp_path / "result.json").write_text(json.dumps(result))
    read_result(run := SweepRun(1e-3, 1, str(tmp_path)), "", 0)
    assert run.final_val_loss == 2.5 and run.error is None


def test_the_tuned_recipe_keeps_everything_else_as_written():
    text = "# top\nmodel:\n  dim: 64  # width\noptim:\n  name: muon\n  lr: 1.5e-3  # old\n  warmup_steps: 5\ntrain:\n  max_steps: 3\n"
    overrides = ["--optim.weight_decay", "1e-3", "--model.parametrization=mup", "--data.path", "data/x y"]
    out = tuned_recipe_text(text, lr=4e-3, overrides=overrides, note="from a sweep\nline two")
    assert (
        out
        == (
            "# top\nmodel:\n  dim: 64  # width\n  parametrization: mup\noptim:\n  name: muon\n  # from a sweep\n"
            "  # line two\n  lr: 0.004   # old\n  warmup_steps: 5\n  weight_decay: 1e-3\ntrain:\n  max_steps: 3\n"
            "data:\n  path: data/x y\n"
        )
    )  # 1e-3 as written; a new key last in its section, a new section last; the end-of-line comment's column kept
    # a model.preset override replaces the model section (as load_config merges it); the recipe's indentation kept
    out = tuned_recipe_text(
        "model:\n    dim: 64\n    n_heads: 4\n", lr=1e-3, overrides=["--model.preset", "debug"], note="n"
    )
    assert out == "model:\n    preset: debug\noptim:\n    # n\n    lr: 0.001\n"
    assert set_key("train:\n  max_steps: 3  # short\n", "train", "forecast_from", "f.json", comment="c") == (
        "train:\n  max_steps: 3  # short\n  # c\n  forecast_from: f.json\n"
    )
