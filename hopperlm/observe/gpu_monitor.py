"""GPU utilisation, power, temperature and memory from NVML (`pip install nvidia-ml-py`), sampled on a
background thread so that a log step reads the mean over its whole interval rather than one instant.

NVML runs beside the CUDA context and never synchronises with the training stream. Absent NVML (CPU runs, the
package not installed, a driver that refuses) the monitor is off, with one line saying why on a GPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch

SAMPLE_EVERY_S = 0.5


class GpuMonitor:
    """Samples one device; `read()` returns the record fields for the interval since the previous read:
    gpu_util (mean %), gpu_power_w (mean W), gpu_temp_c (max C), gpu_mem_gb (max GB in use)."""

    def __init__(self, nvml: Any, handle: Any, interval_s: float = SAMPLE_EVERY_S) -> None:
        self.nvml, self.handle, self.interval_s = nvml, handle, interval_s
        self.samples: list[dict[str, float]] = []
        self.unsupported: set[str] = set()  # e.g. utilisation on a MIG slice: dropped after the first refusal
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    def sample(self) -> dict[str, float]:
        nvml, h = self.nvml, self.handle
        queries: dict[str, Callable[[], float]] = {
            "gpu_util": lambda: float(nvml.nvmlDeviceGetUtilizationRates(h).gpu),
            "gpu_power_w": lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,  # milliwatts
            "gpu_temp_c": lambda: float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
            "gpu_mem_gb": lambda: nvml.nvmlDeviceGetMemoryInfo(h).used / 1e9,
        }
        out = {}
        for name, query in queries.items():
            if name in self.unsupported:
                continue
            try:
                out[name] = query()
            except nvml.NVMLError:
                self.unsupported.add(name)
        return out

    def _run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            s = self.sample()
            with self.lock:
                self.samples.append(s)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="hopperlm-gpu-monitor", daemon=True)
        self.thread.start()

    def read(self) -> dict[str, float]:
        with self.lock:
            samples, self.samples = self.samples, []
        if not samples:  # a log interval shorter than the sampling period
            samples = [self.sample()]
        return summarize_samples(samples)

    def stop(self) -> None:
        self.stopped.set()
        if self.thread is not None:
            self.thread.join(timeout=2 * self.interval_s + 1)
        with contextlib.suppress(self.nvml.NVMLError):
            self.nvml.nvmlShutdown()


def summarize_samples(samples: list[dict[str, float]]) -> dict[str, float]:
    """Means for utilisation and power, maxima for temperature and memory, rounded for the log."""
    out = {}
    for name, how, digits in (
        ("gpu_util", "mean", 1),
        ("gpu_power_w", "mean", 1),
        ("gpu_temp_c", "max", 0),
        ("gpu_mem_gb", "max", 3),
    ):
        values = [s[name] for s in samples if name in s]
        if values:
            value = sum(values) / len(values) if how == "mean" else max(values)
            out[name] = round(value, digits)
    return out


def open_gpu_monitor(device: torch.device, log: Callable[[str], None]) -> GpuMonitor | None:
    """A monitor for the CUDA device the run uses (`start()` it), or None (with a line saying why on a GPU)."""
    if device.type != "cuda":
        return None
    try:
        import pynvml
    except ImportError:
        log("gpu monitor: off (nvidia-ml-py is not installed: pip install nvidia-ml-py)")
        return None
    try:
        pynvml.nvmlInit()
        handle = _handle_for(pynvml, device)
    except pynvml.NVMLError as e:
        log(f"gpu monitor: off (NVML: {e})")
        return None
    return GpuMonitor(pynvml, handle)


def _handle_for(nvml: Any, device: torch.device) -> Any:
    """NVML numbers GPUs by PCI order, CUDA by CUDA_VISIBLE_DEVICES and speed: match on the UUID."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
    if uuid:
        name = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
        try:
            return nvml.nvmlDeviceGetHandleByUUID(name)
        except nvml.NVMLError:
            pass
    return nvml.nvmlDeviceGetHandleByIndex(index)
