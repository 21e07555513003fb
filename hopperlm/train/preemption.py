"""SIGTERM and SIGUSR1 (SLURM's warning before it kills a job): checkpoint at the end of the current step and
exit cleanly. A second signal means "now": the default action runs immediately."""

from __future__ import annotations

import os
import signal
import threading

SIGNALS = tuple(
    s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None)) if s is not None
)


class Preemption:
    """Context manager; `.requested` names the first signal received (None until then)."""

    def __init__(self, log) -> None:
        self.log = log
        self.requested: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:  # second signal: stop waiting for the step
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.requested = signal.Signals(signum).name
        self.log(f"{self.requested} received: checkpointing at the end of this step, then exiting")

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
