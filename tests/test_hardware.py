"""Peak FLOP/s table, detection on this machine and device errors."""

import pytest
import torch

from hopperlm.errors import ConfigError
from hopperlm.hardware import detect, detect_for, peak_flops, simulated


@pytest.mark.parametrize(
    "name, tflops16, tflops8",
    [
        ("NVIDIA H100 80GB HBM3", 989, 1979),
        ("NVIDIA H100 PCIe", 756, 1513),
        ("NVIDIA H100 NVL", 835, 1671),
        ("NVIDIA H200", 989, 1979),
        ("NVIDIA GH200 480GB", 989, 1979),
        ("NVIDIA A100-SXM4-80GB", 312, None),
        ("NVIDIA A100-PCIE-40GB", 312, None),
        ("NVIDIA L4", 121, 242.5),
        ("NVIDIA L40S", 362, 733),
        ("NVIDIA GeForce RTX 4090", 165.2, 330.3),
        ("Tesla T4", 65, None),
    ],
)
def test_peak_table(name, tflops16, tflops8):
    p16, p8 = peak_flops(name)
    assert p16 == pytest.approx(tflops16 * 1e12)
    assert p8 == (None if tflops8 is None else pytest.approx(tflops8 * 1e12))


def test_unknown_gpu_has_no_peak():
    assert peak_flops("NVIDIA GeForce GTX 1080") == (None, None)
    assert peak_flops("Some Future Accelerator") == (None, None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_detect_cpu():
    hw = detect()
    assert hw.device_type == "cpu" and hw.cpu_cores >= 1 and hw.ram > 0 and hw.peak_16bit is None
    assert not (hw.bf16 or hw.fp8 or hw.tf32) and "math" in hw.attention
    assert "CPU" in hw.summary()[0] and "MFU n/a" in hw.summary()[2]
    assert detect_for("auto").device_type == "cpu"
    with pytest.raises(ConfigError, match="sees no CUDA GPU"):
        detect_for("cuda:0")
    with pytest.raises(ConfigError, match="is not 'auto'"):
        detect_for("tpu")


def test_simulated_descriptions():
    h100 = simulated("H100 80GB")
    assert h100.sm == "sm_90" and h100.fp8 and h100.bf16 and h100.peak_16bit == 989e12
    t4 = simulated("T4")
    assert not t4.bf16 and not t4.fp8 and "flash" not in t4.attention and t4.peak_16bit == 65e12
    with pytest.raises(ConfigError, match="no simulated GPU"):
        simulated("TPU v5")
