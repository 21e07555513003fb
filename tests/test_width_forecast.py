"""observe/width_forecast.py: the big run's final loss from proxy runs at several widths. A law it knows is
recovered, the backtest picks the law that extrapolates, the interval covers the seeds' noise, and what it
cannot forecast is one clear error."""

import json

import pytest

from hopperlm.errors import ConfigError
from hopperlm.observe.width_forecast import forecast, load

WIDTHS = (64, 96, 128, 192, 256)


def params(width: int) -> int:
    return 24 * width * width + 2048 * width  # two blocks of 12 d^2 and a 1,024-piece vocabulary, untied


def points(law, noise=0.0):
    return [
        {"width": w, "params": params(w), "seed": seed, "final_val_loss": law(params(w)) + sign * noise}
        for w in WIDTHS
        for seed, sign in ((1, 1), (2, -1))
    ]


def test_a_power_law_with_a_floor_is_recovered_at_the_big_width():
    law = lambda n: 1.8 + 40.0 * n**-0.3  # noqa: E731
    got = forecast(points(law), target_params=params(512), tokens_per_param=0.1)
    assert got.final_val_loss == pytest.approx(law(params(512)), rel=2e-3)
    assert got.backtest["fitted_widths"] == [64, 96, 128] and got.backtest["forecast_width"] == 256
    assert abs(got.backtest["relative_error"][got.law]) < 2e-3


def test_the_backtest_chooses_the_law_that_extrapolates():
    import math

    log_law = lambda n: 9.0 - 0.35 * math.log(n)  # noqa: E731  (a line in log N: the floor law bends away)
    got = forecast(points(log_law), target_params=params(512), tokens_per_param=0.1)
    assert got.law == "log" and got.final_val_loss == pytest.approx(log_law(params(512)), rel=1e-4)


def test_the_interval_covers_the_seeds_noise_and_the_line_names_the_budget(tmp_path):
    law = lambda n: 1.8 + 40.0 * n**-0.3  # noqa: E731
    got = forecast(points(law, noise=0.02), target_params=params(512), tokens_per_param=0.1)
    assert got.low < law(params(512)) < got.high and got.high - got.low > 0.02
    assert "0.1 tokens per parameter" in got.line() and "widths 64-256, 10 runs" in got.line()
    assert "does not apply" not in got.line(0.1 * params(512))
    assert "not the proxies'" in got.line(0.5 * params(512))
    got.save(tmp_path / "forecast.json")
    assert load(tmp_path / "forecast.json") == got


def test_what_cannot_be_forecast_is_one_clear_error(tmp_path):
    law = lambda n: 1.8 + 40.0 * n**-0.3  # noqa: E731
    two = [p for p in points(law) if p["width"] in (64, 96)]
    with pytest.raises(ConfigError, match="finished runs at 3 or more widths, got 2"):
        forecast(two, target_params=params(512), tokens_per_param=0.1)
    failed = [{**p, "final_val_loss": None} if p["width"] == 128 else p for p in points(law)]
    got = forecast(failed, target_params=params(512), tokens_per_param=0.1)  # a failed width is left out
    assert got.backtest["fitted_widths"] == [64, 96, 192] and len(got.points) == 8
    with pytest.raises(ConfigError, match="not beyond the widest proxy"):
        forecast(points(law), target_params=params(256), tokens_per_param=0.1)
    (tmp_path / "bad.json").write_text(json.dumps({"law": "floor"}))
    with pytest.raises(ConfigError, match="not a forecast written by `hopperlm sweep --widths`"):
        load(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="rerun the sweep or remove the key"):
        load(tmp_path / "missing.json")


def test_the_banner_shows_the_forecast_and_a_lost_file_costs_the_line_not_the_run(tmp_path):
    from hopperlm.config import TrainConfig
    from hopperlm.train.banner import proxy_forecast_line

    law = lambda n: 1.8 + 40.0 * n**-0.3  # noqa: E731
    got = forecast(points(law), target_params=params(512), tokens_per_param=0.1)
    got.save(tmp_path / "forecast.json")
    steps = round(0.1 * params(512) / 256)
    tc = TrainConfig(max_steps=steps, forecast_from=str(tmp_path / "forecast.json"))
    line = proxy_forecast_line(tc, params=params(512), tokens_per_step=256)
    assert line.startswith(f"forecast from proxies: final val loss {got.final_val_loss:.3f}")
    assert "this run: 0.1 tokens per parameter" in line and "not the proxies'" not in line
    assert "made for" in proxy_forecast_line(tc, params=params(256), tokens_per_step=256)
    lost = TrainConfig(max_steps=steps, forecast_from=str(tmp_path / "gone.json"))
    assert proxy_forecast_line(lost, params=params(512), tokens_per_step=256).startswith(
        "forecast from proxies: none (train.forecast_from"
    )


@pytest.mark.slow
def test_the_width_forecast_benchmark_runs_in_smoke_mode(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench" / "width_forecast.py"
    out = tmp_path / "wf.json"
    done = subprocess.run([sys.executable, str(bench), "--smoke", "--work", str(tmp_path / "w"), "--save", str(out)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert [p["width"] for p in record["forecast"]["points"]] == [32, 64, 96]
    assert record["big_run_mean"] > 0 and record["error"] == pytest.approx(
        record["forecast"]["final_val_loss"] / record["big_run_mean"] - 1, abs=1e-4
    )
    assert "error" in done.stdout and "goal 1%" in done.stdout
