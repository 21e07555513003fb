"""What a train.max_hours run does on its log steps to keep its clock (train/clock_budget.py holds the
decisions): its training time counted, the final evaluation's time estimated at the first timed steps, a
warm-up in steps that would not fit laid on the clock, and the forecast told the schedule the LR now follows.
The loop calls `keep_clock` on a log step before it decides whether the run stops."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from hopperlm.config.training import last_step_known_ahead
from hopperlm.observe.metrics import Interval
from hopperlm.train.evaluate import evaluate

if TYPE_CHECKING:  # (the Run is built in train/run.py, which imports nothing of this module)
    from hopperlm.train.run import Run
    from hopperlm.train.step import StepResult


def keep_clock(run: Run, interval: Interval, last: StepResult) -> None:
    """At a log step of a train.max_hours run, before the stop is decided: the interval's training time counted
    (the first interval left out: it allocates, and may compile); at the first timed steps the final
    evaluation's time estimated and a warm-up in steps that would not fit laid on the clock. `last`: the step
    just taken, waited for before the time is read."""
    last.loss.item()  # a GPU runs ahead of the host: the time read must be the steps' run, not their launch
    s, clock, compiled = run.state, run.state.clock_budget, run.plan.compile
    if not interval.cold:
        clock.timed(interval.steps, interval.training_s())
    if not clock.due(compiled=compiled):
        return
    start = time.perf_counter()
    seconds, windows, timed = probe_evaluation(run) if run.data.val_sets else (None, 0, 0)
    interval.exclude(time.perf_counter() - start)  # (not training)
    clock.estimated(seconds, windows, timed, run.log)
    clock.lay_warmup(
        run.cfg.schedule,
        step=s.step,
        elapsed_s=run.elapsed(),
        step_s=run.rt.broadcast_object(clock.step_s()),  # rank 0's: every rank decides alike
        known_steps=last_step_known_ahead(run.cfg.train, run.tokens_per_step),
        log=run.log,
    )
    reschedule_forecast(run)


def probe_evaluation(run: Run) -> tuple[float, int, int]:
    """(seconds the whole evaluation will take, its windows, those timed): each validation set evaluated on one
    batch of its windows per rank, twice, the faster time (the first may compile or allocate; a loaded machine
    slows either) scaled to all its batches; rank 0's estimate, for every rank."""
    s = run.state
    per = s.micro_batch * run.rt.world_size
    seconds, windows, timed = 0.0, 0, 0
    with run.rt.long_phase("evaluation"):
        for v in run.data.val_sets:
            probe, took = v.starts[:per], []
            for _ in range(2):
                start = time.perf_counter()
                evaluate(run.model, v.shards, probe, run.plan, micro_batch=s.micro_batch,
                         packing=run.cfg.data.packing, rt=run.rt)  # fmt: skip
                took.append(time.perf_counter() - start)
            seconds += min(took) * -(-len(v.starts) // per)
            windows, timed = windows + len(v.starts), timed + len(probe)
    return run.rt.broadcast_object(seconds), windows, timed


def evaluated(run: Run, seconds: float) -> None:
    """An evaluation took `seconds`: the final one is reserved as long (rank 0's measure, for every rank), and
    the forecast follows."""
    if run.state.clock_budget.budget_s is None:
        return
    run.state.clock_budget.evaluated(run.rt.broadcast_object(seconds), run.log)
    reschedule_forecast(run)


def reschedule_forecast(run: Run) -> None:
    """The forecast replays the schedule the LR now follows: to the training's end, the warm-up as laid."""
    clock = run.state.clock_budget
    kept = run.schedule_budget if run.schedule_budget != run.cfg.train else None
    run.observer.reschedule(
        clock.schedule(run.cfg.train), run.schedule, clock.schedule(kept) if kept is not None else None
    )


def say_kept_warmup(run: Run) -> None:
    """A resumed train.max_hours run whose warm-up was laid on the clock keeps it (its state saved the
    decision), so its LR follows the schedule the run started with; one line says so."""
    share = run.state.clock_budget.warmup_share
    if share is not None and run.cfg.schedule.warmup_share is None and run.state.step:
        run.log(
            f"resume: warm-up kept as schedule.warmup_share {share:g} (laid on the clock at the run's start: "
            f"schedule.warmup_steps {run.cfg.schedule.warmup_steps} did not fit its budget)"
        )
