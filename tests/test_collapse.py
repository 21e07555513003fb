"""Forecast by scaling collapse (observe/collapse.py): curves that share one shape are forecast exactly from a
third of the run, noise widens the interval, and proxies that do not match the run are refused in one line."""

import contextlib
import io
import json
import math
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from hopperlm.cli import main
from hopperlm.config import config_from_dict
from hopperlm.errors import ConfigError
from hopperlm.observe import collapse
from hopperlm.observe.collapse import Curve, check_proxies, collapse_forecast, lr_shape, tokens_mismatch
from hopperlm.train.loop import train

REPO = Path(__file__).resolve().parents[1]
T = 400
COSINE = [min(1.0, (i + 1) / 20) * 0.5 * (1 + math.cos(math.pi * i / T)) for i in range(T)]


def g(tau: float) -> float:
    """A shared shape: falls fast, then slowly, and ends at 0 (the cosine's anneal)."""
    return (tau + 0.03) ** -0.6 - 1.03**-0.6 * (1 - 0.2 * (1 - tau))


def curve(width: int, floor: float, scale: float, *, seed: int = 0, noise: float = 0.0, **changes) -> Curve:
    rng = random.Random(width * 100 + seed)
    steps = range(10, T + 1, 10)
    values = {
        "label": f"width-{width} seed {seed}",
        "width": width,
        "params": width * width * 24,
        "seed": seed,
        "final_step": T,
        "tokens_per_param": 20.0,
        "lr_shape": lr_shape(COSINE),
        "warmup_fraction": 20 / T,
        "parametrization": "mup/completep",
        "data": "/data/books",
        "val": [(s, floor + scale * g(s / T) + rng.gauss(0, noise)) for s in steps],
    }
    return Curve(**{**values, **changes})


def proxies(noise: float = 0.0) -> list[Curve]:
    # smaller models end higher and fall from higher: floor and scale differ, the shape does not
    return [
        curve(w, 4.0 - 0.3 * math.log2(w / 32), 0.8 + 0.05 * math.log2(w / 32), seed=s, noise=noise)
        for w in (32, 48, 64, 96)
        for s in (1, 2)
    ]


def test_a_run_of_the_proxies_shape_is_forecast_exactly_from_its_first_30_percent():
    run = curve(256, 3.1, 0.9)
    got = collapse_forecast(run, proxies(), using=0.3)
    assert got.final_val_loss == pytest.approx(3.1, rel=1e-4)
    assert got.low <= 3.1 <= got.high and got.widths == [32, 48, 64, 96]
    assert got.at_step == 120 and got.final_step == T
    # what the run was given stays within 30%: its later points change nothing
    later = curve(256, 3.1, 0.9)
    later = Curve(**{**later.to_dict(), "val": [(s, v + (1.0 if s > 120 else 0)) for s, v in later.val]})
    assert collapse_forecast(later, proxies(), using=0.3).final_val_loss == got.final_val_loss
    assert "forecast by collapse: 3.100" in got.line(3.2) and got.line(3.2).endswith("likely")


def test_noisy_proxies_widen_the_interval_and_it_still_covers():
    quiet = collapse_forecast(curve(256, 3.1, 0.9), proxies(), using=0.3)
    noisy_run = curve(256, 3.1, 0.9, noise=0.01)
    noisy = collapse_forecast(noisy_run, proxies(noise=0.01), using=0.3)
    assert noisy.high - noisy.low > quiet.high - quiet.low
    assert noisy.low <= 3.1 <= noisy.high  # the end without the noise of its own evaluation
    assert set(noisy.spreads) == {"backtest", "leave_one_out", "seeds", "fit"} and noisy.spreads["seeds"] > 0


def test_a_shape_the_proxies_do_not_share_is_not_forecast_exactly():
    """The method's own limit: a run whose curve has another shape is missed (here by more than 1%)."""
    other = curve(256, 3.1, 0.9)
    bent = Curve(**{**other.to_dict(), "val": [(s, 3.1 + 0.9 * g(s / T) ** 1.5) for s, _ in other.val]})
    got = collapse_forecast(bent, proxies(), using=0.3)
    assert abs(got.final_val_loss / 3.1 - 1) > 0.01


def test_a_shape_that_drifts_with_size_is_carried_to_the_run_by_collapse_width():
    """Normalised curves that drift smoothly in log(parameters) do not collapse: the average shape misses the
    wider run, the shape extrapolated in size (method collapse-width) finds it."""
    t = np.linspace(0.05, 0.3, 64)
    m = float(np.mean((1 - t) * t) / np.mean(1 - t))  # the drift's mean over the window is 0

    def drifting(width: int, floor: float, scale: float, seed: int = 0) -> Curve:
        base = curve(width, floor, scale, seed=seed)
        k = 0.3 * math.log(base.params / 24_000)
        val = [(s, floor + scale * (g(s / T) + k * (1 - s / T) * (s / T - m))) for s, _ in base.val]
        return Curve(**{**base.to_dict(), "val": val})

    drifted = [
        drifting(w, 4.0 - 0.3 * math.log2(w / 32), 0.8, seed=s) for w in (32, 48, 64, 96) for s in (1, 2)
    ]
    run = drifting(256, 3.1, 0.9)
    assert abs(collapse_forecast(run, drifted, using=0.3).final_val_loss / 3.1 - 1) > 0.03
    got = collapse_forecast(run, drifted, using=0.3, extrapolate=True)
    assert got.final_val_loss == pytest.approx(3.1, rel=1e-3) and got.method == "collapse-width"
    assert got.line().startswith("forecast by collapse, its shape extrapolated in size: 3.100")
    # on curves that do collapse it is the plain collapse's forecast
    same = collapse_forecast(curve(256, 3.1, 0.9), proxies(), using=0.3, extrapolate=True)
    assert same.final_val_loss == pytest.approx(3.1, rel=1e-4)


@pytest.mark.parametrize(
    "change, says",
    [
        ({"parametrization": "standard/standard"}, "is standard/standard, the run mup/completep"),
        ({"data": "/data/other"}, "trained on /data/other, the run on /data/books"),
        ({"lr_shape": lr_shape([1.0] * T)}, "LR schedule has another shape than the run's"),
    ],
)
def test_proxies_that_do_not_match_the_run_are_named(change, says):
    run = curve(256, 3.1, 0.9)
    bad = [curve(32, 4.0, 0.8, **change), *proxies()[2:]]
    assert says in check_proxies(run, bad)
    with pytest.raises(ConfigError, match="forecast --proxies: proxy width-32 seed 0"):
        collapse_forecast(run, bad, using=0.3)


def test_fewer_than_three_widths_and_other_tokens_per_parameter():
    run = curve(256, 3.1, 0.9)
    two = [p for p in proxies() if p.width in (32, 48)]
    assert (
        check_proxies(run, two)
        == "the proxies have 2 finished width(s) ([32, 48]); the collapse needs 3 or more"
    )
    assert tokens_mismatch(run, proxies()) is None
    longer = Curve(**{**run.to_dict(), "tokens_per_param": 40.0})
    assert tokens_mismatch(longer, proxies()) == "the proxies trained 20 tokens per parameter, the run 40"


def test_too_few_points_in_the_window_is_one_line():
    run = curve(256, 3.1, 0.9)
    with pytest.raises(ConfigError, match="fewer than 4 validation losses between 5% and 8%"):
        collapse_forecast(run, proxies(), using=0.08)


def test_the_shape_is_zero_at_the_end_and_one_on_average_over_the_window():
    taus = np.linspace(0.05, 0.3, 64)
    f = collapse.shape(proxies(), (0.05, 0.3), taus)
    assert float(np.mean(f)) == pytest.approx(1.0, abs=1e-6)
    assert collapse.shape(proxies(), (0.05, 0.3), np.array([1.0]))[0] == pytest.approx(0.0, abs=1e-9)


def _benchmark():
    import forecast_collapse  # bench/ is on pytest's pythonpath: its pool's workers unpickle its functions by name

    return forecast_collapse


def cli(*args: str) -> tuple[int, str, str]:
    """`hopperlm ARGS` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


@pytest.mark.slow  # trains 4 tiny runs (about 25 s)
def test_the_benchmark_runs_in_smoke_mode_and_forecast_takes_its_proxies(tmp_path):
    bench = _benchmark()
    argv = [
        "--smoke",
        "--work",
        str(tmp_path),
        "--save",
        str(tmp_path / "r.json"),
        "--variant",
        "collapse-width",
    ]
    result = bench.main(argv)
    rows = result["rows"]
    assert {(r["method"], r["using"]) for r in rows} == {("proxies", None), ("collapse", 0.3), ("collapse", 0.5),
                                                          ("law", 0.3), ("law", 0.5), ("collapse-width", 0.3),
                                                          ("collapse-width", 0.5)}  # fmt: skip
    assert result["variant"]["method"] == "collapse-width"
    keys = {
        "corpus",
        "schedule",
        "run",
        "width",
        "seed",
        "method",
        "using",
        "forecast",
        "low",
        "high",
        "final",
    }
    assert all(keys <= set(r) for r in rows) and json.loads((tmp_path / "r.json").read_text())["rows"] == rows
    collapsed = [r for r in rows if r["method"] == "collapse"]
    assert all(r["low"] <= r["forecast"] <= r["high"] and r["width"] == 48 for r in collapsed)
    assert all(r["low"] <= r["forecast"] <= r["high"] for r in rows if r["method"] == "collapse-width")
    # the CLI on the same runs: a sweep folder whose forecast.json keeps the proxies' curves
    runs = tmp_path / "smoke" / "runs" / "shakespeare" / "wsd"
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    curves = [collapse.curve_of_run(p).to_dict() for p in sorted(runs.glob("width-*"))]
    (sweep / "forecast.json").write_text(json.dumps({"curves": curves}))
    code, out, err = cli("forecast", str(runs / "big-48-seed-1"), "--using", "0.3", "--proxies", str(sweep))
    assert code == 0, err
    want = next(r for r in collapsed if r["using"] == 0.3)
    assert f"forecast by collapse: {want['forecast']:.3f} ({want['low']:.3f}-{want['high']:.3f})" in out
    # bad inputs: one line each, exit 2
    (sweep / "forecast.json").write_text(json.dumps({"curves": curves[:2]}))
    code, _, err = cli("forecast", str(runs / "big-48-seed-1"), "--using", "0.3", "--proxies", str(sweep))
    assert code == 2 and "the collapse needs 3 or more" in err and len(err.strip().splitlines()) == 1
    code, _, err = cli("forecast", str(runs / "big-48-seed-1"), "--proxies", str(tmp_path))
    assert code == 2 and "no proxy curves there" in err
    partial = tmp_path / "partial"
    shutil.copytree(runs / "big-48-seed-1", partial)
    lines = (partial / "metrics.jsonl").read_text().splitlines()
    (partial / "metrics.jsonl").write_text("\n".join(lines[: len(lines) // 5]) + "\n")
    (sweep / "forecast.json").write_text(json.dumps({"curves": curves}))
    code, _, err = cli("forecast", str(partial), "--using", "0.5", "--proxies", str(sweep))
    assert code == 2 and "has validation losses up to" in err and "--using 0.5" in err
    # a run whose recipe names the proxies (train.forecast_from) forecasts by collapse at its evaluations
    spec = yaml.safe_load((runs / "big-48-seed-1" / "config.yaml").read_text())
    spec["train"]["forecast_from"] = str(sweep / "forecast.json")
    spec["run"]["out_dir"] = str(tmp_path / "again")
    lines = []
    train(config_from_dict(spec), log=lines.append)
    said = [line for line in lines if line.startswith("forecast by collapse: ")]
    assert said and "proxies at widths 16, 24, 32" in said[-1], [ln for ln in lines if "forecast" in ln]
    # and `diagnose` of that recipe shows it beside the law's line, from the run folder's evaluations so far
    code, out, err = cli(
        "diagnose", str(tmp_path / "again" / "config.yaml"), "--simulate", "CPU", "--no-selftest"
    )
    assert code == 0, err
    shown = out.splitlines()
    law = next(i for i, line in enumerate(shown) if line.startswith("forecast: "))
    assert shown[law + 1] == said[-1], shown[law:]


def test_training_records_the_collapse_beside_the_law_with_matching_proxies():
    from hopperlm.config import ScheduleConfig, TrainConfig
    from hopperlm.observe.forecast_log import Forecaster

    tc = TrainConfig(max_steps=T, max_hours=None, seq_len=64, micro_batch=16)
    sc = ScheduleConfig(name="cosine", warmup_steps=20, min_lr_ratio=0.0)
    truth = curve(256, 3.1, 0.9)
    run = {"label": "this run", "width": 256, "params": truth.params, "seed": 0, "warmup_steps": 20,
           "parametrization": truth.parametrization, "data": truth.data}  # fmt: skip
    lines = []
    tokens_per_step = round(truth.tokens_per_param * truth.params / T)
    record = {"step": 120, "tokens": 120 * tokens_per_step, "elapsed_s": 60.0}
    seen = [(s, v) for s, v in truth.val if s <= 120]
    forecaster = Forecaster(tc, sc, 3e-4, lines.append, proxies=proxies(), run=run)
    law = forecaster.at(record, seen, [])
    # the law stays the forecast (the better one on the CPU benchmark); the collapse is recorded and said beside it
    assert law.method == "prior" and record["forecast"] == law.final_val_loss
    assert record["forecast_collapse"] == pytest.approx(3.1, rel=2e-3)
    forecaster.report(law)
    assert lines[0].startswith("forecast: ") and lines[1].startswith("forecast by collapse: 3.10")
    # proxies of another parametrization: one line, then the law alone
    other = [Curve(**{**p.to_dict(), "parametrization": "standard/standard"}) for p in proxies()]
    lines.clear()
    forecaster = Forecaster(tc, sc, 3e-4, lines.append, proxies=other, run=run)
    record = {"step": 120, "tokens": 120 * tokens_per_step, "elapsed_s": 60.0}
    forecaster.at(record, seen, [])
    assert len(lines) == 1 and "no forecast by collapse" in lines[0] and "forecast_collapse" not in record
    forecaster.at(dict(record), seen, [])
    assert len(lines) == 1  # said once
