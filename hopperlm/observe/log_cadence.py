"""How often a run logs: train.log_every, shortened for a run that would otherwise print fewer than ~10 lines.

A log step prints the progress line and writes the metrics record the plots draw, so a 50-step run at the
default interval of 10 shows five points, and a demo that manages 60 steps in its 95 s on a loaded machine
(its recipe logs every 50) shows one. The interval only ever shrinks, whoever set it: a recipe's value and a
user's cannot be told apart once the config is loaded, and more lines cost a short run next to nothing.

    cadence = LogCadence(tc, step=s.step, tokens_per_step=..., log=log)   # the one line if it shrinks
    ... cadence.due(step)                  # every step: is it a log step?
    ... cadence.logged(step, elapsed_s)    # after each log step: a wall-clock budget's speed probe

- A run whose length is known in steps (train.max_steps; train.max_tokens at the run's fixed tokens per step)
  gets the interval at once, from the whole run's length, so a resumed run logs the steps the uninterrupted one
  did (its losses, means over the same windows, compare record by record).
- A run bounded by train.max_hours cannot know its steps up front. It logs its first step (the first line comes
  at once, compile included) and the PROBE_STEPS-th after it; the speed between the two (the compile left out)
  says how many steps the budget allows, and the interval shrinks the same way, once. Both are log steps, so
  with several ranks every rank reads the same agreed clock there and makes the same choice (ranks must agree
  on every log step). A wall-clock trigger ("a line every 30 s") would not be: it is not used. (The loop logs
  the steps before these too, until the clock budget has timed its first steps: train/clock_budget.py.)
- The interval chosen divides log_every: checkpoint.every and eval.every are acted on only on log steps, and
  were set to fall on them, so every step the configured interval logs is still logged.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from hopperlm.config import TrainConfig
from hopperlm.config.training import last_step_known_ahead
from hopperlm.observe.metrics import human_hours

LINES = 10  # a run's course, readable: start, the fall, the flattening, the end
PROBE_STEPS = 4  # warm steps timed under a wall-clock budget before the interval is chosen


def shortened(log_every: int, steps: int) -> int:
    """The interval for a run of `steps` steps: log_every when it prints LINES lines or more, else the largest
    divisor of log_every that is at most steps // LINES (at least 1)."""
    if steps // log_every >= LINES:
        return log_every
    most = max(1, steps // LINES)
    return max(d for d in range(1, min(most, log_every) + 1) if log_every % d == 0)


def n_steps(n: int) -> str:
    """`1 step`, `1,200 steps`."""
    return f"{n:,} step" + ("" if n == 1 else "s")


class LogCadence:
    """The run's log interval: the one owner of when a step is a log step (evaluations and the budget's end
    are log steps too: the loop adds them)."""

    def __init__(
        self, tc: TrainConfig, *, step: int, tokens_per_step: int, log: Callable[[str], None]
    ) -> None:
        self.configured = self.every = tc.log_every
        self.log = log
        steps = last_step_known_ahead(tc, tokens_per_step)
        self.known = steps
        if steps is not None and step < steps:  # (a run already at its end has nothing to log)
            self._change(shortened(self.every, steps), f"this run has {n_steps(steps)}", steps)
        self.budget_s = None if tc.max_hours is None else tc.max_hours * 3600
        # the probe's two log steps, while the interval can still shrink; the first's (step, elapsed_s)
        self.probe = (step + 1, step + 1 + PROBE_STEPS) if self.budget_s and self.every > 1 else None
        self.first: tuple[int, float] | None = None

    def due(self, step: int) -> bool:
        return step % self.every == 0 or (self.probe is not None and step in self.probe)

    def logged(self, step: int, elapsed_s: float) -> None:
        """After a log step at `step`, `elapsed_s` into the budget (several ranks: the agreed clock)."""
        if self.probe is None:
            return
        if step == self.probe[0]:
            self.first = (step, elapsed_s)
        elif step >= self.probe[1] and self.first is not None:
            self.probe = None
            self.from_speed(step, elapsed_s, (elapsed_s - self.first[1]) / (step - self.first[0]))

    def from_speed(self, step: int, elapsed_s: float, step_s: float) -> None:
        """Shrink the interval to what the wall-clock budget allows at `step_s` seconds a step."""
        if step_s <= 0 or self.budget_s is None:
            return
        steps = step + int(max(0.0, self.budget_s - elapsed_s) / step_s)
        if self.known is not None:
            steps = min(steps, self.known)
        budget = human_hours(self.budget_s / 3600)
        why = f"the {budget} budget allows about {n_steps(steps)} at {step_s:.3g} s/step"
        self._change(shortened(self.every, steps), why, steps)

    def _change(self, every: int, why: str, steps: int) -> None:
        if every == self.every:
            return
        self.every = every
        lines = math.ceil(steps / self.configured)  # the run's end is a log step too
        said = f"{lines:,} line{'' if lines == 1 else 's'} at every {self.configured}"
        course = f"; at least {LINES} show its course" if steps >= LINES else ""
        self.log(f"log: every {n_steps(every)} (not {self.configured}): {why}, {said}{course}")
