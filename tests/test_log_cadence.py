"""The log interval shrinks for a run that would print fewer than ~10 lines (issue 49: a demo printed one line in
131 s): from the run's length in steps, or from the speed its first steps show under a wall-clock budget."""

import re
from pathlib import Path

import pytest

from hopperlm.config import TrainConfig, load_config
from hopperlm.observe.log_cadence import LogCadence, shortened
from hopperlm.observe.metrics import read_metrics
from hopperlm.train.loop import train

DEBUG = Path(__file__).resolve().parents[1] / "configs" / "debug.yaml"


def cadence(lines: list[str], **train_keys) -> LogCadence:
    return LogCadence(TrainConfig(**train_keys), step=0, tokens_per_step=1024, log=lines.append)


@pytest.mark.parametrize(
    ("log_every", "steps", "every"),
    [
        (10, 1000, 10),  # 100 lines: as configured
        (10, 100, 10),  # exactly 10
        (10, 50, 5),  # the example
        (10, 20, 2),
        (10, 30, 2),  # 3 does not divide 10: checkpoints due every 10 would fall between log steps
        (50, 60, 5),  # the demo on a loaded machine: 60 steps at its recipe's 50
        (1000, 1000, 100),  # never above the configured value, and still a divisor of it
        (10, 3, 1),
        (1, 5, 1),
    ],
)
def test_the_interval_is_the_largest_divisor_that_prints_ten_lines(log_every, steps, every):
    assert shortened(log_every, steps) == every


def test_a_run_of_known_length_says_once_why_it_logs_more_often():
    lines = []
    c = cadence(lines, max_steps=50)
    assert c.every == 5 and c.probe is None
    assert lines == [
        "log: every 5 steps (not 10): this run has 50 steps, 5 lines at every 10; at least 10 show its course"
    ]
    assert [s for s in range(1, 51) if c.due(s)] == list(range(5, 51, 5))
    lines.clear()
    assert cadence(lines, max_steps=500).every == 10 and lines == []  # 50 lines already: nothing said
    assert cadence(lines, max_tokens=5000).every == 1  # ceil(5000 / 1024) = 5 steps
    assert lines == ["log: every 1 step (not 10): this run has 5 steps, 1 line at every 10"]


def test_a_wall_clock_run_times_its_first_steps_then_shrinks_the_interval_once():
    lines = []
    c = cadence(lines, max_hours=0.0264, log_every=50)  # the demo's recipe: 95 s, every 50
    assert lines == [] and [s for s in range(1, 50) if c.due(s)] == [1, 5]  # the first step, and 4 after it
    c.logged(1, 3.0)  # step 1 at 3 s (its compile and warm-up are left out of the speed)
    assert c.every == 50 and lines == []
    c.logged(5, 9.4)  # 1.6 s a step: (95 - 9.4) / 1.6 = 53 more steps, 58 in all
    assert c.every == 5 and lines == [
        "log: every 5 steps (not 50): the 95 s budget allows about 58 steps at 1.6 s/step, 2 lines at every 50; "
        "at least 10 show its course"
    ]
    assert [s for s in range(6, 21) if c.due(s)] == [10, 15, 20]  # the probe is over
    c.logged(10, 20.0)
    assert c.every == 5 and len(lines) == 1  # decided once


def test_a_fast_wall_clock_run_keeps_its_interval_and_a_step_budget_bounds_the_estimate():
    lines = []
    fast = cadence(lines, max_hours=0.0264, log_every=50)
    fast.logged(1, 1.0)
    fast.logged(5, 1.04)  # 10 ms a step: ~9,400 steps, 188 lines at every 50
    assert fast.every == 50 and lines == [] and not fast.due(6)
    both = cadence(lines, max_hours=1.0, max_steps=200)  # 20 lines by steps; the clock may end it sooner
    assert both.every == 10 and both.probe == (1, 5)
    both.logged(1, 1.0)
    both.logged(5, 401.0)  # 100 s a step: the hour allows 36 steps
    assert both.every == 2 and lines[-1].startswith(
        "log: every 2 steps (not 10): the 1 h budget allows about 36"
    )
    assert cadence(lines, max_hours=1.0, log_every=1).probe is None  # nothing to shrink: no probe


def debug_run(data, run, *overrides):
    extra = ["--checkpoint.every", "0", "--log.report", "false", "--log.tensorboard", "false"]
    return load_config(DEBUG, ["--data.path", str(data), "--run.out_dir", str(run), *extra, *overrides])


def test_a_20_step_run_logs_ten_lines_and_says_why(shakespeare_bytes, tmp_path):
    lines = []
    train(debug_run(shakespeare_bytes, tmp_path / "run", "--train.max_steps", "20"), log=lines.append)
    assert [x for x in lines if x.startswith("log: ")] == [
        "log: every 2 steps (not 10): this run has 20 steps, 2 lines at every 10; at least 10 show its course"
    ]
    step_lines = [x for x in lines if x.startswith("step ")]
    assert len(step_lines) == 10 and all(
        "train loss " in x and "(mean since last line)" in x for x in step_lines
    )
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")  # the plots' points follow the interval
    assert [r["step"] for r in records] == list(range(2, 21, 2))


def test_a_wall_clock_run_logs_its_first_steps_then_at_the_interval_it_chose(shakespeare_bytes, tmp_path):
    lines = []
    cfg = debug_run(
        shakespeare_bytes,
        tmp_path / "run",
        *("--train.max_steps", "null", "--train.max_hours", "0.001"),  # 3.6 s: under 1,000 steps anywhere
        *("--train.log_every", "1000", "--train.eval_every", "0"),
        *("--train.threads", "1"),  # (no spinning against the suite's other workers: enough steps fit)
    )
    result = train(cfg, log=lines.append)
    said = [x for x in lines if x.startswith("log: ")]
    assert len(said) == 1, lines
    every = re.fullmatch(r"log: every ([\d,]+) steps? \(not 1000\): the 4 s budget allows about .*", said[0])
    assert every, said
    steps = [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    # the first step and the fourth after it time the interval; the second times the clock's decisions
    # (train/clock_budget.py: the final evaluation's reserve, the warm-up)
    assert steps[:3] == [1, 2, 5] and steps[-1] == result.step
    assert all(s % int(every[1].replace(",", "")) == 0 for s in steps[3:-1]), (said, steps)
