"""The one object the training loop talks to: it records the plan, sends each log step's record to every sink,
adds the GPU monitor's readings and the loss forecast, keeps the progress display and the ETA, and writes the
report at the end.

    observer = RunObserver(cfg, run_dir, log=log, hw=hw, plan=plan, ..., step=0, tokens=0, elapsed_s=0.0)
    with observer:                      # live display, GPU sampling thread; sinks closed even on errors
        ... observer.log_step(record)   # every log step
        ... observer.restart_at(...)    # after a rollback to a checkpoint
    observer.finish(result)             # result.json and the report
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hopperlm.config import Config, ModelConfig, ScheduleConfig, TrainConfig
from hopperlm.diskspace import unwritten
from hopperlm.files import write_atomic
from hopperlm.hardware import Hardware
from hopperlm.model.transformer import count_params
from hopperlm.observe import collapse, cuda_memory
from hopperlm.observe.forecast_log import Forecaster
from hopperlm.observe.gpu_monitor import open_gpu_monitor
from hopperlm.observe.metrics import format_record, read_metrics
from hopperlm.observe.progress import (
    RateMeter,
    RichProgress,
    Snapshot,
    choose_progress,
    ending_rule,
    eta_text,
    rule_progress,
)
from hopperlm.observe.sinks import open_sinks
from hopperlm.plan import Plan


def plan_record(
    hw: Hardware, plan: Plan, model_cfg: ModelConfig, fpt: int, predicted: tuple[float, float]
) -> dict[str, Any]:
    """What RUN_DIR/plan.json holds: the hardware, every choice with its reason, the model's size."""
    return {
        "hardware": {"name": hw.name, "summary": hw.summary(), "peak_16bit_flops": hw.peak_16bit},
        "plan": {
            "reasons": dict(plan.reasons),
            "precision": plan.precision,
            "compile": plan.compile,
            "micro_batch": plan.micro_batch,
            "grad_accum": plan.grad_accum,
            "tokens_per_step": plan.tokens_per_step,
            "memory_estimate_gb": plan.memory.total(plan.micro_batch) / 1e9 if plan.memory else None,
        },
        "model": {**dataclasses.asdict(model_cfg), "parameters": count_params(model_cfg)},
        "flops_per_token": fpt,
        "predicted_tokens_per_s": predicted[0],
        "matmul_flops_measured": predicted[1],
    }


class RunObserver:
    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        *,
        log: Callable[[str], None],
        hw: Hardware,
        plan: Plan,
        model_cfg: ModelConfig,
        fpt: int,
        predicted: tuple[float, float],
        step: int,
        tokens: int,
        elapsed_s: float,
        schedule_budget: TrainConfig | None = None,
    ) -> None:
        self.cfg, self.run_dir, self.log = cfg, Path(run_dir), log
        # the forecast runs to the run's budget with the LR of the schedule's (a resume may keep the original)
        kept = schedule_budget if schedule_budget is not None and schedule_budget != cfg.train else None
        self.forecaster = Forecaster(
            cfg.train, cfg.schedule, cfg.optim.lr, log, schedule=kept, **self._collapse_inputs(model_cfg)
        )
        write_atomic(
            self.run_dir / "plan.json",
            json.dumps(plan_record(hw, plan, model_cfg, fpt, predicted), indent=2, default=str) + "\n",
        )
        (self.run_dir / "result.json").unlink(missing_ok=True)  # the run is going again: not finished
        self.sinks = open_sinks(cfg.log, self.run_dir, step, cfg.to_dict(), log)
        # the validation history so far (a resumed run's ETA to target_loss needs it), after truncation
        metrics = self.run_dir / "metrics.jsonl"
        records = read_metrics(metrics) if metrics.is_file() else []
        self.val_points = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
        self.train_points = [(r["step"], r["loss"]) for r in records if _finite(r.get("loss"))]
        self.best_val = min((v for _, v in self.val_points), default=None)
        self.rates = RateMeter(step, tokens, elapsed_s)
        mode, why = choose_progress(cfg.log.progress)
        self.display = RichProgress() if mode == "rich" else None
        self.gpu = open_gpu_monitor(plan.device, log) if cfg.log.gpu_monitor else None
        names = [s.name for s in self.sinks]
        parts = [
            ", ".join(names) + (f" (tensorboard --logdir {self.run_dir})" if "tensorboard" in names else "")
        ]
        parts.append(f"progress: {why}")
        if self.gpu is not None:
            parts.append("GPU monitor: NVML")
        if cuda_memory.dump_on_oom(plan.device, self.run_dir / "oom_snapshot.pickle", log):
            parts.append("out of memory: allocator snapshot to oom_snapshot.pickle")
        log("observe: " + " | ".join(parts))

    def _collapse_inputs(self, model_cfg: ModelConfig) -> dict:
        """The Forecaster's proxies and run description where train.forecast_from kept the proxies' curves
        (`sweep --widths`), else nothing (the in-run law forecasts)."""
        cfg = self.cfg
        curves = collapse.saved_curves(cfg.train.forecast_from) if cfg.train.forecast_from else []
        if not curves:
            return {}
        run = {"label": "this run", "width": model_cfg.dim, "params": count_params(model_cfg)["total"],
               "seed": cfg.train.seed, "warmup_steps": cfg.schedule.warmup_steps, **collapse.identity(cfg)}  # fmt: skip
        return {"proxies": curves, "run": run}

    def __enter__(self) -> RunObserver:
        if self.gpu is not None:
            self.gpu.start()
        if self.display is not None:
            self.display.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.display is not None:
            self.display.stop()
        if self.gpu is not None:
            self.gpu.stop()
        for sink in list(self.sinks):
            self._guarded(sink, sink.close)

    def log_step(self, record: dict[str, Any]) -> dict[str, Any]:
        """Complete the record (GPU readings), write it everywhere, print the line and refresh the display."""
        if self.gpu is not None:
            record.update(self.gpu.read())
        if _finite(record.get("loss")):
            self.train_points.append((record["step"], record["loss"]))
        val = record.get("val_loss")
        forecast = None
        if _finite(val):
            self.val_points.append((record["step"], val))
            self.best_val = val if self.best_val is None else min(self.best_val, val)
            forecast = self.forecaster.at(record, self.val_points, self.train_points)  # adds its fields
        for sink in list(self.sinks):
            self._guarded(sink, lambda: sink.write(record))  # noqa: B023 (called at once)
        self.rates.mark(record["step"], record["tokens"], record["elapsed_s"])
        tc = self.cfg.train
        rules = rule_progress(
            record["step"], record["tokens"], record["elapsed_s"], tc, self.rates.rate(), self.val_points
        )
        ending = ending_rule(rules)
        self.log(format_record(record, tc.max_steps) + " | " + eta_text(ending))
        if forecast is not None:
            self.forecaster.report(forecast)
        if self.display is not None:
            last_val = self.val_points[-1][1] if self.val_points else None
            self.display.update(
                Snapshot(record, rules, ending, self.best_val, last_val, taken_at=time.perf_counter())
            )
        return record

    def _guarded(self, sink, action: Callable[[], None]) -> None:
        """A sink that cannot write (a full disk, a quota) is dropped with one warning: its file stops growing
        where it was whole, and training, whose checkpoints checkpoint.on_disk_full looks after, goes on."""
        try:
            action()
        except Exception as e:
            full = unwritten(e, fix="free space there")
            if full is None:
                raise
            self.sinks.remove(sink)
            with contextlib.suppress(Exception):  # (TensorBoard's thread and file: let go quietly)
                sink.close()
            self.log(f"warning: {full}; {sink.name} stops here, whole to its last record; the run goes on")

    def restart_at(self, step: int, tokens: int, elapsed_s: float) -> None:
        """The run went back to the checkpoint of `step` (the guard's rollback)."""
        for sink in list(self.sinks):
            self._guarded(sink, lambda: sink.restart_at(step))  # noqa: B023 (called at once)
        self.val_points = [(s, v) for s, v in self.val_points if s <= step]
        self.train_points = [(s, v) for s, v in self.train_points if s <= step]
        self.best_val = min((v for _, v in self.val_points), default=None)
        self.rates.mark(step, tokens, elapsed_s)

    def reschedule(self, tc: TrainConfig, sc: ScheduleConfig, schedule: TrainConfig | None) -> None:
        """The LR schedule changed as the run went (a wall-clock budget's training span, a warm-up laid on the
        clock: train/clock_budget.py): the forecast replays the new one, to `tc`'s end."""
        self.forecaster.tc, self.forecaster.sc, self.forecaster.schedule = tc, sc, schedule

    def finish(self, result: Any) -> None:
        """result.json (how the run ended) and, unless preempted (not by Ctrl-C) or switched off, the report."""
        summary = {
            "stopped_by": result.stopped_by,
            "step": result.step,
            "tokens": result.tokens,
            "elapsed_s": result.elapsed_s,
            "val_loss": result.val_loss,
            # the step val_loss is from (a signal's stop is validated only where the schedule had it due)
            "val_step": getattr(result, "val_step", None),
            "best_val_loss": result.best_val_loss,
            "finished_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        try:
            write_atomic(self.run_dir / "result.json", json.dumps(summary, indent=2) + "\n")
            if not self.cfg.log.report:
                return
            # a scheduler's warning is too short to wait on the report; a person's Ctrl-C is not
            if result.stopped_by.startswith("signal") and result.stopped_by != "signal SIGINT":
                self.log(f"report: skipped (preempted); `hopperlm report {self.run_dir}` writes it")
                return
            from hopperlm.observe.report import write_report

            md, html = write_report(self.run_dir)
            self.log(f"report: {md} and {html}")
        except Exception as e:  # a full disk at the very end: the checkpoints decide the run, not these
            full = unwritten(e)
            if full is None:
                raise
            (self.run_dir / "result.json").unlink(missing_ok=True)  # never a torn one
            self.log(
                f"warning: {full}; `hopperlm report {self.run_dir}` writes the report once there is room"
            )


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


class NullObserver:
    """What ranks other than 0 get: the observer's interface, doing nothing (rank 0 writes for the run)."""

    def __enter__(self) -> NullObserver:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def log_step(self, record: dict[str, Any]) -> dict[str, Any]:
        return record

    def restart_at(self, step: int, tokens: int, elapsed_s: float) -> None:
        return None

    def reschedule(self, tc: TrainConfig, sc: ScheduleConfig, schedule: TrainConfig | None) -> None:
        return None

    def finish(self, result: Any) -> None:
        return None
