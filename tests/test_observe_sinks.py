"""Every sink writes the documented schema, and none shows a step twice after a resume or a rollback."""

import csv
import shutil
import sys
import types
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from hopperlm.checkpoint.layout import latest_checkpoint
from hopperlm.config import load_config
from hopperlm.errors import ConfigError
from hopperlm.observe.metrics import FIELDS, read_metrics
from hopperlm.observe.sinks import TAGS, CsvSink, JsonlSink, TensorBoardSink, WandbSink, open_sinks, tagged
from hopperlm.train.loop import train

DEBUG = Path(__file__).resolve().parents[1] / "configs" / "debug.yaml"
QUIET = lambda line: None  # noqa: E731
OVERRIDES = [
    "--train.max_steps",
    "12",
    "--checkpoint.every",
    "6",
    "--train.log_every",
    "1",
    "--train.eval_every",
    "6",
    "--log.csv",
    "true",
    "--log.report",
    "false",
]


def config(data, run, *extra):
    return load_config(DEBUG, ["--data.path", str(data), "--run.out_dir", str(run), *OVERRIDES, *extra])


def scalars(run_dir, tag):
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def csv_rows(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def test_sinks_write_the_schema_and_a_resume_shows_each_step_once(shakespeare_bytes, tmp_path):
    full = tmp_path / "full"
    train(config(shakespeare_bytes, full), log=QUIET)
    records = read_metrics(full / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 13))
    for r in records:  # metrics.jsonl: only documented fields, the required ones always
        assert set(r) <= set(FIELDS)
        assert {"step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "elapsed_s"} <= set(r)
    assert [r["step"] for r in records if "val_loss" in r] == [6, 12]

    header, rows = csv_rows(full)  # metrics.csv: the schema's fields as columns, one row per record
    assert tuple(header) == FIELDS and len(rows) == 12
    for r, row in zip(records, rows, strict=True):
        assert float(row["loss"]) == r["loss"] and int(row["step"]) == r["step"]
        assert row["mfu"] == "" and row["val_loss"] == ("" if "val_loss" not in r else str(r["val_loss"]))

    assert scalars(full, "loss/train") == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in records]
    assert [s for s, _ in scalars(full, "loss/val")] == [6, 12]
    acc = EventAccumulator(str(full / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) <= set(TAGS.values())
    assert {"loss/train", "optim/lr", "optim/grad_norm", "speed/tokens_per_s"} <= set(acc.Tags()["scalars"])

    # killed after logging step 12 but before its checkpoint: every sink already holds steps 7-12
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step_000012")
    assert latest_checkpoint(cut).name == "step_000006"
    train(config(shakespeare_bytes, cut), resume=True, log=QUIET)
    assert [r["step"] for r in read_metrics(cut / "metrics.jsonl")] == list(range(1, 13))
    assert [int(row["step"]) for row in csv_rows(cut)[1]] == list(range(1, 13))
    resumed = scalars(cut, "loss/train")
    assert [s for s, _ in resumed] == list(range(1, 13))  # the old file's 7-12 purged, not shown twice
    assert [v for _, v in resumed] == [v for _, v in scalars(full, "loss/train")]  # exact resume
    assert len(list((cut / "tensorboard").glob("events.out.tfevents.*"))) == 2


def test_tensorboard_restart_after_a_rollback(tmp_path):
    sink = TensorBoardSink(tmp_path, 0, "model: {}")
    for step in range(1, 11):
        sink.write({"step": step, "loss": 5.0 - 0.1 * step, "val_loss": None, "mfu": float("nan")})
    sink.restart_at(6)  # the guard went back to the step-6 checkpoint
    for step in range(7, 13):
        sink.write({"step": step, "loss": 1.0})
    sink.close()
    got = scalars(tmp_path, "loss/train")
    assert [s for s, _ in got] == list(range(1, 13))
    assert [v for s, v in got if s > 6] == [1.0] * 6
    assert "speed/mfu" not in EventAccumulator(str(tmp_path / "tensorboard")).Reload().Tags()["scalars"]


def test_tagged_leaves_out_null_nan_and_unknown_fields():
    record = {"step": 3, "loss": 2.5, "val_loss": None, "mfu": float("nan"), "lr": 1e-3, "new_field": 1.0}
    assert tagged(record) == {"loss/train": 2.5, "optim/lr": 1e-3}


def test_jsonl_and_csv_sinks_truncate_to_the_checkpoint(tmp_path):
    jsonl = JsonlSink(tmp_path, 0)
    table = CsvSink(tmp_path, 0)
    for step in range(1, 6):
        record = {"step": step, "tokens": 64 * step, "loss": 1.0 / step, "gpu_util": 50.0}
        jsonl.write(record)
        table.write(record)
    for sink in (jsonl, table):
        sink.restart_at(3)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    header, rows = csv_rows(tmp_path)
    assert tuple(header) == FIELDS and [row["step"] for row in rows] == ["1", "2", "3"]
    assert rows[0]["gpu_util"] == "50.0" and rows[0]["lr"] == ""
    JsonlSink(tmp_path, 2)  # a resume from step 2 truncates at start
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


class FakeWandb(types.ModuleType):
    """Records the calls hopperlm makes; the real package is optional and not installed in CI."""

    def __init__(self):
        super().__init__("wandb")
        self.calls = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        return self

    def log(self, data, step=None):
        self.calls.append(("log", data, step))

    def finish(self):
        self.calls.append(("finish",))


def test_wandb_sink_call_shape_offline_and_resumable(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = load_config(DEBUG, ["--log.wandb", "true", "--log.wandb_project", "proj"])
    run_dir = tmp_path / "run-a"
    run_dir.mkdir()
    sink = WandbSink(run_dir, cfg.log, cfg.to_dict())
    sink.write({"step": 10, "tokens": 640, "loss": 2.0, "mfu": None, "val_loss": 1.9})
    sink.close()
    kind, kwargs = fake.calls[0]
    assert kind == "init" and kwargs["mode"] == "offline" and kwargs["project"] == "proj"
    assert kwargs["resume"] == "allow" and kwargs["dir"] == str(run_dir) and kwargs["name"] == "run-a"
    assert kwargs["config"]["log"]["wandb"] is True
    assert fake.calls[1] == ("log", {"loss/train": 2.0, "loss/val": 1.9, "progress/tokens": 640}, 10)
    assert fake.calls[2] == ("finish",)
    WandbSink(run_dir, cfg.log, cfg.to_dict())  # a resume continues the same W&B run
    assert fake.calls[3][1]["id"] == kwargs["id"] == (run_dir / "wandb_id").read_text().strip()


def test_wandb_missing_is_a_one_line_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    cfg = load_config(DEBUG, ["--log.wandb", "true"])
    with pytest.raises(ConfigError, match="pip install wandb"):
        open_sinks(cfg.log, tmp_path, 0, cfg.to_dict(), QUIET)


def test_tensorboard_missing_is_one_line_and_training_goes_on(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    lines = []
    sinks = open_sinks(load_config(DEBUG, []).log, tmp_path, 0, {}, lines.append)
    assert [s.name for s in sinks] == ["metrics.jsonl"]
    assert lines == ["tensorboard: off (the tensorboard package is not installed: pip install tensorboard)"]


@pytest.mark.slow
def test_real_wandb_offline(shakespeare_bytes, tmp_path, monkeypatch):
    """With wandb installed (it is optional: CI skips this), a run logs offline and a resume keeps its id."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    extra = ["--log.wandb", "true", "--log.tensorboard", "false"]  # report off and csv on: OVERRIDES
    cfg = lambda steps: config(shakespeare_bytes, run, "--train.max_steps", str(steps), *extra)  # noqa: E731
    train(cfg(10), log=QUIET)
    train(cfg(15), resume=True, log=QUIET)
    run_id = (run / "wandb_id").read_text().strip()
    offline = sorted((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(p.name.endswith(run_id) for p in offline)
