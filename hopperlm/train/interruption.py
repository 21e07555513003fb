"""A run stopped by a person or a scheduler (Ctrl-C, SIGTERM, SIGUSR1; parallel/preemption.py catches them):
a step cut between its micro-batches is dropped, what a second Ctrl-C would throw away is said, and after the
last checkpoint one line gives the command that goes on from it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hopperlm.checkpoint.layout import checkpoint_dir

if TYPE_CHECKING:  # (the Run is built in train/run.py)
    from collections.abc import Callable

    from hopperlm.observe.metrics import Interval
    from hopperlm.train.run import Run
    from hopperlm.train.step import StepDropped, StepResult

    LogStep = Callable[[Run, list[StepResult], Interval, float, str | None], str | None]


def stop_mid_step(
    run: Run,
    dropped: StepDropped,
    pending: list[StepResult],
    interval: Interval,
    lr: float,
    signal: str,
    log_step: LogStep,
) -> str:
    """The signal arrived between micro-batches of step s+1: its partial work is dropped, the data position
    goes back to the step's start, and the run stops at step s, whose checkpoint the loop then writes
    (resuming redoes step s+1 exactly). The steps since the last log step are logged (and validated) first,
    by the loop's `log_step`."""
    s = run.state
    run.log(
        f"step {s.step + 1} dropped after {dropped.at_micro} of {dropped.grad_accum} micro-batches; "
        f"checkpointing step {s.step}"
    )
    run.batches.set_micro_batch(s.micro_batch, s.grad_accum)  # a stream: back to the step's first sample
    stopped_by = f"signal {signal}"
    if pending:
        return log_step(run, pending, interval, lr, stopped_by) or stopped_by
    return stopped_by


def lost_steps(run: Run) -> str:
    """What ending the process now throws away, in words: the steps since the last checkpoint."""
    s, saved = run.state, run.checkpointer.saved_step
    if saved is not None and saved >= s.step:
        return f"nothing is lost (step {saved} is saved)"
    if s.step == 0:
        return "no step was trained yet"
    first = 1 if saved is None else saved + 1
    steps_lost = f"step {first} is" if first == s.step else f"steps {first}-{s.step} are"
    return f"{steps_lost} lost ({'no checkpoint yet' if saved is None else f'last checkpoint: step {saved}'})"


def resume_line(run: Run, command: str | None) -> str:
    """After a Ctrl-C: the step saved, where, and the command that goes on from it (several ranks: each
    rank's, under the same launcher)."""
    command = command or run.checkpointer.disk.resume_command  # (the run's saved config, with --resume)
    ranks = " on every rank (the same torchrun or hopperlm launch)" if run.rt.world_size > 1 else ""
    where = checkpoint_dir(run.run_dir, run.state.step)
    return f"saved step {run.state.step} to {where}; resume with: {command}{ranks}"
