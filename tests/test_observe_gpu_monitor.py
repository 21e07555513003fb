"""The NVML monitor: interval means and maxima, queries a GPU refuses, and its absence on CPU or without the
package. NVML itself needs an NVIDIA driver, so these use a stand-in with NVML's call shapes."""

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from hopperlm.observe.gpu_monitor import GpuMonitor, open_gpu_monitor, summarize_samples


class FakeNvml:
    NVML_TEMPERATURE_GPU = 0

    class NVMLError(Exception):
        pass

    def __init__(self, readings):
        self.readings = list(readings)  # (util %, power mW, temp C, used bytes) per sample
        self.shutdown = False
        self.refuse_util = False

    def _next(self):
        return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]

    def nvmlDeviceGetUtilizationRates(self, handle):
        if self.refuse_util:  # e.g. a MIG slice
            raise self.NVMLError("Not Supported")
        self.current = self._next()
        return SimpleNamespace(gpu=self.current[0], memory=0)

    def nvmlDeviceGetPowerUsage(self, handle):
        return self.current[1]

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return self.current[2]

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=self.current[3], total=80e9, free=80e9 - self.current[3])

    def nvmlShutdown(self):
        self.shutdown = True


def test_read_gives_interval_means_and_maxima():
    nvml = FakeNvml([(90, 600_000, 60, 40e9), (100, 700_000, 70, 50e9), (95, 650_000, 65, 45e9)])
    monitor = GpuMonitor(nvml, handle="gpu0")
    for _ in range(3):  # what the sampling thread appends between two log steps
        monitor.samples.append(monitor.sample())
    assert monitor.read() == {"gpu_util": 95.0, "gpu_power_w": 650.0, "gpu_temp_c": 70.0, "gpu_mem_gb": 50.0}
    assert monitor.samples == []
    # a log interval shorter than the sampling period: one reading taken on the spot
    assert monitor.read()["gpu_util"] == 95.0


def test_a_refused_query_is_dropped_and_the_rest_go_on():
    nvml = FakeNvml([(90, 600_000, 60, 40e9)])
    nvml.refuse_util = True
    nvml.current = nvml.readings[0]
    monitor = GpuMonitor(nvml, handle="mig")
    assert set(monitor.read()) == {"gpu_power_w", "gpu_temp_c", "gpu_mem_gb"}
    assert monitor.unsupported == {"gpu_util"}


def test_background_thread_samples_and_stops():
    nvml = FakeNvml([(50, 300_000, 40, 10e9)])
    monitor = GpuMonitor(nvml, handle="gpu0", interval_s=0.01)
    monitor.start()
    import time

    deadline = time.time() + 120  # the loop ends at the first sample; only a dead thread waits this long
    while not monitor.samples and time.time() < deadline:
        time.sleep(0.01)
    monitor.stop()
    assert not monitor.thread.is_alive() and nvml.shutdown
    assert monitor.read()["gpu_power_w"] == 300.0


def test_summaries_of_empty_and_partial_samples():
    assert summarize_samples([]) == {}
    assert summarize_samples([{"gpu_temp_c": 61.0}, {"gpu_temp_c": 64.0}]) == {"gpu_temp_c": 64.0}


def test_off_on_cpu_silently():
    lines = []
    assert open_gpu_monitor(torch.device("cpu"), lines.append) is None
    assert lines == []


def test_off_on_gpu_without_the_package_says_which_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    lines = []
    assert open_gpu_monitor(torch.device("cuda", 0), lines.append) is None
    assert lines == ["gpu monitor: off (nvidia-ml-py is not installed: pip install nvidia-ml-py)"]


def test_off_when_nvml_refuses(monkeypatch):
    fake = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def init():
        raise NVMLError("NVML Shared Library Not Found")

    fake.NVMLError, fake.nvmlInit = NVMLError, init
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    lines = []
    assert open_gpu_monitor(torch.device("cuda", 0), lines.append) is None
    assert lines == ["gpu monitor: off (NVML: NVML Shared Library Not Found)"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_gpu_monitor():
    pytest.importorskip("pynvml")
    lines = []
    monitor = open_gpu_monitor(torch.device("cuda", 0), lines.append)
    assert monitor is not None, lines
    reading = monitor.read()
    monitor.stop()
    assert 0 <= reading["gpu_util"] <= 100 and reading["gpu_mem_gb"] > 0 and reading["gpu_power_w"] > 0
