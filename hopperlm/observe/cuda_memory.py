"""CUDA memory snapshots: every allocation with its stack trace (on request) and the allocator's state at an
out-of-memory error. Open the .pickle files at https://pytorch.org/memory_viz.

The recording and the OOM hook are private but long-stable torch APIs (`torch.cuda.memory._record_memory_history`,
`_dump_snapshot`, `torch._C._cuda_attach_out_of_memory_observer`); where a torch lacks them we say so and go on.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import torch

HISTORY_ENTRIES = 100_000  # allocations remembered with their stack traces (the oldest are dropped)


def start_recording(device: torch.device, log: Callable[[str], None]) -> bool:
    """Record every allocation's stack trace from now on (slows allocation down: for profiling, not training)."""
    if device.type != "cuda":
        log("memory snapshot: skipped (CPU run: CUDA memory snapshots need a GPU)")
        return False
    try:
        torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)
    except (AttributeError, RuntimeError) as e:
        log(f"memory snapshot: skipped (this torch cannot record allocation history: {e})")
        return False
    return True


def dump_and_stop_recording(path: Path, log: Callable[[str], None]) -> None:
    torch.cuda.memory._dump_snapshot(str(path))
    torch.cuda.memory._record_memory_history(enabled=None)
    log(f"memory snapshot: {path} (open it at https://pytorch.org/memory_viz)")


_oom = {
    "attached": False,
    "path": None,
    "log": None,
    "done": True,
}  # one observer per process, retargeted per run


def _oom_observer(device_index: int, alloc_bytes: int, device_allocated: int, device_free: int) -> None:
    if _oom["done"]:
        return
    _oom["done"] = True
    with open(_oom["path"], "wb") as f:
        pickle.dump(torch.cuda.memory._snapshot(), f)
    _oom["log"](
        f"out of memory asking for {alloc_bytes / 1e9:.2f} GB on cuda:{device_index} "
        f"({device_free / 1e9:.2f} GB free): allocator snapshot in {_oom['path']}"
    )


def dump_on_oom(device: torch.device, path: Path, log: Callable[[str], None]) -> bool:
    """On the run's first CUDA out-of-memory error, write the allocator's snapshot (segments, blocks and, when
    recording, the stack traces) to `path`. Costs nothing until then. Observers cannot be detached, so one
    per process is attached and pointed at the current run."""
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if device.type != "cuda" or attach is None:
        return False
    _oom.update(path=path, log=log, done=False)
    if not _oom["attached"]:
        attach(_oom_observer)
        _oom["attached"] = True
    return True
