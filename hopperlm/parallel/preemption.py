"""SIGTERM and SIGUSR1 (SLURM's warning before it kills a job): stop, checkpoint the last complete step and exit
cleanly. One process stops at the next micro-batch boundary (the partial step is dropped, so a warning shorter
than one optimizer step still keeps the work); several ranks stop together after the step in which they agree
(parallel/runtime.py). A second signal means "now": the default action runs immediately."""

from __future__ import annotations

import os
import signal
import threading
import time

SIGNALS = tuple(
    s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None)) if s is not None
)


class Preemption:
    """Context manager; `.requested` names the first signal received (None until then)."""

    def __init__(self, log, at_micro_batch: bool = True) -> None:
        self.log, self.at_micro_batch = log, at_micro_batch
        self.requested: str | None = None
        self.received_at: float | None = None  # time.perf_counter() of the first signal
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:  # second signal: stop waiting for the step
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.requested, self.received_at = signal.Signals(signum).name, time.perf_counter()
        where = "the next micro-batch boundary" if self.at_micro_batch else "the end of this step"
        self.log(
            f"{self.requested} received: stopping at {where}, checkpointing the last complete step, then exiting"
        )

    def seconds_since(self) -> float | None:
        """Seconds since the first signal (None: none received)."""
        return None if self.received_at is None else time.perf_counter() - self.received_at

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
