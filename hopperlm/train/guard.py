"""The stability guard: non-finite losses and gradients never reach the weights, and loss spikes or repeated
bad steps trigger the configured policy.

Detection is on the device: the optimizer step is skipped through a `found_inf` flag (fused AdamW on CUDA) with
no host sync. Per-step losses are copied to the host only on log steps, where the policy is decided:
  skip      count the dropped updates and go on
  rollback  after `bad_steps` bad steps within `window`, or a loss above median + spike_k * MAD of the window,
            reload the last good checkpoint, move the data past the batches that caused it, optionally lower
            the learning rate
  stop      save a checkpoint (the weights are still the last good ones) and exit with a message
fp16 runs keep their loss scaler: an overflowing scaled gradient is the scaler's business (it skips the step
and lowers the scale); only a non-finite loss counts as divergence there.
"""

from __future__ import annotations

import json
import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from hopperlm.config import GuardConfig
from hopperlm.diskspace import unwritten
from hopperlm.errors import HopperError
from hopperlm.files import append_line


class GuardStop(HopperError):
    """The guard stopped the run (policy stop, or too many rollbacks)."""


@dataclass
class GuardState:
    """What a checkpoint must carry so that a resumed run guards exactly as the uninterrupted one."""

    skipped: int = 0
    rollbacks: int = 0
    data_offset: int = 0  # added to the step index when drawing batches: rollbacks skip the bad data
    lr_scale: float = 1.0
    recent: list[float] = field(default_factory=list)  # finite losses of the last `window` steps
    bad: list[int] = field(default_factory=list)  # steps with a non-finite loss/grad within the window


class Guard:
    def __init__(self, cfg: GuardConfig, events_path: Path, log) -> None:
        self.cfg, self.events_path, self.log = cfg, Path(events_path), log
        self.state = GuardState()
        self.halt: GuardStop | None = (
            None  # guard.policy stop: what the run raises once its checkpoint is saved
        )
        self._recent: deque[float] = deque(maxlen=cfg.window)

    def load(self, raw: dict | None) -> None:
        if raw:
            self.state = GuardState(**raw)
            self._recent = deque(self.state.recent, maxlen=self.cfg.window)

    def to_dict(self) -> dict:
        self.state.recent = list(self._recent)
        return self.state.__dict__.copy()

    def event(self, step: int, cause: str, action: str) -> None:
        self.log(f"guard: step {step}: {cause}; {action}")
        try:
            append_line(self.events_path, json.dumps({"step": step, "cause": cause, "action": action}))
        except OSError as e:  # a full disk: the log line above keeps the event; the run goes on
            full = unwritten(e)
            if full is None:
                raise
            self.log(f"warning: {full}; events.jsonl stops here (the log keeps them)")

    def spike_threshold(self) -> float | None:
        if self.cfg.spike_k <= 0 or len(self._recent) < max(10, self.cfg.window // 4):
            return None
        median = statistics.median(self._recent)
        mad = statistics.median(abs(x - median) for x in self._recent)
        return median + self.cfg.spike_k * max(mad, 1e-3 * abs(median))

    def review(self, first_step: int, losses: list[float], finite: list[bool]) -> tuple[str, int] | None:
        """Look at the steps since the last log (losses and finite flags of steps first_step, first_step+1, ...).
        Returns None to go on, ("rollback", bad_step) or ("stop", bad_step)."""
        for i, (loss, ok) in enumerate(zip(losses, finite, strict=True)):
            step = first_step + i
            self.state.bad = [s for s in self.state.bad if s > step - self.cfg.window]
            if not ok:
                self.state.skipped += 1
                self.state.bad.append(step)
                cause = f"non-finite loss or gradient norm (loss {loss})"
                if self.cfg.policy == "stop":
                    return "stop", step
                if self.cfg.policy == "rollback" and len(self.state.bad) >= self.cfg.bad_steps:
                    return "rollback", step
                self.event(step, cause, "update skipped")
                continue
            threshold = self.spike_threshold()
            if threshold is not None and loss > threshold:
                if self.cfg.policy == "rollback":
                    return "rollback", step
                self.event(
                    step,
                    f"loss spike {loss:.4f} > {threshold:.4f} (median + {self.cfg.spike_k} MAD)",
                    "noted (policy does not act on spikes)",
                )
            self._recent.append(loss)
        return None

    def after_rollback(self, bad_step: int, ckpt_step: int) -> None:
        """Skip the batches of steps ckpt_step+1 .. bad_step and lower the LR if configured."""
        self.state.rollbacks += 1
        if self.state.rollbacks > self.cfg.max_rollbacks:
            raise GuardStop(
                f"the guard rolled back {self.cfg.max_rollbacks} times and the run still diverges; "
                "lower optim.lr, raise schedule.warmup_steps or check the data"
            )
        self.state.data_offset += bad_step - ckpt_step
        self.state.lr_scale *= self.cfg.lr_factor
        self.state.bad = []
