"""LR schedules over steps, tokens and a wall-clock budget."""

import pytest

from hopperlm.config import ScheduleConfig, TrainConfig
from hopperlm.schedule import budget_progress, lr_at


def test_warmup_then_cosine_to_min():
    cfg = ScheduleConfig(min_lr_ratio=0.1, warmup_steps=10, name="cosine")
    assert lr_at(0, 0.0, cfg, 1.0) == pytest.approx(0.1)
    assert lr_at(9, 0.0, cfg, 1.0) == pytest.approx(1.0)
    assert lr_at(10, 0.0, cfg, 1.0) == pytest.approx(1.0)
    assert lr_at(50, 0.5, cfg, 1.0) == pytest.approx(0.55)
    assert lr_at(100, 1.0, cfg, 1.0) == pytest.approx(0.1)
    lrs = [lr_at(10 + i, i / 100, cfg, 1.0) for i in range(101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))


def test_linear_constant_and_wsd():
    lin = ScheduleConfig(min_lr_ratio=0.0, warmup_steps=0, name="linear")
    assert lr_at(5, 0.25, lin, 2.0) == pytest.approx(1.5)
    const = ScheduleConfig(warmup_steps=0, name="constant")
    assert lr_at(5, 0.9, const, 2.0) == 2.0
    wsd = ScheduleConfig(min_lr_ratio=0.0, warmup_steps=0, name="wsd", decay_fraction=0.2)
    assert lr_at(5, 0.5, wsd, 1.0) == 1.0 and lr_at(5, 0.8, wsd, 1.0) == 1.0
    assert lr_at(5, 0.9, wsd, 1.0) == pytest.approx(0.5)
    assert lr_at(5, 1.0, wsd, 1.0) == pytest.approx(0.0)


def test_step_budget_progress_spans_post_warmup_steps():
    cfg = TrainConfig(max_steps=110)
    assert budget_progress(10, 0, 0.0, cfg, warmup_steps=10) == 0.0
    assert budget_progress(60, 0, 0.0, cfg, warmup_steps=10) == pytest.approx(0.5)
    assert budget_progress(110, 0, 0.0, cfg, warmup_steps=10) == 1.0


def test_time_budget_lands_decay_at_deadline():
    """With max_hours, progress is elapsed/budget whatever the step rate: the decay ends at the deadline."""
    cfg = TrainConfig(max_hours=0.5)  # 1800 s
    opt = ScheduleConfig(min_lr_ratio=0.1, warmup_steps=0, name="cosine")
    assert budget_progress(3, 0, 900.0, cfg) == pytest.approx(0.5)
    # a fast machine (step 10,000) and a slow one (step 10) get the same LR at the same wall time
    assert lr_at(10_000, budget_progress(10_000, 0, 900.0, cfg), opt, 1.0) == lr_at(
        10, budget_progress(10, 0, 900.0, cfg), opt, 1.0
    )
    assert lr_at(10, budget_progress(10, 0, 1800.0, cfg), opt, 1.0) == pytest.approx(0.1)
    assert budget_progress(10, 0, 5000.0, cfg) == 1.0


def test_first_budget_to_run_out_wins():
    cfg = TrainConfig(max_steps=1000, max_tokens=10_000, max_hours=1.0)
    assert budget_progress(100, 5_000, 360.0, cfg) == pytest.approx(0.5)  # tokens lead
    assert budget_progress(100, 1_000, 2700.0, cfg) == pytest.approx(0.75)  # time leads
