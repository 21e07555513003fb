"""SIGTERM and SIGUSR1 (SLURM's warning before it kills a job), and SIGINT (Ctrl-C): stop, checkpoint the last
complete step and exit cleanly. One process stops at the next micro-batch boundary (the partial step is dropped,
so a warning shorter than one optimizer step still keeps the work); several ranks stop together after the step
in which they agree (parallel/runtime.py). A second signal means "now": the default action runs immediately; a
second Ctrl-C first says in one line what is lost (the steps since the last checkpoint)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

SIGNALS = tuple(
    s
    for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None), signal.SIGINT)
    if s is not None
)
CTRL_C = "SIGINT"


class Preemption:
    """Context manager; `.requested` names the first signal received (None until then). `lost()`: what a second
    Ctrl-C throws away, in words (the loop's: the steps since the last checkpoint)."""

    def __init__(self, log, at_micro_batch: bool = True, lost: Callable[[], str] | None = None) -> None:
        self.log, self.at_micro_batch, self.lost = log, at_micro_batch, lost
        self.requested: str | None = None
        self.received_at: float | None = None  # time.perf_counter() of the first signal
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:  # second signal: stop waiting for the step
            if signum == signal.SIGINT:
                self._say_lost()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.requested, self.received_at = signal.Signals(signum).name, time.perf_counter()
        # several ranks agree on a signal at log steps only (no host sync between them)
        where = "the next micro-batch boundary" if self.at_micro_batch else "the next log step"
        if self.requested == CTRL_C:
            self.log(
                f"Ctrl-C: stopping at {where}, then saving a checkpoint and the report (Ctrl-C again exits at "
                "once, without saving)"
            )
            return
        self.log(
            f"{self.requested} received: stopping at {where}, checkpointing the last complete step, then exiting"
        )

    def _say_lost(self) -> None:
        """The second Ctrl-C's one line, before the process ends: written straight to the descriptor when the
        interrupted code was itself printing (a buffered stream refuses a reentrant write)."""
        line = "second Ctrl-C: exiting without saving" + (f"; {self.lost()}" if self.lost else "")
        try:
            self.log(line)
            sys.stdout.flush()
        except RuntimeError:
            os.write(sys.stdout.fileno(), (line + "\n").encode())

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
