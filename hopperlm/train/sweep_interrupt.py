"""Ctrl-C while `hopperlm sweep` trains its runs: nothing trained is lost.

Each run is a `hopperlm train` process in its own session, so a terminal's Ctrl-C reaches only the sweep, which
forwards it once to every run in progress: the run saves its step and stops (train/loop.py), and no new run
starts. A second Ctrl-C is forwarded too (each run exits at once, saying what it loses) and the sweep exits at
once. `hopperlm sweep ... --resume` then goes on (train/sweep.py `run_sweep`).

    with SweepInterrupt(log) as interrupt:
        proc = interrupt.start(cmd, env)      # None once Ctrl-C came: the run never starts
        ... proc.communicate(); interrupt.ended(proc)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable


class SweepInterrupt:
    """The sweep's runs in progress, and what a Ctrl-C does to them (module doc)."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.log, self.requested = log, False
        self.running: dict[int, subprocess.Popen] = {}  # pid -> its process
        self._lock = threading.Lock()  # the runs start in worker threads; the handler runs in the main one
        self._previous = None

    def start(
        self, cmd: list[str], env: dict[str, str], warm: Callable | None = None
    ) -> subprocess.Popen | None:
        """The run's process (its own session: the terminal's Ctrl-C reaches it only through the sweep), forked
        from the starter `warm()` gives (train/warm_start.py) where it can be, or None once Ctrl-C came."""
        # the starter's imports (once) are not made under the lock the Ctrl-C handler takes
        starter = warm() if warm is not None and not self.requested else None
        with self._lock:
            if self.requested:
                return None
            # cmd is `python -m hopperlm ARGV`: the starter forks ARGV where it can, else a fresh process
            proc = starter.start(cmd[3:], env) if starter is not None else None
            proc = proc or subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                start_new_session=True,
            )
            self.running[proc.pid] = proc
            return proc

    def ended(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self.running.pop(proc.pid, None)

    def _handle(self, signum, frame) -> None:
        with self._lock:
            for proc in self.running.values():
                proc.send_signal(signal.SIGINT)
            if self.requested:
                self.log(
                    "second Ctrl-C: exiting without waiting; each run in progress keeps its last checkpoint"
                )
                sys.stdout.flush()
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
                return
            self.requested = True
            self.log(
                f"Ctrl-C: {len(self.running)} run(s) in progress save their step and stop; no new run starts "
                "(Ctrl-C again exits at once)"
            )

    def __enter__(self) -> SweepInterrupt:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
