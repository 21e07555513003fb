"""Progress and ETA under each stopping rule, and the one that ends the run first: pure functions, no training."""

import io
import time

import pytest

from hopperlm.config import TrainConfig
from hopperlm.observe.progress import (
    Rate,
    RateMeter,
    RichProgress,
    Snapshot,
    choose_progress,
    ending_rule,
    eta_text,
    format_duration,
    rule_progress,
    steps_to_target,
)

RATE = Rate(steps_per_s=2.0, tokens_per_s=2048.0)  # 1,024 tokens per step


def by_rule(rules):
    return {r.rule: r for r in rules}


def test_max_steps():
    rules = rule_progress(300, 300 * 1024, 150.0, TrainConfig(max_steps=1000), RATE)
    (r,) = rules
    assert r.rule == "max_steps" and r.fraction == pytest.approx(0.3)
    assert r.remaining_s == pytest.approx(700 / 2.0)
    assert r.detail == "step 300/1,000" and not r.estimate
    assert eta_text(r) == "30% ETA 5m50s (max_steps)"


def test_max_tokens():
    (r,) = rule_progress(10, 10_240, 5.0, TrainConfig(max_tokens=102_400), RATE)
    assert r.rule == "max_tokens" and r.fraction == pytest.approx(0.1)
    assert r.remaining_s == pytest.approx((102_400 - 10_240) / 2048.0)
    assert r.detail == "10.24K/102.40K tokens"


def test_max_hours_needs_no_speed():
    (r,) = rule_progress(5, 5120, 900.0, TrainConfig(max_hours=0.5), rate=None)
    assert r.rule == "max_hours" and r.fraction == pytest.approx(0.5)
    assert r.remaining_s == pytest.approx(900.0)  # the clock is the budget: known before any speed
    assert eta_text(r, since_s=60.0) == "50% ETA 14m00s (max_hours)"  # the live display counts down
    (over,) = rule_progress(5, 5120, 2000.0, TrainConfig(max_hours=0.5), rate=None)
    assert over.fraction == 1.0 and over.remaining_s == 0.0


def test_target_loss_extrapolates_the_validation_curve():
    tc = TrainConfig(max_steps=100_000, target_loss=2.0)
    # loss = 5 - 0.5 ln(step): reaches 2.0 at step e^6 = 403.4
    import math

    points = [(s, 5 - 0.5 * math.log(s)) for s in (50, 100, 150, 200)]
    assert steps_to_target(points, 2.0) == pytest.approx(math.exp(6) - 200, rel=1e-6)
    rules = by_rule(rule_progress(200, 200 * 1024, 100.0, tc, RATE, points))
    target = rules["target_loss"]
    assert target.estimate and target.remaining_s == pytest.approx((math.exp(6) - 200) / 2.0, rel=1e-6)
    first, last = points[0][1], points[-1][1]
    assert target.fraction == pytest.approx((first - last) / (first - 2.0))
    # the target comes long before 100,000 steps: it is the rule that ends the run, shown as an estimate
    assert ending_rule(list(rules.values())).rule == "target_loss"
    assert eta_text(target) == f"{100 * target.fraction:.0f}% ETA ~1m42s (target_loss)"


def test_target_loss_without_a_falling_trend_has_no_eta():
    assert steps_to_target([], 2.0) is None
    assert steps_to_target([(100, 3.0)], 2.0) is None  # one evaluation: no trend yet
    assert steps_to_target([(100, 3.0), (200, 3.1)], 2.0) is None  # rising
    assert steps_to_target([(100, 3.0), (200, 1.9)], 2.0) == 0.0  # already there
    tc = TrainConfig(max_steps=1000, target_loss=2.0)
    rules = by_rule(rule_progress(200, 0, 100.0, tc, RATE, [(100, 3.0), (200, 3.1)]))
    assert rules["target_loss"].remaining_s is None and rules["target_loss"].fraction == 0.0
    assert ending_rule(list(rules.values())).rule == "max_steps"
    assert eta_text(rules["target_loss"]) == "0% ETA ? (target_loss)"


def test_the_rule_that_ends_first_wins():
    tc = TrainConfig(max_steps=1000, max_tokens=10_000_000, max_hours=1.0)
    # at 2 steps/s: 1000 steps take 500 s, 10M tokens 4883 s, the clock 3600 s -> steps end the run
    rules = rule_progress(0, 0, 0.0, tc, RATE)
    assert [r.rule for r in rules] == ["max_steps", "max_tokens", "max_hours"]
    assert ending_rule(rules).rule == "max_steps"
    # a slow machine (0.1 step/s): 10,000 s for the steps, 48,828 s for the tokens: the clock ends it
    slow = Rate(0.1, 102.4)
    assert ending_rule(rule_progress(0, 0, 0.0, tc, slow)).rule == "max_hours"
    # no speed measured yet: the clock is the only ETA
    assert ending_rule(rule_progress(0, 0, 10.0, tc, None)).rule == "max_hours"
    # without any ETA, the most used budget
    tc2 = TrainConfig(max_steps=1000, max_tokens=100_000)
    assert ending_rule(rule_progress(100, 50_000, 10.0, tc2, None)).rule == "max_tokens"


def test_rate_meter_skips_the_warm_up_interval_and_restarts_after_rollback():
    meter = RateMeter(step=0, tokens=0, elapsed_s=0.0)
    assert meter.rate() is None
    meter.mark(10, 10_240, 30.0)  # includes compilation: 10 steps in 30 s
    assert meter.rate() == Rate(10 / 30.0, 10_240 / 30.0)  # the only interval there is
    meter.mark(20, 20_480, 35.0)
    meter.mark(30, 30_720, 40.0)
    assert meter.rate().steps_per_s == pytest.approx(2.0)  # from the second mark on: steady state
    meter.mark(15, 15_360, 41.0)  # the guard rolled back to step 15
    assert meter.rate() is None
    meter.mark(25, 25_600, 46.0)
    assert meter.rate().steps_per_s == pytest.approx(2.0)


def test_a_resumed_run_counts_from_its_checkpoint():
    meter = RateMeter(step=500, tokens=512_000, elapsed_s=1000.0)
    meter.mark(510, 522_240, 1005.0)
    (r,) = rule_progress(510, 522_240, 1005.0, TrainConfig(max_steps=1000), meter.rate())
    assert r.fraction == pytest.approx(0.51) and r.remaining_s == pytest.approx(490 / 2.0)


def test_format_duration():
    assert [format_duration(s) for s in (0, 59.4, 61, 3599, 3661, 90_000, -5)] == [
        "0s",
        "59s",
        "1m01s",
        "59m59s",
        "1h01m",
        "1d01h",
        "0s",
    ]


class FakeStream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def test_progress_mode_follows_the_terminal():
    assert choose_progress("auto", FakeStream(True))[0] == "rich"
    mode, why = choose_progress("auto", FakeStream(False))
    assert mode == "plain" and "not a terminal" in why
    assert choose_progress("rich", FakeStream(False))[0] == "rich"
    assert choose_progress("plain", FakeStream(True))[0] == "plain"


def test_rich_display_renders_bar_eta_and_numbers():
    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, width=200, force_terminal=False, color_system=None)
    display = RichProgress(console)
    tc = TrainConfig(max_steps=1000, max_hours=1.0)
    rules = rule_progress(250, 256_000, 120.0, tc, RATE)
    record = {
        "step": 250,
        "tokens": 256_000,
        "loss": 2.3456,
        "lr": 3e-4,
        "grad_norm": 0.52,
        "tokens_per_s": 15_200.0,
        "mfu": 0.412,
        "peak_mem_gb": 12.3,
        "gpu_util": 97.0,
        "gpu_power_w": 650.0,
        "gpu_temp_c": 71.0,
    }
    display.update(Snapshot(record, rules, ending_rule(rules), 2.40, 2.41, taken_at=time.perf_counter()))
    console.print(display.render())
    text = out.getvalue()
    assert "25% ETA 6m15s (max_steps)" in text and "step 250/1,000" in text and "2m00s/1h00m" in text
    for word in (
        "train loss 2.3456 (mean since last line)",
        "val 2.4100 (best 2.4000)",
        "15.20K tok/s",
        "MFU 41.2%",
        "GPU 97% 650 W 71 C",
    ):
        assert word in text, word


def test_budgets_are_shown_in_the_unit_a_person_would_use():
    from hopperlm.observe.metrics import human_hours

    assert [human_hours(h) for h in (95 / 3600, 0.0264, 0.2, 1.5, 24)] == [
        "95 s",
        "95 s",
        "12 min",
        "1.5 h",
        "24 h",
    ]
    assert human_hours(2.0) == "2 h" and human_hours(0.002) == "7 s"


def test_the_progress_line_labels_its_train_loss_as_a_window_mean():
    """A train loss of 4.18 (the mean since the last line) beside a val loss of 2.61 confused a user unlabelled."""
    from hopperlm.observe.metrics import format_record

    record = {
        "step": 50,
        "tokens": 51_200,
        "loss": 4.18,
        "val_loss": 2.61,
        "lr": 8e-3,
        "grad_norm": 0.52,
        "tokens_per_s": 1_200.0,
        "mfu": None,
        "step_time_s": 1.6,
        "peak_mem_gb": 0.31,
    }
    line = format_record(record, 50)
    assert line.startswith("step 50/50 | train loss 4.1800 (mean since last line) | val 2.6100 | lr 8.00e-03")
