"""Where metrics go: metrics.jsonl (always), TensorBoard, Weights & Biases, CSV, behind one interface.

One schema: the fields of metrics.jsonl (hopperlm/observe/metrics.py documents them). TensorBoard and W&B get the
same values under the tags in TAGS (grouped: loss/, optim/, speed/, memory/, gpu/, progress/); metrics.csv has
one column per field. A sink is told `restart_at(step)` when the run goes back to a checkpoint (resume or the
guard's rollback): the records after it are about to be recomputed, so no sink keeps them twice.

On a full disk (a quota, a read-only folder) a sink's `write` or `close` raises the OSError and leaves its file
whole up to the last record it could write; the observer drops that sink with one warning and the run goes on.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import secrets
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any, Protocol

import yaml

from hopperlm.config import LogConfig
from hopperlm.diskspace import write_failure
from hopperlm.errors import ConfigError
from hopperlm.files import append_line, write_atomic
from hopperlm.observe.metrics import FIELDS, MetricsFile, read_metrics

TAGS = {
    "loss": "loss/train",
    "val_loss": "loss/val",
    "forecast": "loss/forecast",
    "forecast_low": "loss/forecast_low",
    "forecast_high": "loss/forecast_high",
    "lr": "optim/lr",
    "grad_norm": "optim/grad_norm",
    "skipped_steps": "optim/skipped_steps",
    "tokens_per_s": "speed/tokens_per_s",
    "mfu": "speed/mfu",
    "step_time_s": "speed/step_time_s",
    "peak_mem_gb": "memory/peak_mem_gb",
    "gpu_mem_gb": "gpu/mem_gb",
    "gpu_util": "gpu/util",
    "gpu_power_w": "gpu/power_w",
    "gpu_temp_c": "gpu/temp_c",
    "tokens": "progress/tokens",
    "elapsed_s": "progress/elapsed_s",
}


def tagged(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric values under their TensorBoard / W&B tags (null and NaN left out)."""
    out = {}
    for key, tag in TAGS.items():
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[tag] = value
    for name, value in (record.get("tasks") or {}).items():  # lm-eval metrics during training
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[f"tasks/{name}"] = value
    return out


class Sink(Protocol):
    name: str

    def write(self, record: dict[str, Any]) -> None: ...

    def restart_at(self, step: int) -> None: ...

    def close(self) -> None: ...


def truncate_metrics(path: Path, step: int) -> None:
    """Drop records past the checkpoint a run resumes from: they are about to be recomputed, identically."""
    if not path.is_file():
        return
    kept = [
        line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step
    ]
    write_atomic(path, "".join(line + "\n" for line in kept))


class JsonlSink:
    """RUN_DIR/metrics.jsonl: the record of the run that plots and reports read."""

    name = "metrics.jsonl"

    def __init__(self, run_dir: Path, start_step: int) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        truncate_metrics(self.path, start_step)  # a run killed before its first checkpoint restarts clean
        self.file = MetricsFile(self.path)

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(record)

    def restart_at(self, step: int) -> None:
        truncate_metrics(self.path, step)

    def close(self) -> None:
        pass


class CsvSink:
    """RUN_DIR/metrics.csv: the metrics.jsonl fields as columns (empty where a field was not measured)."""

    name = "metrics.csv"

    def __init__(self, run_dir: Path, start_step: int) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.csv"
        self.restart_at(start_step)

    def write(self, record: dict[str, Any]) -> None:
        row = io.StringIO()
        csv.DictWriter(row, FIELDS, extrasaction="ignore", lineterminator="").writerow(_csv_row(record))
        append_line(self.path, row.getvalue())  # whole rows only, even on a full disk

    def restart_at(self, step: int) -> None:
        """Rewrite from metrics.jsonl up to `step` (the source of truth; also upgrades an older header)."""
        jsonl = self.run_dir / "metrics.jsonl"
        records = [r for r in read_metrics(jsonl) if r["step"] <= step] if jsonl.is_file() else []
        write_csv(records, self.path)

    def close(self) -> None:
        pass


def _csv_row(record: dict[str, Any]) -> dict[str, Any]:
    return {k: ("" if v is None else v) for k, v in record.items()}


def write_csv(records: list[dict[str, Any]], path: Path) -> None:
    text = io.StringIO()
    writer = csv.DictWriter(text, FIELDS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(_csv_row(r) for r in records)
    write_atomic(path, text.getvalue())


class TensorBoardSink:
    """RUN_DIR/tensorboard/: scalars under TAGS, plus the config as text. After a resume or rollback a new event
    file starts with purge_step, so TensorBoard hides the old file's records past the checkpoint."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, start_step: int, config_text: str) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.SummaryWriter = SummaryWriter
        self.log_dir = Path(run_dir) / "tensorboard"
        self.records: EventRecords | None = None
        self.writer = self._open(start_step)
        if start_step == 0:
            self.writer.add_text("config", "```\n" + config_text + "\n```", 0)

    def _open(self, step: int):
        earlier = sorted(self.log_dir.glob("events.out.tfevents.*")) if self.log_dir.is_dir() else []
        if earlier:
            # TensorBoard reads event files in name order, and names start with the creation second: the new
            # file must sort after the old ones for its purge to apply to them
            newest = max(
                (int(p.name.split(".")[3]) for p in earlier if p.name.split(".")[3].isdigit()), default=0
            )
            while int(time.time()) <= newest:
                time.sleep(0.05)
        purge = step + 1 if earlier else None
        writer = self.SummaryWriter(str(self.log_dir), purge_step=purge, flush_secs=30)
        self.records = EventRecords.install(writer)
        return writer

    def write(self, record: dict[str, Any]) -> None:
        self._raise_if_failed()  # the background thread's failure at an earlier record
        for tag, value in tagged(record).items():
            self.writer.add_scalar(tag, value, record["step"])

    def restart_at(self, step: int) -> None:
        self.close()
        self.writer = self._open(step)

    def close(self) -> None:
        self.writer.close()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self.records is not None and self.records.error is not None:
            raise self.records.error


class EventRecords:
    """Stands between SummaryWriter's background thread and its event file: a write that fails for want of
    room is kept for TensorBoardSink to raise in the training thread (instead of ending the thread with a
    traceback on the console), the torn record is cut off the file, and later records are dropped."""

    def __init__(self, inner: Any, path: str) -> None:
        self.inner, self.path = inner, path
        self.error: OSError | None = None

    @classmethod
    def install(cls, writer: Any) -> EventRecords | None:
        """Put one between `writer` (a SummaryWriter) and its file; None where tensorboard's internals differ
        from the ones this knows (2.x: EventFileWriter._async_writer, its thread's _record_writer)."""
        events = getattr(writer._get_file_writer(), "event_writer", None)
        queue = getattr(events, "_async_writer", None)
        thread = getattr(queue, "_worker", None)
        if not all(hasattr(x, a) for x, a in ((queue, "_writer"), (thread, "_record_writer"))):
            return None
        records = cls(queue._writer, events._file_name)
        queue._writer = thread._record_writer = records
        return records

    def write(self, data: bytes) -> None:
        if self.error is not None:
            return
        size = os.path.getsize(self.path) if os.path.exists(self.path) else 0
        try:
            self.inner.write(data)
        except OSError as e:
            self._failed(e)
            with suppress(OSError):
                os.truncate(self.path, size)  # no torn record at the end

    def flush(self) -> None:
        if self.error is None:
            try:
                self.inner.flush()
            except OSError as e:
                self._failed(e)

    def close(self) -> None:
        try:
            self.inner.close()
        except OSError as e:
            self._failed(e)

    @property
    def closed(self) -> bool:
        return self.inner.closed

    def _failed(self, e: OSError) -> None:
        if write_failure(e) is None:
            raise e
        if e.filename is None:
            e.filename = self.path
        self.error = self.error or e


class WandbSink:
    """Weights & Biases, offline by default (RUN_DIR/wandb/, `wandb sync` later). The run id is kept in
    RUN_DIR/wandb_id so a resumed run continues the same W&B run. W&B keeps the first value logged at a step,
    so after a resume it shows the values from before the kill (identical: resume is exact) and after a
    rollback the curve from before it up to the rollback's step."""

    name = "wandb"

    def __init__(self, run_dir: Path, lc: LogConfig, config: dict[str, Any]) -> None:
        """`lc`: the project and mode; `config`: the whole run config as a dict, which W&B records."""
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "log.wandb is true but wandb is not installed; pip install wandb, or set --log.wandb false"
            ) from None
        id_file = Path(run_dir) / "wandb_id"
        if id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            run_id = secrets.token_hex(4)
            id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            project=lc.wandb_project,
            name=Path(run_dir).name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            mode=lc.wandb_mode,
            config=config,
        )

    def write(self, record: dict[str, Any]) -> None:
        self.run.log(tagged(record), step=record["step"])

    def restart_at(self, step: int) -> None:
        pass  # see the class docstring

    def close(self) -> None:
        self.run.finish()


def open_sinks(
    lc: LogConfig,
    run_dir: Path,
    start_step: int,
    config: dict[str, Any],
    log: Callable[[str], None],
) -> list[Sink]:
    """metrics.jsonl first (the CSV is rebuilt from it), then the optional sinks the log section asks for.
    `config`: the whole run config as a dict (Config.to_dict()), which TensorBoard and W&B record."""
    sinks: list[Sink] = [JsonlSink(run_dir, start_step)]
    if lc.csv:
        sinks.append(CsvSink(run_dir, start_step))
    if lc.tensorboard:
        config_text = yaml.safe_dump(config, sort_keys=False)
        try:
            sinks.append(TensorBoardSink(run_dir, start_step, config_text))
        except ImportError:
            log("tensorboard: off (the tensorboard package is not installed: pip install tensorboard)")
    if lc.wandb:
        sinks.append(WandbSink(run_dir, lc, config))
    return sinks
