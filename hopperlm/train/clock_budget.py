"""A wall-clock budget the run keeps (train.max_hours): training and the final evaluation end at the deadline.

    train.max_hours  =  training (the LR schedule is laid over it)  +  the final evaluation (reserved)

The validation at a run's last step used to start at the deadline, so the run ended past it by the whole
evaluation (the demo: 20-25 s past its 95 s). So its time is reserved: estimated at the first timed steps (each
validation set's evaluation timed on one batch of its windows, scaled to all of them: the loop's
`probe_evaluation`), then measured at every evaluation (the latest counts). Training stops at the deadline
less the reserve, to the nearest step, and the schedule's wall-clock budget is that same span, so the LR's
decay lands where training ends.

A warm-up given in steps (schedule.warmup_steps) cannot know how many steps a clock buys: on a loaded machine the
demo's 50 warm-up steps outlasted its whole 43-step run, which never decayed. At the first timed steps (the step
after the first, or PROBE_STEPS of them where the model compiles), a warm-up longer than WARMUP_MAX_SHARE of the steps the training span allows at that speed is laid as
schedule.warmup_share WARMUP_MAX_SHARE instead (on the clock, like the decay: schedule.py). The recipe's
schedule section is never changed: `laid(schedule)` gives the schedule the LR follows, with the warm-up laid.

Each decision is said in one line and saved in every checkpoint (state.json's "clock_budget"), so a resumed run
keeps it. Several ranks: what decides is rank 0's measurement, broadcast by the loop, so every rank stops after
the same step.

    clock = ClockBudget.for_run(tc)              set-up (TrainState holds it: it is saved and restored)
    clock.schedule(budget)                       every step: the budget the LR is laid over
    clock.done(elapsed_s)                        every step: training is over
    clock.probing()                              every step: until the first steps are timed, each is a log step
    clock.timed(steps, took_s)                   each log step: the interval's training time (no evaluations)
    clock.due(compiled=...) -> estimated(...), lay_warmup(...)   once, at the first timed steps
    clock.laid(schedule)                         every step: the schedule section as the LR follows it
    clock.evaluated(seconds)                     after each evaluation: the reserve measured
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hopperlm.config import ScheduleConfig, TrainConfig
from hopperlm.observe.log_cadence import PROBE_STEPS

# A warm-up is a small part of a run: recipes lay 1-10% of their steps (transformers' examples a warmup_ratio of
# 0.03-0.1, nanoGPT 2,000 of 600,000 steps); past 10% it eats the stable phase the decay starts from. A warm-up
# in steps longer than this share of the steps the clock allows is laid as this share of the clock instead.
WARMUP_MAX_SHARE = 0.1
# an evaluation longer than half the budget would leave too little to train: the reserve stops there
MAX_RESERVE_SHARE = 0.5


def seconds(x: float) -> str:
    """`95 s`, `7.4 s`: a short budget's parts in tenths, so they visibly add up."""
    return f"{x:.1f} s" if x < 20 else f"{x:.0f} s"


@dataclass
class ClockBudget:
    budget_s: float | None  # train.max_hours in seconds (None: no wall-clock budget, nothing to keep)
    reserve_s: float = 0.0  # the final evaluation's seconds, kept free of training
    measured: bool = False  # reserve_s is an evaluation's (else the estimate, or none yet)
    # schedule.warmup_share laid in place of schedule.warmup_steps, if it was
    warmup_share: float | None = None
    decided: bool = False  # the warm-up was decided (at this run's first timed steps, before any resume)
    # not saved: this process's timed steps (its first log interval holds the compile and is left out)
    timed_steps: int = 0
    timed_s: float = 0.0
    started: bool = False  # this process said its budget line
    _laid: tuple[Any, ...] | None = field(default=None, repr=False)  # (budget, reserve_s, the budget laid)
    _laid_schedule: tuple[Any, ...] | None = field(default=None, repr=False)  # (schedule, share, laid)

    @classmethod
    def for_run(cls, tc: TrainConfig) -> ClockBudget:
        return cls(None if tc.max_hours is None else tc.max_hours * 3600.0)

    @property
    def training_s(self) -> float | None:
        """Seconds of the clock for training: the budget less the final evaluation's."""
        return None if self.budget_s is None else self.budget_s - self.reserve_s

    def step_s(self) -> float | None:
        """Mean seconds of a training step timed so far in this process (evaluations and saves left out)."""
        return self.timed_s / self.timed_steps if self.timed_steps else None

    def schedule(self, budget: TrainConfig) -> TrainConfig:
        """The budget the LR schedule is laid over: `budget` with its hours less the reserve, so the decay lands
        where training ends (made once per reserve: the loop asks every step)."""
        if not self.reserve_s or budget.max_hours is None:
            return budget
        if self._laid is None or self._laid[0] is not budget or self._laid[1] != self.reserve_s:
            hours = max(budget.max_hours * 3600.0 - self.reserve_s, 1e-3) / 3600.0
            self._laid = (budget, self.reserve_s, dataclasses.replace(budget, max_hours=hours))
        return self._laid[2]

    def done(self, elapsed_s: float, *, rounding: bool = True) -> bool:
        """Training is over: the clock is within half a step of the training span's end, so the run ends at the
        step nearest to it (`rounding` False: at the first step past it, as several ranks do, whose step
        times differ)."""
        step_s = self.step_s() if rounding else None
        return elapsed_s + (step_s or 0.0) / 2 >= self.training_s

    def timed(self, steps: int, took_s: float) -> None:
        self.timed_steps += steps
        self.timed_s += took_s

    def probing(self) -> bool:
        """Until its first steps are timed, every step of a wall-clock run is a log step (a time read once the
        device is done), so the decisions come as early as they can."""
        return self.budget_s is not None and not self.started

    def due(self, *, compiled: bool) -> bool:
        """Enough steps are timed to estimate the evaluation and decide the warm-up (once per process): one
        step after the first (which allocates, and may compile), or PROBE_STEPS where the model compiles (its
        first steps may compile again). Early, because a warm-up laid on the clock ramps from the start of the
        budget: laid late, the LR jumps up to where the ramp already is."""
        enough = PROBE_STEPS if compiled else 1
        return self.budget_s is not None and not self.started and self.timed_steps >= enough

    def estimated(self, took_s: float | None, windows: int, timed: int, log: Callable[[str], None]) -> None:
        """The budget's line, once per process: the final evaluation's seconds (`took_s`) estimated from `timed`
        of its `windows` (None: there is no validation set), unless an evaluation measured it already."""
        self.started = True
        if took_s is not None and not self.measured:
            self.reserve_s = self._capped(took_s, log)
        if took_s is None and not self.measured:
            log(
                f"budget: {seconds(self.budget_s)} of training (no validation set: no final evaluation to "
                "reserve)"
            )
            return
        how = "measured" if self.measured else f"estimated from {windows:,} eval windows, {timed:,} timed"
        parts = (
            f"{seconds(self.training_s)} of training + ~{seconds(self.reserve_s)} for the final evaluation"
        )
        log(f"budget: {seconds(self.budget_s)} = {parts} ({how}); the LR decays by the end of training")

    def evaluated(self, took_s: float, log: Callable[[str], None]) -> None:
        """An evaluation took `took_s` seconds: the final one will take about as long (the first measurement in
        this process is said)."""
        if self.budget_s is None:
            return
        first = not self.measured
        before, self.reserve_s, self.measured = self.reserve_s, self._capped(took_s, log), True
        if first:
            log(
                f"budget: the evaluation took {took_s:.1f} s (~{seconds(before)} reserved): training ends at "
                f"{seconds(self.training_s)} of the {seconds(self.budget_s)}"
            )

    def lay_warmup(
        self,
        sc: ScheduleConfig,
        *,
        step: int,
        elapsed_s: float,
        step_s: float | None,
        known_steps: int | None,
        log: Callable[[str], None],
    ) -> None:
        """Decide, once per run, whether a warm-up in steps fits the steps the training span allows at
        `step_s` seconds a step (capped by a step or token budget, `known_steps`); where it does not, the warm-up
        is laid as a share of the budget (`laid` gives the schedule with it from then on)."""
        if self.decided or self.budget_s is None:
            return
        self.decided = True
        if sc.warmup_share is not None or step >= sc.warmup_steps or not step_s:
            return
        steps = step + int(max(0.0, self.training_s - elapsed_s) / step_s)
        steps = min(steps, known_steps) if known_steps is not None else steps
        if sc.warmup_steps <= WARMUP_MAX_SHARE * steps:
            return
        self.warmup_share = WARMUP_MAX_SHARE
        first = seconds(WARMUP_MAX_SHARE * self.training_s)
        log(
            f"warm-up: schedule.warmup_steps {sc.warmup_steps} would be {sc.warmup_steps / max(steps, 1):.0%} of "
            f"the ~{steps:,} steps that {seconds(self.training_s)} of training allow at {step_s:.3g} s/step; "
            f"laid as schedule.warmup_share {WARMUP_MAX_SHARE:g} instead (the first {first}), so the LR peaks "
            "and then decays within the budget"
        )

    def laid(self, sc: ScheduleConfig) -> ScheduleConfig:
        """`sc` with the warm-up this run laid on the clock, if it did (made once: the loop asks every step)."""
        if self.warmup_share is None or sc.warmup_share is not None:
            return sc
        if self._laid_schedule is None or self._laid_schedule[:2] != (sc, self.warmup_share):
            self._laid_schedule = (
                sc,
                self.warmup_share,
                dataclasses.replace(sc, warmup_share=self.warmup_share),
            )
        return self._laid_schedule[2]

    def _capped(self, took_s: float, log: Callable[[str], None]) -> float:
        most = MAX_RESERVE_SHARE * self.budget_s
        if took_s > most:
            if self.reserve_s == most:  # said already
                return most
            log(
                f"warning: the final evaluation takes ~{seconds(took_s)}, more than half the "
                f"{seconds(self.budget_s)} budget; {seconds(most)} reserved: lower train.eval_windows, or "
                "raise train.max_hours"
            )
            return most
        return took_s

    def state_dict(self) -> dict[str, Any]:
        return {
            "reserve_s": self.reserve_s,
            "measured": self.measured,
            "warmup_share": self.warmup_share,
            "decided": self.decided,
        }

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        """A resume keeps the checkpoint's decisions (a checkpoint without them: decided anew)."""
        if not saved or self.budget_s is None:
            return
        self.reserve_s, self.measured = saved["reserve_s"], saved["measured"]
        self.warmup_share, self.decided = saved["warmup_share"], saved["decided"]
