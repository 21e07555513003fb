"""The final-loss forecast (observe/forecast.py): the fit recovers a curve drawn from its own law, the planned
schedule is the loop's, `hopperlm forecast` works on a real run and fails in one line, the benchmark runs."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hopperlm.config import load_config
from hopperlm.observe.forecast import (
    DEFAULT_PRIOR,
    GAMMA,
    GRID,
    TAU,
    Forecast,
    forecast_curve,
    forecast_run,
    kept_schedule,
    lr_areas,
    planned_lrs,
    read_records,
    read_run_config,
)
from hopperlm.schedule import budget_progress, lr_at
from hopperlm.train.loop import train

REPO = Path(__file__).resolve().parents[1]
DEBUG = REPO / "configs" / "debug.yaml"


def cosine_lrs(steps: int, warmup: int = 20, peak: float = 3e-3, floor: float = 0.1) -> np.ndarray:
    p = np.clip((np.arange(steps) - warmup) / (steps - warmup), 0, 1)
    lrs = peak * (floor + (1 - floor) * 0.5 * (1 + np.cos(np.pi * p)))
    lrs[:warmup] = peak * (np.arange(warmup) + 1) / warmup
    return lrs


def test_a_curve_drawn_from_the_law_is_recovered_with_the_truth_inside_the_interval():
    steps = 1000
    lrs = cosine_lrs(steps)
    s1, gain = lr_areas(lrs)
    l0, a, alpha, b = 1.2, 4.0, 0.3, DEFAULT_PRIOR.gain

    def law(s: int) -> float:
        return l0 + a * s1[s] ** -alpha - b * gain[s]

    points = [(s, law(s)) for s in range(25, 501, 25)]  # half the budget, evaluated every 25 steps
    f = forecast_curve(points, lrs, at_step=500)
    truth = law(steps)
    assert f is not None and f.final_step == steps and f.at_step == 500
    assert abs(f.final_val_loss - truth) < 0.005 * truth, (f, truth)
    assert f.low <= truth <= f.high
    assert forecast_curve(points[:3], lrs, at_step=75) is None  # too few points to fit three parameters


def exact_gain(lrs: np.ndarray) -> np.ndarray:
    """The realised annealing gain by its definition: every drop, paid off over the LR area trained since."""
    eta = lrs / lrs.max()
    s1 = np.concatenate([[0.0], np.cumsum(eta)])
    gain = np.zeros(len(eta) + 1)
    for k in range(1, len(eta)):
        drop = eta[k - 1] - eta[k]
        if drop > 0:
            rate = eta[k] ** -GAMMA / (TAU * len(eta))
            gain[k + 1 :] += drop * (1 - np.exp(-(s1[k + 1 :] - s1[k]) * rate))
    return gain


def test_the_annealing_gain_is_paid_off_over_lr_area():
    short = cosine_lrs(500)
    assert np.allclose(lr_areas(short)[1], exact_gain(short), atol=1e-12)  # one block per step: exact
    long = cosine_lrs(3 * GRID + 17)  # blocks of 4 steps
    s1, gain = lr_areas(long)
    assert np.allclose(s1[-1], (long / long.max()).sum()) and np.abs(gain - exact_gain(long)).max() < 1e-3
    # a cosine's gain is nearly all paid by its end; a WSD decay in the last tenth, whose LR is low by then,
    # has paid less of the same total drop
    wsd = np.concatenate([np.ones(900), np.linspace(1, 0.1, 100)])
    assert 0.85 < lr_areas(cosine_lrs(1000))[1][-1] <= 0.9 and 0.3 < lr_areas(wsd)[1][-1] < 0.45
    assert lr_areas(np.ones(1000))[1].max() == 0.0  # a constant LR never anneals


def test_the_line_says_likely_possible_or_unlikely():
    f = Forecast(final_val_loss=3.05, low=3.02, high=3.09, final_step=12000, at_step=3600, method="prior")
    assert f.line() == "forecast: 3.050 (3.020-3.090) at step 12000 (the budget's end)"
    assert f.line(3.1).endswith("target 3.1: likely")
    assert f.line(3.0781).endswith("target 3.0781: possible")
    assert f.line(3.0).endswith("target 3: unlikely")
    assert f.to_dict()["final_val_loss"] == 3.05


def config(*overrides: str):
    return load_config(DEBUG, ["--data.path", "unused", *overrides])


def test_planned_lrs_follow_the_loop_for_a_step_budget():
    cfg = config("--train.max_steps", "300", "--schedule.name", "wsd", "--schedule.warmup_steps", "10")
    lrs = planned(cfg, steps_done=50, tokens_per_step=1024, elapsed_s=3.0)
    assert len(lrs) == 300
    for i in range(300):
        progress = budget_progress(i, i * 1024, 0.0, cfg.train, 10)
        assert lrs[i] == pytest.approx(lr_at(i, progress, cfg.schedule, cfg.optim.lr))


def test_planned_lrs_follow_the_loop_for_an_hours_budget_at_the_measured_step_time():
    cfg = config("--train.max_steps", "null", "--train.max_hours", "0.01")  # 36 s
    lrs = planned(cfg, steps_done=100, tokens_per_step=1024, elapsed_s=12.0)  # 0.12 s/step
    assert len(lrs) == math.ceil(36 / 0.12)
    for i in range(len(lrs)):
        progress = budget_progress(i, i * 1024, i * 0.12, cfg.train, cfg.schedule.warmup_steps)
        assert lrs[i] == pytest.approx(lr_at(i, progress, cfg.schedule, cfg.optim.lr))
    # a token budget reached first ends the plan there
    both = config("--train.max_steps", "1000", "--train.max_tokens", "20480")
    assert len(planned(both, steps_done=10, tokens_per_step=1024, elapsed_s=1.0)) == 20


def planned(cfg, **kwargs):
    """planned_lrs of a whole config: its budget, its schedule, its peak LR."""
    return planned_lrs(cfg.train, cfg.schedule, cfg.optim.lr, **kwargs)


def test_planned_lrs_of_a_kept_schedule_stay_at_the_floor_to_the_runs_end():
    """A resume that kept the original schedule (schedule.resume_horizon keep): the run goes on to its new budget,
    the LR decays by the original one and then stays at its floor, as the loop sets it."""
    cfg = config("--train.max_steps", "60", "--schedule.warmup_steps", "5")
    original = config("--train.max_steps", "30", "--schedule.warmup_steps", "5")
    kept = planned(cfg, steps_done=40, tokens_per_step=1024, elapsed_s=1.0, schedule=original.train)
    alone = planned(original, steps_done=20, tokens_per_step=1024, elapsed_s=1.0)
    assert len(kept) == 60 and np.array_equal(kept[:30], alone)
    floor = cfg.optim.lr * cfg.schedule.min_lr_ratio
    assert kept[30:] == pytest.approx(np.full(30, floor)) and kept[29] > floor
    for i in range(60):
        progress = budget_progress(i, i * 1024, 0.0, original.train, 5)
        assert kept[i] == pytest.approx(lr_at(i, progress, cfg.schedule, cfg.optim.lr))


@pytest.fixture(scope="module")
def tiny_run(shakespeare_bytes, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("forecast") / "run"
    cfg = load_config(
        DEBUG,
        [
            *("--data.path", str(shakespeare_bytes), "--run.out_dir", str(run_dir)),
            *("--train.max_steps", "60", "--train.eval_every", "5", "--train.eval_windows", "16"),
            *("--checkpoint.every", "0", "--schedule.warmup_steps", "3", "--train.target_loss", "2.0"),
        ],
    )
    train(cfg, log=lambda line: None)
    return run_dir


def test_a_run_resumed_with_its_schedule_kept_is_forecast_to_its_new_end(tiny_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run, run_dir)
    cfg = read_run_config(run_dir)
    assert kept_schedule(run_dir, cfg.train, cfg.schedule) is None  # not resumed: the run's own budget
    resumed = load_config(
        DEBUG,
        [
            *("--data.path", cfg.data.path, "--run.out_dir", str(run_dir)),
            *("--train.max_steps", "90", "--train.eval_every", "5", "--train.eval_windows", "16"),
            *("--checkpoint.every", "0", "--schedule.warmup_steps", "3", "--schedule.resume_horizon", "keep"),
        ],
    )
    train(resumed, resume=True, log=lambda line: None)
    cfg = read_run_config(run_dir)
    assert cfg.train.max_steps == 90 and kept_schedule(run_dir, cfg.train, cfg.schedule).max_steps == 60
    assert forecast_run(run_dir).final_step == 90
    # the forecasts printed during the resumed part ran to the run's end too
    steps = [r["forecast_step"] for r in read_records(run_dir) if r["step"] > 60 and "forecast_step" in r]
    assert steps and set(steps) == {90}


def hopperlm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hopperlm", *args], capture_output=True, text=True, cwd=REPO)


def test_the_forecast_verb_prints_a_line_and_writes_json(tiny_run, tmp_path):
    out = tmp_path / "f.json"
    done = hopperlm("forecast", str(tiny_run), "--using", "0.5", "--json", str(out))
    assert done.returncode == 0, done.stderr
    line = done.stdout.splitlines()[0]
    assert line.startswith("forecast: ") and "at step 60 (the budget's end); target 2:" in line
    data = json.loads(out.read_text())
    assert data["low"] <= data["final_val_loss"] <= data["high"] and data["at_step"] == 30
    assert data["target"] == 2.0


@pytest.mark.parametrize(
    "args, says",
    [
        (["forecast", "{tmp}/nothing"], "not found"),
        (["forecast", "{tmp}"], "metrics.jsonl not found"),
        (["forecast", "{run}", "--using", "0.1"], "has 1 validation losses by step 5"),
        (["forecast", "{run}", "--using", "0"], "must be a number in (0, 1]"),
        (["forecast", "{run}", "--using", "1.5"], "must be a number in (0, 1]"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(tiny_run, tmp_path, args, says):
    done = hopperlm(*(a.format(tmp=tmp_path, run=tiny_run) for a in args))
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and says in done.stderr, done.stderr


def _benchmark():
    import forecast_accuracy  # bench/ is on pytest's pythonpath (pyproject.toml)

    return forecast_accuracy


def test_every_benchmark_run_names_a_corpus_that_is_there():
    # the full sets only train by hand (minutes to hours): a misspelt book would surface there, after others trained
    bench = _benchmark()
    for name, (runs, *_) in bench.SETS.items():
        for run, spec in runs.items():
            missing = [str(f) for f in bench.TEXTS[spec[0]] if not f.is_file()]
            assert not missing, f"set {name}, run {run}: {missing}"


@pytest.mark.slow
def test_the_benchmark_runs_in_smoke_mode(tmp_path):
    forecast_accuracy = _benchmark()
    result = forecast_accuracy.main(["--smoke", "--runs", str(tmp_path), "--save", str(tmp_path / "r.json")])
    for method in result["methods"].values():
        assert method["summary"]["runs"] == 2
        assert all(r["low"] <= r["final_val_loss"] <= r["high"] for r in method["rows"])
    assert json.loads((tmp_path / "r.json").read_text())["using"] == 0.3
