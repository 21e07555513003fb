"""Peak FLOP/s table and the CPU fallbacks."""

import pytest
import torch

from hopperlm.errors import ConfigError
from hopperlm.hardware import peak_bf16_flops, pick_device, pick_precision


@pytest.mark.parametrize(
    "name, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA H200", 989),
        ("NVIDIA GH200 480GB", 989),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA L4", 121),
        ("NVIDIA L40S", 362),
        ("NVIDIA GeForce RTX 4090", 165.2),
    ],
)
def test_peak_table(name, tflops):
    assert peak_bf16_flops(name) == pytest.approx(tflops * 1e12)


def test_unknown_gpu_has_no_peak():
    assert peak_bf16_flops("NVIDIA GeForce GTX 1080") is None
    assert peak_bf16_flops("Some Future Accelerator") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_cpu_fallbacks_say_why():
    info = pick_device("auto")
    assert info.device.type == "cpu" and info.peak_flops is None and "no CUDA GPU" in info.reason
    prec = pick_precision("auto", info.device)
    assert prec.name == "fp32" and prec.autocast_dtype is None and "CPU" in prec.reason
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        pick_precision("bf16", info.device)
    with pytest.raises(ConfigError, match="sees no CUDA GPU"):
        pick_device("cuda")
