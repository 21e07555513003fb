"""`hopperlm profile CONFIG --steps N`: the real training loop of a config under torch.profiler.

The run is `train()` itself (same plan, model, compile, data and optimizer), in its own directory
(RUN_DIR/profile unless --out), with checkpoints, evaluation and the report off. The profiler follows a
wait / warm-up / active schedule, steps on the loop's per-step hook, writes a Chrome trace that Perfetto,
chrome://tracing and TensorBoard's profiler plugin open, and the top-kernels table with each kernel's category
(kernels.py). On CUDA the hook synchronises before each profiler step so that every kernel lands in the step
that launched it. --memory-snapshot records every CUDA allocation for the memory viewer.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hopperlm.config import Config
from hopperlm.errors import ConfigError
from hopperlm.observe import cuda_memory
from hopperlm.observe.kernels import (
    HOST,
    IDLE,
    KernelRow,
    busy_time,
    category_shares,
    classify,
    format_table,
    summary_line,
)

TRACE_NAME = "trace.pt.trace.json"  # the suffix TensorBoard's profiler plugin looks for


class ProfileComplete(Exception):
    """Raised by the step hook once the active steps are recorded: ends train() before evaluation and saving."""


@dataclass
class ProfileResult:
    out_dir: Path
    trace: Path
    table: list[str]
    shares: dict[str, float]
    summary: str
    device: str


def profile_config(
    cfg: Config,
    steps: int,
    wait: int,
    warmup: int,
    out_dir: Path | None,
    memory_snapshot: bool,
    log: Callable[[str], None],
) -> ProfileResult:
    """Train `wait + warmup + steps` steps of `cfg`, record the last `steps`, write the trace and the table."""
    from hopperlm.train.loop import train

    if steps < 1 or wait < 0 or warmup < 0:
        raise ConfigError("profile: --steps must be >= 1 and --wait, --warmup >= 0")
    out_dir = Path(out_dir) if out_dir else Path(cfg.run.out_dir) / "profile"
    total = wait + warmup + steps
    cfg = dataclasses.replace(
        cfg,
        run=dataclasses.replace(cfg.run, out_dir=str(out_dir)),
        # one step more than profiled, so the loop's own end (final evaluation, checkpoint) is never reached
        train=dataclasses.replace(
            cfg.train,
            max_steps=total + 1,
            max_tokens=None,
            max_hours=None,
            target_loss=None,
            eval_every=0,
        ),
        checkpoint=dataclasses.replace(cfg.checkpoint, every=0),
        guard=dataclasses.replace(cfg.guard, policy="skip"),  # rollback would write a checkpoint first
        log=dataclasses.replace(
            cfg.log, tensorboard=False, wandb=False, csv=False, report=False, progress="plain"
        ),
    )
    cuda = torch.cuda.is_available() and cfg.train.device != "cpu"
    device = torch.device("cuda") if cuda else torch.device("cpu")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    trace = out_dir / TRACE_NAME
    prof = torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=steps, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(trace)),
    )
    last = [-1]

    def on_step(done: int) -> None:
        if done == last[0]:
            return  # the same step again (redone after an out-of-memory error)
        last[0] = done
        if done == 0:
            prof.start()
            log(f"profile: {wait} wait + {warmup} warm-up + {steps} recorded steps")
            return
        if cuda:
            torch.cuda.synchronize()
        prof.step()
        if done == total:
            prof.stop()
            raise ProfileComplete

    recording = memory_snapshot and cuda_memory.start_recording(device, log)  # on CPU: says it skips
    try:
        train(cfg, log=log, on_step=on_step)
    except ProfileComplete:
        pass
    finally:
        if recording:
            cuda_memory.dump_and_stop_recording(out_dir / "memory_snapshot.pickle", log)
    rows, total_us = kernel_rows(prof, cuda)
    shares = category_shares(rows, total_us)
    result = ProfileResult(
        out_dir, trace, format_table(rows, total_us), shares, summary_line(shares), "cuda" if cuda else "cpu"
    )
    write_outputs(result, rows, total_us, steps)
    return result


def kernel_rows(prof: torch.profiler.profile, cuda: bool) -> tuple[list[KernelRow], float]:
    """Rows per op (CPU) or kernel (CUDA) over the recorded steps, plus idle/host time; and the steps' total
    wall time in microseconds, which the shares are of."""
    cpu = torch.autograd.DeviceType.CPU
    events = prof.events()
    steps = [e for e in events if e.name.startswith("ProfilerStep") and e.device_type == cpu]
    if not steps:
        raise ConfigError("profile: no step was recorded; raise --steps")
    window = (min(e.time_range.start for e in steps), max(e.time_range.end for e in steps))
    wall_us = window[1] - window[0]
    rows: list[KernelRow] = []
    for avg in prof.key_averages():
        on_device = avg.device_type != cpu
        # user annotations (ProfilerStep#, record_function labels) are mirrored on the GPU timeline: not kernels
        if cuda != on_device or avg.key.startswith("ProfilerStep") or (on_device and avg.is_user_annotation):
            continue
        time_us = avg.self_device_time_total if cuda else avg.self_cpu_time_total
        if time_us > 0:
            rows.append(KernelRow(avg.key, classify(avg.key), float(time_us), avg.count))
    if cuda:
        intervals = [
            (max(e.time_range.start, window[0]), min(e.time_range.end, window[1]))
            for e in events
            if e.device_type != cpu and not e.is_user_annotation and e.time_range.end > e.time_range.start
        ]
        idle = max(0.0, wall_us - busy_time([i for i in intervals if i[1] > i[0]]))
        rows.append(KernelRow("(GPU idle within the steps)", IDLE, idle, len(steps)))
        total_us = max(wall_us, sum(r.time_us for r in rows))  # overlapping streams can exceed the wall
    else:
        host = sum(e.cpu_time_total for e in steps) - sum(r.time_us for r in rows)
        rows.append(
            KernelRow("(host: Python, data, dispatch outside any op)", HOST, max(0.0, host), len(steps))
        )
        total_us = sum(r.time_us for r in rows)
    return rows, max(total_us, 1e-9)


def write_outputs(result: ProfileResult, rows: list[KernelRow], total_us: float, steps: int) -> None:
    kind = "GPU kernels (device time)" if result.device == "cuda" else "CPU ops (self time)"
    head = f"top {kind} over {steps} recorded steps, {total_us / 1000:.1f} ms in all"
    (result.out_dir / "kernels.txt").write_text("\n".join([head, *result.table, "", result.summary]) + "\n")
    (result.out_dir / "profile.json").write_text(
        json.dumps(
            {
                "device": result.device,
                "steps": steps,
                "total_ms": total_us / 1000,
                "shares": result.shares,
                "summary": result.summary,
                "rows": [dataclasses.asdict(r) for r in sorted(rows, key=lambda r: -r.time_us)],
            },
            indent=2,
        )
        + "\n"
    )
