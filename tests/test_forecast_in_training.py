"""The forecast where a user sees it: evaluation lines, metrics.jsonl, the loss plot, the out-of-reach warning,
and what a wall-clock budget buys in the banner and in `hopperlm diagnose` (observe/forecast.py fits it)."""

import subprocess
import sys
from pathlib import Path

import pytest
from test_train import debug_config

from hopperlm.observe.metrics import read_metrics
from hopperlm.observe.plot import plot_runs
from hopperlm.train.loop import train

REPO = Path(__file__).resolve().parents[1]


def test_evaluations_carry_a_forecast_and_an_unreachable_target_is_warned(shakespeare_bytes, tmp_path):
    run_dir = tmp_path / "run"
    cfg = debug_config(
        shakespeare_bytes,
        run_dir,
        *("--train.max_steps", "100", "--train.eval_every", "10", "--train.eval_windows", "16"),
        *("--train.target_loss", "0.2", "--checkpoint.every", "0", "--log.report", "false"),
    )
    lines = []
    train(cfg, log=lines.append)
    records = read_metrics(run_dir / "metrics.jsonl")
    forecasts = [r for r in records if "forecast" in r]
    assert forecasts, "no evaluation carried a forecast"
    assert all("val_loss" in r for r in forecasts)  # made at evaluations only
    for r in forecasts:
        assert r["forecast_low"] <= r["forecast"] <= r["forecast_high"] and r["forecast_step"] == 100
    # the last forecast is near where the run landed (a 100-step CPU run: loose; the benchmark measures it)
    final = records[-1]["val_loss"]
    assert abs(forecasts[-1]["forecast"] - final) < 0.1 * final
    said = [line for line in lines if line.startswith("forecast: ")]
    assert len(said) == len(forecasts) and "target 0.2: unlikely" in said[-1]
    warnings = [line for line in lines if line.startswith("warning: target 0.2 looks out of reach")]
    assert warnings and ("this budget would reach it" in warnings[0] or "not even" in warnings[0])
    assert len(warnings) <= len(forecasts)  # repeated only when the advice changes

    written = plot_runs([run_dir], tmp_path / "plots")  # the loss plot draws the latest forecast
    assert (tmp_path / "plots" / "loss.png") in written


@pytest.mark.slow
def test_a_wall_clock_budget_says_what_it_buys(shakespeare_bytes, tmp_path):
    run_dir = tmp_path / "run"
    cfg = debug_config(
        shakespeare_bytes,
        run_dir,
        *("--train.max_steps", "null", "--train.max_hours", "0.002", "--train.eval_every", "0"),
        *("--checkpoint.every", "0", "--log.report", "false", "--log.tensorboard", "false"),
    )
    lines = []
    train(cfg, log=lines.append)
    bought = [line for line in lines if line.startswith("budget: 7 s at ")]
    assert len(bought) == 2, lines  # the banner's bound, then the speed measured after warm-up
    assert "the matmul-bound upper bound" in bought[0] and "measured after warm-up" in bought[1]
    assert all("per parameter" in line for line in bought)


def test_diagnose_prints_the_budget_of_a_wall_clock_recipe():
    out = subprocess.run(
        [sys.executable, "-m", "hopperlm", "diagnose", "owt-350m-h100", "--simulate", "H100 80GB"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("budget: 1.5 h at "))
    assert "45% MFU" in line and "per parameter" in line


def test_a_longer_budget_keeps_hours_fractional():
    """The out-of-reach advice scales the budget: a YAML `max_hours: 2` is an int, and 1.25x of it is 2.5 h."""
    from hopperlm.observe.forecast_log import _scaled

    assert _scaled("max_hours", 2, 1.25) == 2.5 and _scaled("max_hours", 0.002, 1.25) == 0.0025
    assert _scaled("max_steps", 1000, 1.25) == 1250 and _scaled("max_tokens", 10**6, 1.5) == 1_500_000
