"""TrainState: everything a run changes as it goes, with one owner. Every checkpoint's state.json is its
`state_dict()`; a resume is `load_state_dict()`, a rollback `roll_back()`: one call each.

    step, tokens                where the run is          best_val, val_loss     what it measured
    micro_batch, grad_accum     per rank: the plan's, until an out-of-memory error halves them
    fp8                         the float8 backend in effect (the plan's, or "off" after a start-up failure)
    attention                   the plan's SDPA kernel (a resume keeps it: kernels round differently)
    muon_ns                     the plan's Newton–Schulz precision for Muon (a resume keeps it, as attention)
    schedule_budget             the budget the LR schedule is laid over (a resume may keep the original one)
    clock                       seconds of training across resumes (what train.max_hours counts)
    clock_budget                how train.max_hours is kept: the final evaluation's reserve, a warm-up
                                laid on the clock (train/clock_budget.py)
    guard                       the stability guard's counters, data offset and LR scale (train/guard.py)
    batches                     the position of the data stream (data/batches.py)

The weights, the optimizer's and loss scaler's state and the RNGs travel beside state.json in the same
checkpoint. The checkpointer (checkpoint/checkpointer.py) is built at set-up with this state and those parts,
and makes the three calls: its saves, `load(start)` and `roll_back(path, bad_step)`. What state.json records
of the run for the checks a resume makes (its config, its data's tokenizer) is `run_record`, set once at
set-up. A resume restores `elapsed_before` (the clock starts from it) and `saved_budget` (the budget the
checkpoint's LR schedule was laid over) for the set-up to use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hopperlm.config.training import BUDGET_KEYS, budget_before

if TYPE_CHECKING:
    from hopperlm.config import TrainConfig
    from hopperlm.data.batches import BatchSource
    from hopperlm.parallel.runtime import Clock
    from hopperlm.train.clock_budget import ClockBudget
    from hopperlm.train.guard import Guard


@dataclass
class TrainState:
    micro_batch: int  # per rank
    grad_accum: int
    fp8: str
    attention: str = "auto"
    muon_ns: str = "bf16"  # Muon's Newton–Schulz precision (a resume keeps it: the two round differently)
    device_type: str | None = (
        None  # "cuda" or "cpu": a resume on another kind keeps none of the above roundings
    )
    # torch's CPU threads in effect (a resume keeps them: they change the rounding)
    threads: int | None = None
    step: int = 0
    tokens: int = 0
    best_val: float | None = None
    val_loss: float | None = None
    schedule_budget: TrainConfig | None = None
    clock: Clock | None = None
    guard: Guard | None = None
    batches: BatchSource | None = None
    clock_budget: ClockBudget | None = None
    run_record: dict[str, Any] = field(default_factory=dict)  # config, data tokenizer: saved, never restored
    # not saved: each process's first log step compares its measured speed with the prediction, a resumed one too
    preflight_checked: bool = False
    # not saved: each dataset's loss at this process's last evaluation (the run's end sets a forecast beside it)
    val_losses: dict[str, float] | None = None
    val_step: int | None = None  # the step of this process's last evaluation (in state.json, never restored)
    elapsed_before: float = 0.0  # restored: seconds of training before this process (the clock starts there)
    saved_budget: dict[str, Any] | None = None  # restored: the budget the checkpoint's schedule was laid over

    def state_dict(self, world_size: int) -> dict[str, Any]:
        """state.json of a checkpoint of the current step (the checkpointer adds the step and the RNGs)."""
        return {
            "tokens": self.tokens,
            "elapsed_s": self.clock(),
            "best_val_loss": self.best_val,
            "val_loss": self.val_loss,
            "val_step": self.val_step,  # where val_loss is from (the last validation: this step's, or before)
            "micro_batch": self.micro_batch
            * world_size,  # all ranks together: any world size that divides it
            "grad_accum": self.grad_accum,
            "fp8": self.fp8,
            "attention": self.attention,
            "muon_ns": self.muon_ns,
            "device_type": self.device_type,
            "threads": self.threads,
            "world_size": world_size,
            "schedule_budget": {k: getattr(self.schedule_budget, k) for k in BUDGET_KEYS},
            "guard": self.guard.to_dict(),
            "data": self.batches.state_dict(),
            "clock_budget": self.clock_budget.state_dict() if self.clock_budget is not None else None,
            **self.run_record,
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Resume: where the run was, what it measured, the guard, the data position, the clock and the
        schedule's budget before. (The micro-batch and the attention kernel were kept from the same
        state.json when the plan was made: checkpointer.py's ResumePoint.)"""
        self.step, self.tokens = saved["step"], saved["tokens"]
        self.best_val = saved.get("best_val_loss")
        self.elapsed_before = saved["elapsed_s"]
        self.saved_budget = budget_before(saved)  # (a run resumed with keep remembers its original)
        self.guard.load(saved.get("guard"))
        self.batches.load_state_dict(saved.get("data"))
        if self.clock_budget is not None:
            self.clock_budget.load_state_dict(saved.get("clock_budget"))

    def roll_back(self, saved: dict[str, Any], bad_step: int) -> None:
        """Back to a checkpoint's step and tokens after divergence at `bad_step`. The guard keeps counting (its
        rollbacks, and the data offset that skips the bad batches) and the data stream goes on past them, so
        neither is restored."""
        self.guard.after_rollback(bad_step, saved["step"])
        self.step, self.tokens = saved["step"], saved["tokens"]
