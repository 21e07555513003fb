"""The training loop. Start reading hopperlm here.

    train(cfg)  ->  build_run (train/run.py: data, plan, model, optimizer, checkpoint to resume from)
                ->  start_run (train/run.py: the banner, the LR's budget, the clock, the observer)
                ->  loop: checkpoint if due -> LR -> train_step (train/step.py) -> maybe log / evaluate -> stop?

Nothing in a step waits on the host: loss and grad norm stay on the device and are read (`.item()`) only on
log steps. The data of step s is a function of (seed, s) or of a position saved in the checkpoint, so a
resumed run continues exactly. Under torchrun every rank runs this loop: each reads its block of the global
batch, losses are averaged over ranks on log steps, and rank 0 logs and writes (parallel/). Checkpoints are the
checkpointer's (checkpoint/checkpointer.py): the loop calls its `step` in one place, on every step the guard
has reviewed, and it decides whether one is due.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from hopperlm.checkpoint.checkpointer import Resume
from hopperlm.config import Config
from hopperlm.data.train_data import combined_val_loss
from hopperlm.model.transformer import count_params
from hopperlm.observe.log_cadence import LogCadence
from hopperlm.observe.metrics import Interval, human_count, mfu, peak_memory_gb
from hopperlm.parallel.preemption import CTRL_C, Preemption
from hopperlm.parallel.runtime import session
from hopperlm.schedule import budget_progress, counted_warmup_steps, lr_at, muon_schedule_at
from hopperlm.train.banner import print_preflight_check
from hopperlm.train.clock_keeping import evaluated, keep_clock, reschedule_forecast, say_kept_warmup
from hopperlm.train.evaluate import evaluate
from hopperlm.train.guard import GuardStop
from hopperlm.train.interruption import lost_steps, resume_line, stop_mid_step
from hopperlm.train.out_of_memory import back_off
from hopperlm.train.run import Run, build_run, start_run
from hopperlm.train.step import StepDropped, StepResult, train_step


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    tokens: int
    elapsed_s: float
    val_loss: float | None
    best_val_loss: float | None
    stopped_by: str
    val_step: int | None = None  # the step val_loss was measured at (a signal's stop may not be validated)


def train(
    cfg: Config,
    resume: Resume = False,
    log: Callable[[str], None] = print,
    on_step: Callable[[int], None] | None = None,
    resume_command: str | None = None,
) -> TrainResult:
    """Train from `cfg`, fresh or from a checkpoint (`resume`: checkpoint/checkpointer.py's `Resume`), until a
    budget ends.
    Under torchrun every rank calls this. `on_step(steps_done)` runs before every step (profiler marks).
    `resume_command`: what the line after a Ctrl-C tells to run (the CLI's: the user's own command line, with
    --resume); default `hopperlm train RUN_DIR/config.yaml --resume`."""
    with session(cfg.parallel, device=cfg.train.device, run_dir=cfg.run.out_dir, log=log) as rt:
        run = build_run(cfg, resume, rt)
        start_run(run)  # the banner, the budget the LR is laid over, the clock, the observer
        return run_loop(run, on_step, resume_command)


def run_loop(
    run: Run, on_step: Callable[[int], None] | None = None, resume_command: str | None = None
) -> TrainResult:
    s, tc = run.state, run.cfg.train
    stopped_by = budget_done(run)
    if stopped_by:
        run.log(f"nothing to do: the run already reached its {stopped_by} budget at step {s.step}")
    if s.clock_budget.budget_s is not None:  # a resume: the reserve and warm-up the checkpoint kept
        say_kept_warmup(run)
        reschedule_forecast(run)
    # train.log_every, shortened for a run that would print fewer than ~10 lines (one line says so)
    cadence = LogCadence(tc, step=s.step, tokens_per_step=run.tokens_per_step, log=run.log)
    run.model.train()
    # one process stops at the next micro-batch boundary; several ranks must agree first (on log steps)
    one_process = run.rt.world_size == 1
    # (finish runs inside Preemption too: a second Ctrl-C while the last checkpoint or the report is written
    # still says what it throws away)
    with Preemption(run.log, at_micro_batch=one_process, lost=partial(lost_steps, run)) as preemption:
        with run.observer:
            stopped_by = steps(run, on_step, preemption, cadence, stopped_by)
        if run.guard.halt is not None:  # guard.policy stop: raised once the good step before it is saved
            raise run.guard.halt
        return finish(run, stopped_by, preemption, resume_command)


def steps(
    run: Run,
    on_step: Callable[[int], None] | None,
    preemption: Preemption,
    cadence: LogCadence,
    stopped_by: str | None,
) -> str:
    """The loop itself, until a budget, a target, a signal or the guard stops it; why it stopped."""
    s, tc, one_process = run.state, run.cfg.train, run.rt.world_size == 1
    pending: list[StepResult] = []  # the steps since the last log step
    interval, lr = Interval(), 0.0
    reviewed = True  # the step the run starts from: step 0, or a checkpoint's
    signalled = (lambda: preemption.requested is not None) if one_process else None
    # a signal ends a wait for room (checkpoint.on_disk_full wait)
    run.checkpointer.watch(lambda: preemption.requested)
    while True:
        if reviewed:  # the loop's one save: the checkpointer decides whether this step's is due
            saving = time.perf_counter()
            run.checkpointer.step(s.step, last=stopped_by is not None)
            interval.exclude(time.perf_counter() - saving)  # (a save is not training)
            reviewed = False
        if stopped_by is not None:
            return stopped_by
        if on_step is not None:
            on_step(s.step)
        # the run's budget, or the checkpoint's (schedule.resume_horizon keep), less the final evaluation's
        # time; the schedule with the warm-up the clock laid, if it laid one
        budget, schedule = s.clock_budget.schedule(run.schedule_budget), run.schedule
        progress = budget_progress(s.step, s.tokens, run.elapsed(), budget, counted_warmup_steps(schedule))
        lr = lr_at(s.step, progress, schedule, run.cfg.optim.lr) * run.guard.state.lr_scale
        muon = muon_schedule_at(
            s.step, progress, run.cfg.muon, schedule
        )  # its momentum and decay, if they move
        if run.embed_warmup is not None:  # new token rows first, then everything (initial_model.py)
            run.embed_warmup.before_step(s.step, run.parts.optimizer)
        try:
            batch_of = partial(run.batches.next, s.step + run.guard.state.data_offset)  # (micro) -> Batch
            result = train_step(
                run.parts, batch_of, grad_accum=s.grad_accum, lr=lr, muon=muon, interrupted=signalled
            )
        except torch.OutOfMemoryError:
            back_off(run)  # halve the micro-batch, double accumulation, redo the step
            continue
        if isinstance(result, StepDropped):  # a signal mid-step: keep the last complete one
            stopped_by = stop_mid_step(run, result, pending, interval, lr, preemption.requested, log_step)
            reviewed = True  # its checkpoint is written at the loop's top, then the loop ends
            continue
        pending.append(result)
        s.step, s.tokens = s.step + 1, s.tokens + run.tokens_per_step
        run.rt.beat(s.step)  # several ranks: the heartbeat the launcher watches (parallel/watchdog.py)
        interval.add(run.tokens_per_step)
        is_log_step = cadence.due(s.step) or bool(tc.eval_every and s.step % tc.eval_every == 0)
        is_log_step = is_log_step or s.clock_budget.probing()  # a wall-clock run's first steps are timed
        if is_log_step and s.clock_budget.budget_s is not None:  # before the stop: it may move the end
            keep_clock(run, interval, pending[-1])  # the final evaluation's time reserved, the warm-up fitted
        is_log_step = is_log_step or budget_done(run) is not None  # (the same on every rank)
        signal = run.rt.agree(preemption.requested, is_log_step)  # several ranks: decided on log steps
        stopped_by = budget_done(run) or (f"signal {signal}" if signal else None)
        if is_log_step or stopped_by:
            stopped_by = log_step(run, pending, interval, lr, stopped_by)
            cadence.logged(s.step, run.elapsed())  # a wall-clock budget: its speed, once
            reviewed = True
            pending.clear()
            interval.reset()


def budget_done(run: Run) -> str | None:
    """The budget that has run out, if any."""
    s, tc = run.state, run.cfg.train
    if tc.max_steps is not None and s.step >= tc.max_steps:
        return "max_steps"
    if tc.max_tokens is not None and s.tokens >= tc.max_tokens:
        return "max_tokens"
    # the deadline less the final evaluation's time (train/clock_budget.py), to the nearest step; several ranks
    # read one agreed clock but time their steps apart, so they stop at the first step past it
    if tc.max_hours is not None and s.clock_budget.done(run.elapsed(), rounding=run.rt.world_size == 1):
        return "max_hours"
    return None


def log_step(run: Run, pending: list[StepResult], interval: Interval, lr: float, stopped_by: str | None):
    """The one host sync of the interval: the guard's review, evaluation, the metrics record. Returns why the
    run stops now (None: it goes on); the loop then asks the checkpointer whether a checkpoint is due."""
    s, tc = run.state, run.cfg.train
    losses, flags = run.rt.log_step_losses([(r.loss, r.finite) for r in pending])  # mean over ranks
    verdict = run.guard.review(s.step - len(pending) + 1, losses, flags)
    if verdict is not None:
        action, bad_step = verdict
        if action == "stop":  # the bad update never reached the weights: the checkpoint of this step is good
            run.guard.event(bad_step, "non-finite loss or gradient norm", "stopped (guard.policy stop)")
            run.guard.halt = GuardStop(
                f"non-finite loss or gradient at step {bad_step}; stopped with a checkpoint "
                "(guard.policy stop). Lower optim.lr, or use guard.policy skip or rollback"
            )
            return "guard.policy stop"
        rollback(run, bad_step)
        return None
    good = [x for x, ok in zip(losses, flags, strict=True) if ok]
    record = {"step": s.step, "tokens": s.tokens, "loss": sum(good) / len(good) if good else float("nan")}
    # a signal's stop evaluates only what the schedule has due at its step (as the uninterrupted run does there:
    # the resumed run's records equal its), nothing more: the save comes first (a scheduler's warning may be
    # shorter than an evaluation); any other stop is validated, and runs its lm-eval tasks
    ending = None if stopped_by is not None and stopped_by.startswith("signal") else stopped_by
    if run.data.val_sets and ((tc.eval_every and s.step % tc.eval_every == 0) or ending):
        val_losses = validate(run, interval)
        record["val_loss"] = s.val_loss
        if len(val_losses) > 1:  # a mixture: each dataset's own loss (e.g. watch English being forgotten)
            record["val_losses"] = val_losses
            run.log("val by dataset: " + " | ".join(f"{k} {v:.4f}" for k, v in val_losses.items()))
        if tc.target_loss is not None and s.val_loss <= tc.target_loss and ending is None:
            stopped_by = "target_loss"  # (a signal at that step too: the run is done, as it would be without)
    if run.eval_tasks is not None and run.eval_tasks.due(s.step, ending):
        # rank 0 runs lm-eval; the others wait at their next collective
        start = time.perf_counter()
        with run.rt.long_phase("lm-eval tasks"):
            tasks = run.eval_tasks.run(run.model, s.step)
        interval.exclude(time.perf_counter() - start)  # (the tokens/s are training's)
        if tasks:
            record["tasks"] = tasks
    tok_s, step_s = interval.rates()
    run.rt.measured(step_s)  # several ranks: the collective limit for steps follows the slowest step
    world = run.rt.world_size
    record.update(
        lr=lr,
        grad_norm=pending[-1].grad_norm.item(),
        tokens_per_s=tok_s,  # all ranks together
        mfu=mfu(tok_s / world, run.flops_per_token, run.hw.peak_16bit),
        step_time_s=step_s,
        peak_mem_gb=peak_memory_gb(run.plan.device),
        elapsed_s=run.elapsed(),
    )
    if run.guard.state.skipped:
        record["skipped_steps"] = run.guard.state.skipped
    if world > 1:
        record.update(world_size=world, tokens_per_s_per_rank=tok_s / world)
    run.observer.log_step(record)  # GPU readings added, every sink written, the line printed (rank 0)
    # measured beside predicted, once: at the first log step after warm-up (the first interval holds the
    # compile: on an H100 it read 82K tokens/s where the run went on at 186K), or the last if the run ends first
    if not s.preflight_checked and (not interval.cold or stopped_by):
        print_preflight_check(
            run.log,
            record,
            run.plan,
            micro_batch=s.micro_batch,
            predicted=run.predicted[0],
            tc=run.cfg.train,
            params=count_params(run.model_cfg)["total"],
            warm=not interval.cold,
        )
        s.preflight_checked = True
    return stopped_by


def validate(run: Run, interval: Interval) -> dict[str, float]:
    """Each validation set's loss; the run's validation loss is their mixture-weighted mean. Its time is left
    out of the interval's rates, and is what a wall-clock budget reserves for the final evaluation."""
    s, val_sets = run.state, run.data.val_sets
    start = time.perf_counter()
    with run.rt.long_phase("evaluation"):
        losses = {
            v.name: evaluate(
                run.model,
                v.shards,
                v.starts,
                run.plan,
                micro_batch=s.micro_batch,
                packing=run.cfg.data.packing,
                rt=run.rt,
            )
            for v in val_sets
        }
    seconds = time.perf_counter() - start
    interval.exclude(seconds)
    evaluated(run, seconds)  # a wall-clock budget reserves as long for the final evaluation
    s.val_loss, s.val_losses, s.val_step = combined_val_loss(losses, val_sets), losses, s.step
    s.best_val = s.val_loss if s.best_val is None else min(s.best_val, s.val_loss)
    return losses


def rollback(run: Run, bad_step: int) -> None:
    """Back to the latest valid checkpoint, past the data of the bad steps, at a lower LR (guard.py)."""
    s = run.state
    with run.rt.long_phase("rollback"):
        ckpt = run.checkpointer.latest()
        if ckpt is None:
            raise GuardStop(
                f"step {bad_step}: the run diverged and there is no valid checkpoint to roll back to"
            )
        restored = run.checkpointer.roll_back(ckpt, bad_step)  # the parts, and the state's step and tokens
    run.guard.event(
        bad_step,
        "divergence (bad steps or loss spike)",
        f"rolled back to {ckpt.name}, skipping the data of steps {restored['step'] + 1}-{bad_step}, "
        f"LR x{run.guard.state.lr_scale:g}",
    )
    run.observer.restart_at(s.step, s.tokens, run.elapsed())  # the curve restarts; events.jsonl keeps why


def finish(
    run: Run, stopped_by: str, preemption: Preemption | None = None, resume_command: str | None = None
) -> TrainResult:
    s = run.state
    run.batches.close()
    run.checkpointer.close(s.step)  # a background checkpoint completes before the run ends
    total = run.elapsed()
    clock = s.clock_budget
    evaluation = (
        f" ({clock.reserve_s:.1f} s of them the final evaluation)"
        if stopped_by == "max_hours" and clock.measured
        else ""
    )
    at = "" if s.val_step == s.step else f" at step {s.val_step}"  # (a signal's stop may not be validated)
    run.log(
        f"done: {stopped_by} after {s.step:,} steps, {human_count(s.tokens)} tokens, {total:.1f} s{evaluation}"
        + (f" | val loss {s.val_loss:.4f}{at} (best {s.best_val:.4f})" if s.val_loss is not None else "")
    )
    if run.cfg.data.mixture_forecast and s.val_losses and not stopped_by.startswith("signal"):
        # (observe/mixture_law.py: what `sweep --mixture` predicted for this run, beside what it measured;
        # imported here, as the banner does, so that a run without a forecast never loads it)
        from hopperlm.observe.mixture_law import end_line

        line = end_line(run.cfg.data, s.val_losses, params=count_params(run.model_cfg)["total"])
        if line:
            run.log(line)
    result = TrainResult(run.run_dir, s.step, s.tokens, total, s.val_loss, s.best_val, stopped_by, s.val_step)
    run.observer.finish(result)  # result.json, the report
    # how much of a scheduler's warning the exit took (a Ctrl-C's last line is the resume line)
    if preemption is not None and preemption.requested not in (None, CTRL_C):
        run.log(f"exit {preemption.seconds_since():.1f} s after {preemption.requested}")
    run.checkpointer.check_end(s.step)  # on_disk_full continue: a run whose last state is unsaved fails
    if stopped_by == f"signal {CTRL_C}" and run.checkpointer.saved_step == s.step:
        run.log(resume_line(run, resume_command))
    return result
