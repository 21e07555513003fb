"""What `hopperlm sweep` says while a run trains: its latest step and loss, read from the run's metrics.jsonl
every PROGRESS_EVERY_S seconds (the run's own output goes to its sweep.log, so the console would be silent for
the whole run otherwise).

    stdout, stderr = wait_reporting(proc, run_dir, "lr 2e-3 seed 1", log)
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

PROGRESS_EVERY_S = 15.0  # often enough to see a run move, rarely enough not to flood a sweep of many runs


def latest_record(run_dir: Path) -> dict | None:
    """The last complete line of RUN_DIR/metrics.jsonl (a line being written is skipped), or None."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def progress_line(label: str, record: dict) -> str:
    """`sweep: lr 2e-3 seed 1: step 40, loss 3.2104 (training)`; a validation loss where the step has one."""
    loss = record.get("loss")
    parts = [f"step {record['step']}"]
    if isinstance(loss, float | int):
        parts.append(f"loss {loss:.4f}")
    if isinstance(record.get("val_loss"), float | int):
        parts.append(f"val {record['val_loss']:.4f}")
    return f"sweep: {label}: {', '.join(parts)} (training)"


def wait_reporting(
    proc: subprocess.Popen, run_dir: Path, label: str, log: Callable[[str], None]
) -> tuple[str, str]:
    """proc.communicate(), saying the run's step and loss each time a new log step appeared in the meantime."""
    said = None
    while True:
        try:
            return proc.communicate(timeout=PROGRESS_EVERY_S)  # (a retry after a timeout loses no output)
        except subprocess.TimeoutExpired:
            record = latest_record(run_dir)
            if record is not None and "step" in record and record["step"] != said:
                said = record["step"]
                log(progress_line(label, record))
