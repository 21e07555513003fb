"""Keep other libraries' log chatter off the console: torchao's "Failed to load ..._C_mxfp8...so" on machines
without its CUDA kernels, torch's `_pytree` deprecation notices and the like go to a log file, and the CLI says
in one line at the end how many went there. hopperlm's own lines are printed, never logged, so nothing of ours is
hidden; `--debug` leaves every library's logging as it is.
"""

from __future__ import annotations

import logging
from pathlib import Path

from hopperlm.data.demo_text import cache_dir

# (torch.distributed has a console handler of its own, not torch's: torchrun's agent logs through it)
LIBRARIES = (
    "torch",
    "torch.distributed",
    "torchao",
    "transformers",
    "bitsandbytes",
    "peft",
    "accelerate",
    "triton",
)
LOG_NAME = "third-party.log"


class _Counting(logging.FileHandler):
    def __init__(self, path: Path) -> None:
        super().__init__(path, delay=True)  # the file appears only when something is written
        self.count = 0
        self.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        super().emit(record)


class Redirect:
    """Context manager: the libraries' loggers write to CACHE/logs/third-party.log while a verb runs."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or cache_dir() / "logs" / LOG_NAME
        self.handler: _Counting | None = None
        self._saved: list[tuple[logging.Logger, list[logging.Handler], bool]] = []

    def __enter__(self) -> Redirect:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError:  # no writable cache: leave the console as it was rather than lose messages
            return self
        import torch  # noqa: F401  (torch installs its console handler when imported: replace it after)

        self.handler = _Counting(self.path)
        for name in LIBRARIES:
            logger = logging.getLogger(name)
            self._saved.append((logger, list(logger.handlers), logger.propagate))
            logger.handlers = [self.handler]
            logger.propagate = False
        return self

    def __exit__(self, *exc: object) -> None:
        for logger, handlers, propagate in self._saved:
            logger.handlers, logger.propagate = handlers, propagate
        if self.handler is not None:
            self.handler.close()

    def summary(self) -> str | None:
        """One line naming the file, when anything was written to it."""
        if self.handler is None or not self.handler.count:
            return None
        return f"({self.handler.count} message(s) from other libraries written to {self.path})"
