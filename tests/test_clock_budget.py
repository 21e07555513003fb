"""A wall-clock budget the run keeps (train/clock_budget.py): training plus the final evaluation end at the
deadline, the LR decays by the end of training, a warm-up in steps that would not fit is laid on the clock, and
the tokens/s series leaves evaluations out."""

import time
from pathlib import Path

import pytest

from hopperlm.config import ScheduleConfig, TrainConfig, load_config
from hopperlm.observe import metrics
from hopperlm.observe.metrics import Interval, read_metrics
from hopperlm.train import evaluate, loop
from hopperlm.train.clock_budget import WARMUP_MAX_SHARE, ClockBudget

REPO = Path(__file__).resolve().parents[1]
QUIET = lambda line: None  # noqa: E731


def config(data, run, *extra):
    return load_config(
        REPO / "configs" / "debug.yaml", ["--data.path", str(data), "--run.out_dir", str(run), *extra]
    )


def slowed(monkeypatch, *, step_s: float, eval_batch_s: float) -> None:
    """Every training step and every evaluation batch takes at least this long: a loaded machine."""
    step, read = loop.train_step, evaluate.read_batch
    monkeypatch.setattr(loop, "train_step", lambda *a, **k: (time.sleep(step_s), step(*a, **k))[1])
    monkeypatch.setattr(evaluate, "read_batch", lambda *a, **k: (time.sleep(eval_batch_s), read(*a, **k))[1])


@pytest.mark.slow
def test_a_clock_budget_ends_at_its_deadline_decayed_and_warmed_up(shakespeare_bytes, tmp_path, monkeypatch):
    """The demo's case on a loaded machine: a warm-up of 50 steps where ~30 fit, and a final evaluation of about
    an eighth of the budget that no evaluation measured before (eval_every 0)."""
    slowed(monkeypatch, step_s=0.2, eval_batch_s=0.25)  # 64 windows = 4 batches: ~1 s of the 8 s
    budget_s = 8.0
    # one thread: a torch process spinning against the suite's other workers would be slowed many times over
    cfg = config(shakespeare_bytes, tmp_path / "run", "--train.max_steps", "null", "--train.max_hours",
                 str(budget_s / 3600), "--schedule.warmup_steps", "50", "--train.eval_every", "0",
                 "--train.eval_windows", "64", "--train.log_every", "1", "--checkpoint.every", "0",
                 "--train.threads", "1")  # fmt: skip
    lines = []
    result = loop.train(cfg, log=lines.append)
    assert result.stopped_by == "max_hours"
    assert abs(result.elapsed_s - budget_s) <= 0.05 * budget_s, lines[-3:]  # training + the final evaluation
    done = next(line for line in lines if line.startswith("done: max_hours"))
    assert abs(float(done.split(" tokens, ")[1].split(" s")[0]) - budget_s) <= 0.05 * budget_s
    assert any(
        line.startswith("budget: 8.0 s = ") and "for the final evaluation (estimated" in line
        for line in lines
    )
    assert any(line.startswith("warm-up: schedule.warmup_steps 50 would be") for line in lines)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    lrs = [r["lr"] for r in records]
    peak, floor = cfg.optim.lr, cfg.optim.lr * cfg.schedule.min_lr_ratio
    assert max(lrs) >= 0.9 * peak  # the warm-up finished (in steps it would have reached 30 of its 50: 0.6)
    assert lrs[-1] <= floor + 0.05 * (peak - floor)  # and the cosine reached its floor by the end of training
    assert "val_loss" in records[-1]


@pytest.mark.slow
def test_tokens_per_s_leaves_evaluations_out(shakespeare_bytes, tmp_path, monkeypatch):
    """An evaluation step's interval: its training time (step_time_s, what tokens_per_s divides by) is the
    interval's wall time less the evaluation, however loaded the machine."""
    eval_s = 4 * 0.3  # 64 windows = 4 batches, each read at least 0.3 s
    slowed(monkeypatch, step_s=0.0, eval_batch_s=0.3)
    cfg = config(shakespeare_bytes, tmp_path / "run", "--train.max_steps", "12", "--train.log_every", "1",
                 "--train.eval_every", "4", "--train.eval_windows", "64", "--checkpoint.every", "4")  # fmt: skip
    loop.train(cfg, log=QUIET)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    evaluated = [(before, r) for before, r in zip(records, records[1:], strict=False) if "val_loss" in r]
    assert len(evaluated) == 3
    for before, r in evaluated:
        wall = r["elapsed_s"] - before["elapsed_s"]  # the step, its evaluation, the save before it
        assert r["step_time_s"] <= wall - eval_s, (r, wall)
        assert r["tokens_per_s"] == pytest.approx(1024 / r["step_time_s"])


def test_an_interval_leaves_out_what_is_not_training(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    interval = Interval()
    interval.add(1000)
    interval.add(1000)
    now[0] += 12.0  # 2 s of steps, then a 10 s evaluation
    interval.exclude(10.0)
    assert interval.rates() == (1000.0, 1.0)
    interval.reset()
    assert interval.excluded == 0.0 and not interval.cold


def test_the_clock_budget_reserves_the_evaluation_and_rounds_to_the_nearest_step():
    clock = ClockBudget.for_run(TrainConfig(max_hours=100 / 3600))
    tc = TrainConfig(max_hours=100 / 3600)
    assert clock.schedule(tc) is tc and not clock.done(99.0)  # nothing reserved yet
    clock.timed(4, 8.0)  # 2 s a step
    clock.estimated(20.0, windows=864, timed=16, log=QUIET)
    assert clock.training_s == 80.0 and clock.schedule(tc).max_hours * 3600 == pytest.approx(80.0)
    assert clock.schedule(tc) is clock.schedule(tc)  # laid once per reserve
    assert not clock.done(78.9) and clock.done(79.0)  # within half a step of the end
    assert clock.done(80.0, rounding=False) and not clock.done(79.9, rounding=False)
    said = []
    clock.evaluated(30.0, said.append)
    assert clock.measured and clock.training_s == 70.0 and "the evaluation took 30.0 s" in said[0]
    clock.evaluated(80.0, said.append)  # more than half the budget: capped, said once
    clock.evaluated(90.0, said.append)
    assert clock.reserve_s == 50.0 and sum("warning" in line for line in said) == 1


def test_a_warmup_that_would_not_fit_is_laid_on_the_clock_and_kept_on_resume():
    sc = ScheduleConfig(warmup_steps=50)
    clock = ClockBudget.for_run(TrainConfig(max_hours=95 / 3600))
    clock.lay_warmup(sc, step=5, elapsed_s=10.0, step_s=2.0, known_steps=None, log=QUIET)
    laid = clock.laid(sc)
    assert laid.warmup_share == WARMUP_MAX_SHARE and laid.warmup_steps == 50 and sc.warmup_share is None
    clock.lay_warmup(sc, step=6, elapsed_s=12.0, step_s=0.01, known_steps=None, log=QUIET)  # decided once
    assert clock.laid(sc) is laid
    fits = ClockBudget.for_run(TrainConfig(max_hours=95 / 3600))
    fits.lay_warmup(sc, step=5, elapsed_s=1.0, step_s=0.1, known_steps=None, log=QUIET)
    assert fits.laid(sc) is sc
    assert fits.decided and fits.warmup_share is None  # 50 of ~945 steps: kept in steps

    resumed = ClockBudget.for_run(TrainConfig(max_hours=95 / 3600))
    resumed.load_state_dict(clock.state_dict())  # a checkpoint's state.json, read back
    cfg = config("data", "run", "--train.max_hours", str(95 / 3600), "--schedule.warmup_steps", "50")
    assert resumed.laid(cfg.schedule).warmup_share == WARMUP_MAX_SHARE
    resumed.lay_warmup(cfg.schedule, step=9, elapsed_s=1.0, step_s=9.0, known_steps=None, log=QUIET)
    assert resumed.laid(cfg.schedule).warmup_share == WARMUP_MAX_SHARE  # (decided before the resume)
