"""What was alive at the peak of a CUDA memory recording, summarised to a small JSON-able dict.

A raw snapshot (`torch.cuda.memory._snapshot()`, the dict cuda_memory.py pickles for pytorch.org/memory_viz)
runs to hundreds of MB for a few steps of a 7B model. `summarize_snapshot` keeps what answers "where did the
peak come from": the peak, the allocations alive at that moment grouped by their Python stack (largest
first), and the same bytes by origin (the first frame outside torch's own files: a model file, bitsandbytes,
inductor's generated code). It reads only the documented snapshot format, so a test can feed it a made-up
dict:

    {"segments": [{"device": 0, "blocks": [{"address", "size", "state", "frames": [...]}, ...]}, ...],
     "device_traces": [[{"action": "alloc" | "free_requested" | "free_completed" | ..., "addr", "size",
                         "frames": [{"filename", "line", "name"}, ...]}, ...]]}   (one list per device)

The memory at each trace event is rebuilt as memory_viz does: the blocks alive when the snapshot was taken,
walked back through the trace (an alloc had not happened yet, a free had not), then replayed forward; the
peak is the largest sum of live block sizes (the caching allocator's rounded sizes, as
`torch.cuda.max_memory_allocated` counts them). Blocks alive before the recording began have no stack here:
they are reported as one group, "allocated before recording".
"""

from __future__ import annotations

import contextlib
import inspect
from collections import defaultdict
from collections.abc import Iterator

import torch

ALIVE = ("active_allocated", "active_awaiting_free", "active_pending_free")  # block states still allocated
BEFORE = "allocated before recording"


@contextlib.contextmanager
def recording(max_entries: int = 200_000) -> Iterator[None]:
    """Record the allocator's history with Python stacks only (C++ stacks take minutes to symbolise at
    `_snapshot()` on a large trace). Take the snapshot (`take_snapshot`) inside the block."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        yield
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def take_snapshot() -> dict:
    """torch.cuda.memory._snapshot(), with the FX node behind each frame of compiled code where this torch
    can add it (augment_with_fx_traces, torch >= 2.12)."""
    snap = torch.cuda.memory._snapshot
    if "augment_with_fx_traces" in inspect.signature(snap).parameters:
        with contextlib.suppress(Exception):  # an optional extra: the plain snapshot is enough
            return snap(augment_with_fx_traces=True)
    return snap()


def _is_torch_internal(filename: str) -> bool:
    return "/torch/" in filename.replace("\\", "/") and "torchinductor" not in filename


def _short(filename: str) -> str:
    """A path from its package on: site-packages/x/y.py -> x/y.py; /repo/hopperlm/m.py -> hopperlm/m.py."""
    path = filename.replace("\\", "/")
    for anchor in ("site-packages/", "dist-packages/"):
        if anchor in path:
            return path.rsplit(anchor, 1)[1]
    parts = path.split("/")
    return "/".join(parts[-3:]) if len(parts) > 3 else path


def _frame_text(frame: dict) -> str:
    text = f"{_short(frame.get('filename', '?'))}:{frame.get('line', '?')} {frame.get('name', '?')}"
    if frame.get("fx_node_name"):
        text += f" [fx {frame['fx_node_name']}]"
    return text


def stack_key(frames: list[dict], depth: int = 4) -> tuple[str, ...]:
    """The innermost `depth` frames outside torch's own Python files (the frames a reader can act on: model
    code, bitsandbytes, inductor's generated code); the innermost frames of all when every one is torch's."""
    outside = [f for f in frames if not _is_torch_internal(f.get("filename", ""))]
    return tuple(_frame_text(f) for f in (outside or frames)[:depth])


def _origin(frames: list[dict]) -> str:
    outside = [f for f in frames if not _is_torch_internal(f.get("filename", ""))]
    return _short(outside[0].get("filename", "?")) if outside else "torch"


def _device_trace(snapshot: dict, device: int | None) -> tuple[int, list[dict]]:
    traces = snapshot.get("device_traces") or []
    if device is None:  # the device with the most recorded events
        device = max(range(len(traces)), key=lambda d: len(traces[d]), default=0)
    return device, (traces[device] if device < len(traces) else [])


def summarize_snapshot(snapshot: dict, *, top: int = 25, depth: int = 4, device: int | None = None) -> dict:
    """The peak of the recorded history and what was alive at it: `top` groups of allocations by stack
    (bytes, count, sizes, frames), and the bytes by origin. Sizes are in bytes."""
    device, trace = _device_trace(snapshot, device)
    alive: dict[int, tuple[int, list[dict] | None]] = {}  # address -> (size, frames; None: before recording)
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        for block in seg.get("blocks", []):
            if block.get("state") in ALIVE:
                alive[block["address"]] = (block["size"], block.get("frames"))
    actions = {e.get("action") for e in trace}
    free = "free_requested" if "free_requested" in actions else "free_completed"
    events = [e for e in trace if e.get("action") in ("alloc", free)]

    # back from the snapshot's state to the recording's start
    start = dict(alive)
    for e in reversed(events):
        if e["action"] == "alloc":
            start.pop(e["addr"], None)
        else:
            start[e["addr"]] = (e["size"], None)  # freed during the recording, allocated before it
    live = {a: (size, None) for a, (size, _) in start.items()}
    total = start_bytes = sum(size for size, _ in live.values())
    peak, peak_at = total, -1  # -1: the peak is the recording's start
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            total += e["size"] - live.get(e["addr"], (0, None))[0]
            live[e["addr"]] = (e["size"], e.get("frames") or [])
        else:
            total -= live.pop(e["addr"], (0, None))[0]
        if total > peak:
            peak, peak_at = total, i

    at_peak = {a: (size, None) for a, (size, _) in start.items()}  # replay to the peak
    for e in events[: peak_at + 1]:
        if e["action"] == "alloc":
            at_peak[e["addr"]] = (e["size"], e.get("frames") or [])
        else:
            at_peak.pop(e["addr"], None)

    groups: dict[tuple[str, ...], list[int]] = defaultdict(list)
    origins: dict[str, int] = defaultdict(int)
    for size, frames in at_peak.values():
        key = (BEFORE,) if frames is None else stack_key(frames, depth)
        groups[key].append(size)
        origins[BEFORE if frames is None else _origin(frames)] += size
    ranked = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    return {
        "device": device,
        "events": len(events),
        "peak_bytes": peak,
        "peak_event": peak_at,  # index among the alloc/free events; -1: before the first
        "start_bytes": start_bytes,  # alive when the recording began (weights, optimizer state, ...)
        "end_bytes": sum(size for size, _ in alive.values()),  # alive at the snapshot
        "top": [
            {
                "bytes": sum(sizes),
                "count": len(sizes),
                "largest": max(sizes),
                "stack": list(key),
            }
            for key, sizes in ranked[:top]
        ],
        "other_bytes": sum(sum(sizes) for _, sizes in ranked[top:]),
        "by_origin": dict(sorted(origins.items(), key=lambda kv: -kv[1])),
    }
