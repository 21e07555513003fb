"""What this machine can do: device choice, compute precision, and the dense peak FLOP/s that MFU is measured
against. Every automatic choice comes with a one-line reason that the trainer prints."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from hopperlm.errors import ConfigError

# Dense (not sparse) bf16 tensor-core peaks from the vendors' datasheets, in TFLOP/s. Patterns are tried in
# order, so the specific variants come before the family name. Unknown GPUs get no peak: MFU is then n/a.
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    (r"GH200", 989.0),
    (r"H200", 989.0),
    (r"H100.*NVL", 835.0),
    (r"H100.*PCIe", 756.0),
    (r"H100", 989.0),  # SXM5 (reported as "H100 80GB HBM3")
    (r"H800", 989.0),
    (r"A100", 312.0),
    (r"A800", 312.0),
    (r"L40S", 362.0),
    (r"L40\b", 181.0),
    (r"\bL4\b", 121.0),
    (r"A10G", 70.0),
    (r"\bA10\b", 125.0),
    (r"RTX 4090", 165.2),
    (r"RTX 3090", 71.0),
    (r"RTX A6000", 155.0),
]


def peak_bf16_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s for a GPU name as torch reports it, or None when the GPU is not in the table."""
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name):
            return tflops * 1e12
    return None


@dataclass
class DeviceInfo:
    device: torch.device
    name: str
    peak_flops: float | None
    reason: str


def pick_device(preference: str = "auto") -> DeviceInfo:
    """'auto' takes the first CUDA GPU when there is one, else the CPU."""
    if preference == "auto":
        preference = "cuda" if torch.cuda.is_available() else "cpu"
        why = "CUDA GPU found" if preference == "cuda" else "no CUDA GPU found"
    else:
        why = "set by train.device"
    if preference.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"train.device={preference} but torch sees no CUDA GPU; use --train.device cpu")
        device = torch.device(preference)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise ConfigError(f"train.device={preference}: only {torch.cuda.device_count()} GPU(s) visible")
        name = torch.cuda.get_device_name(device)
        return DeviceInfo(device, name, peak_bf16_flops(name), f"device: {name} ({why})")
    if preference != "cpu":
        raise ConfigError(f"train.device={preference!r} is not 'auto', 'cpu', 'cuda' or 'cuda:N'")
    name = f"CPU ({torch.get_num_threads()} threads)"
    return DeviceInfo(torch.device("cpu"), name, None, f"device: {name} ({why}); MFU is n/a on CPU")


@dataclass
class Precision:
    name: str  # "fp32" | "bf16" | "fp16"
    autocast_dtype: torch.dtype | None  # None = no autocast (fp32)
    loss_scaling: bool  # fp16 needs a dynamic loss scaler so small gradients do not underflow
    reason: str


def pick_precision(preference: str, device: torch.device) -> Precision:
    """bf16 autocast on GPUs with bf16 tensor cores (Ampere+), fp16 + loss scaling on older GPUs, fp32 on CPU."""
    if device.type != "cuda":
        if preference in ("bf16", "fp16"):
            raise ConfigError(
                f"train.precision={preference} needs a CUDA GPU; on {device.type} use --train.precision fp32"
            )
        return Precision("fp32", None, False, "precision: fp32 (CPU: mixed precision buys nothing here)")
    major, minor = torch.cuda.get_device_capability(device)
    has_bf16 = major >= 8
    if preference == "auto":
        if has_bf16:
            return Precision("bf16", torch.bfloat16, False, f"precision: bf16 autocast (sm_{major}{minor})")
        return Precision(
            "fp16", torch.float16, True, f"precision: fp16 + loss scaling (sm_{major}{minor} has no bf16)"
        )
    if preference == "bf16" and not has_bf16:
        raise ConfigError(
            f"train.precision=bf16 but this GPU (sm_{major}{minor}) has no bf16 tensor cores; use fp16 or auto"
        )
    if preference == "fp32":
        return Precision("fp32", None, False, "precision: fp32 (set by train.precision)")
    dtype = torch.bfloat16 if preference == "bf16" else torch.float16
    return Precision(
        preference, dtype, preference == "fp16", f"precision: {preference} (set by train.precision)"
    )
