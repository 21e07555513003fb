"""What this machine can do: device, compute capability, memory, SMs, tensor-core dtypes, attention backends,
NCCL, CPU cores and RAM, and the dense peak FLOP/s that MFU is measured against.

`detect()` reads the real machine; tests build `Hardware` by hand (`simulated()`) to check the plan on GPUs
this machine does not have.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import asdict, dataclass, field

import torch

from hopperlm.errors import ConfigError

# Dense (not sparse) tensor-core peaks from the vendors' datasheets, TFLOP/s: (16-bit, fp8). The 16-bit peak is
# bf16 where the GPU has it, else fp16 (T4, V100). Patterns are tried in order, specific variants first.
# GPUs not listed get no peak: MFU is then n/a rather than guessed.
PEAKS_TFLOPS: list[tuple[str, float, float | None]] = [
    (r"GH200", 989.0, 1979.0),
    (r"H200", 989.0, 1979.0),
    (r"H100.*NVL", 835.0, 1671.0),
    (r"H100.*PCIe", 756.0, 1513.0),
    (r"H100", 989.0, 1979.0),  # SXM5, reported as "H100 80GB HBM3"
    (r"H800", 989.0, 1979.0),
    (r"A100", 312.0, None),  # 40 GB and 80 GB, SXM and PCIe: same tensor peak
    (r"A800", 312.0, None),
    (r"L40S", 362.0, 733.0),
    (r"L40\b", 181.0, 362.0),
    (r"\bL4\b", 121.0, 242.5),
    (r"\bA10\b", 125.0, None),
    (r"RTX 4090", 165.2, 330.3),  # fp32 accumulate (Ada whitepaper)
    (r"RTX 4050", 24.3, 48.6),  # Laptop GPU: 20 SMs x 512 FLOP/clk x 2.37 GHz max boost; lower at low TGP
    (r"RTX 3090", 71.0, None),
    (r"RTX A6000", 155.0, None),
    (r"V100", 125.0, None),  # fp16 (no bf16)
    (r"\bT4\b", 65.0, None),  # fp16 (no bf16)
]


def peak_flops(device_name: str) -> tuple[float | None, float | None]:
    """(dense 16-bit, dense fp8) peak FLOP/s for a GPU name as torch reports it; None where unknown."""
    for pattern, tflops16, tflops8 in PEAKS_TFLOPS:
        if re.search(pattern, device_name):
            return tflops16 * 1e12, tflops8 * 1e12 if tflops8 else None
    return None, None


@dataclass
class Hardware:
    """One device as the plan sees it. Memory in bytes; capability None on CPU."""

    device_type: str  # "cuda" | "cpu"
    name: str
    index: int = 0
    capability: tuple[int, int] | None = None
    total_memory: int = 0
    free_memory: int = 0
    sm_count: int = 0
    gpu_count: int = 0
    bf16: bool = False
    fp8: bool = False
    tf32: bool = False
    attention: list[str] = field(default_factory=list)  # usable SDPA backends and extras, fastest first
    nccl: bool = False
    cpu_cores: int = 1
    ram: int = 0
    peak_16bit: float | None = None
    peak_fp8: float | None = None
    torch_version: str = torch.__version__

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.index) if self.device_type == "cuda" else torch.device("cpu")

    @property
    def sm(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}" if self.capability else "cpu"

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> list[str]:
        gib = 1024**3
        if self.device_type == "cpu":
            return [
                f"device: CPU, {self.cpu_cores} cores, {self.ram / gib:.0f} GiB RAM, torch {self.torch_version}",
                "tensor cores: none; attention: " + ", ".join(self.attention),
                "peak FLOP/s: unknown for CPUs (MFU n/a)",
            ]
        dtypes = [d for d, ok in (("tf32", self.tf32), ("bf16", self.bf16), ("fp8", self.fp8)) if ok]
        peak = "unknown (not in the table: MFU n/a)"
        if self.peak_16bit:
            peak = f"{self.peak_16bit / 1e12:.0f} TFLOP/s dense 16-bit"
            peak += f", {self.peak_fp8 / 1e12:.0f} fp8" if self.peak_fp8 else ""
        return [
            f"device: {self.name} ({self.sm}, {self.sm_count} SMs), {self.total_memory / gib:.1f} GiB "
            f"({self.free_memory / gib:.1f} free), {self.gpu_count} GPU(s), torch {self.torch_version}",
            f"tensor cores: {', '.join(dtypes) or 'fp16 only'}; attention: {', '.join(self.attention)}; "
            f"NCCL: {'yes' if self.nccl else 'no'}",
            f"host: {self.cpu_cores} CPU cores, {self.ram / gib:.0f} GiB RAM; peak: {peak}",
        ]


def cpu_cores() -> int:
    """Cores this process may use (respects taskset/cgroup affinity where the OS tells us)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def gpu_attention_backends(capability: tuple[int, int]) -> list[str]:
    """SDPA kernels this torch build and GPU generation can run, in the order the plan prefers them."""
    found = []
    if capability >= (8, 0) and torch.backends.cuda.is_flash_attention_available():
        found.append("flash")
    if capability >= (9, 0) and torch.backends.cudnn.is_available():
        found.append("cudnn")
    found += ["efficient", "math"]
    if importlib.util.find_spec("triton") is not None:
        found.append("flex")
    if importlib.util.find_spec("flash_attn_interface") is not None:
        found.append("fa3")
    return found


# SDPA's two CPU kernels, named as the plan names them ("attention: SDPA's CPU kernel (PyTorch picks it)"), so
# diagnose and the run report, which print this list, say what the console says (the first is flash-based)
CPU_ATTENTION = ["SDPA's CPU kernel", "math"]


def _cpu_only() -> Hardware:
    cores = cpu_cores()
    return Hardware("cpu", f"CPU ({cores} cores)", attention=list(CPU_ATTENTION), cpu_cores=cores, ram=_ram())


def detect(index: int | None = None) -> Hardware:
    """The real machine: the CUDA GPU `index` (default: the current one) if there is one, else the CPU."""
    if not torch.cuda.is_available():
        return _cpu_only()
    index = torch.cuda.current_device() if index is None else index
    props = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    capability = (props.major, props.minor)
    p16, p8 = peak_flops(props.name)
    return Hardware(
        "cuda",
        props.name,
        index=index,
        capability=capability,
        total_memory=total,
        free_memory=free,
        sm_count=props.multi_processor_count,
        gpu_count=torch.cuda.device_count(),
        bf16=capability >= (8, 0),
        fp8=capability >= (8, 9),
        tf32=capability >= (8, 0),
        attention=gpu_attention_backends(capability),
        nccl=torch.distributed.is_available() and torch.distributed.is_nccl_available(),
        cpu_cores=cpu_cores(),
        ram=_ram(),
        peak_16bit=p16,
        peak_fp8=p8,
    )


def detect_for(preference: str) -> Hardware:
    """Hardware for train.device: 'auto', 'cpu', 'cuda' or 'cuda:N' (ConfigError with the fix otherwise)."""
    if preference == "cpu":
        return _cpu_only()
    if preference == "auto":
        return detect()
    match = re.fullmatch(r"cuda(?::(\d+))?", preference)
    if not match:
        raise ConfigError(f"train.device={preference!r} is not 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if not torch.cuda.is_available():
        raise ConfigError(f"train.device={preference} but torch sees no CUDA GPU; use --train.device cpu")
    index = int(match.group(1)) if match.group(1) else None
    if index is not None and index >= torch.cuda.device_count():
        raise ConfigError(f"train.device={preference}: only {torch.cuda.device_count()} GPU(s) visible")
    return detect(index)


_GIB = 1024**3
# Descriptions of GPUs this project's tests plan for without having them (datasheet values).
SIMULATED: dict[str, dict] = {
    "H100 80GB": dict(name="NVIDIA H100 80GB HBM3", capability=(9, 0), total_memory=80 * _GIB, sm_count=132),
    "H200": dict(name="NVIDIA H200", capability=(9, 0), total_memory=141 * _GIB, sm_count=132),
    "A100 40GB": dict(name="NVIDIA A100-SXM4-40GB", capability=(8, 0), total_memory=40 * _GIB, sm_count=108),
    "RTX 4050 6GB": dict(
        name="NVIDIA GeForce RTX 4050 Laptop GPU", capability=(8, 9), total_memory=6 * _GIB, sm_count=20
    ),
    "T4": dict(name="Tesla T4", capability=(7, 5), total_memory=15 * _GIB, sm_count=40),
}


def simulated(kind: str, free_fraction: float = 0.95) -> Hardware:
    """A Hardware description of a GPU (or 'CPU') that is not here, for planning tests and `diagnose --as`."""
    if kind.upper() == "CPU":
        return Hardware("cpu", "CPU (8 cores)", attention=list(CPU_ATTENTION), cpu_cores=8, ram=64 * _GIB)
    if kind not in SIMULATED:
        raise ConfigError(f"no simulated GPU {kind!r}; choose one of: {', '.join(SIMULATED)}, CPU")
    spec = SIMULATED[kind]
    cap = spec["capability"]
    p16, p8 = peak_flops(spec["name"])
    attention = [b for b in ("flash", "cudnn") if (b == "flash" and cap >= (8, 0)) or cap >= (9, 0)]
    return Hardware(
        "cuda",
        spec["name"],
        capability=cap,
        total_memory=spec["total_memory"],
        free_memory=int(spec["total_memory"] * free_fraction),
        sm_count=spec["sm_count"],
        gpu_count=1,
        bf16=cap >= (8, 0),
        fp8=cap >= (8, 9),
        tf32=cap >= (8, 0),
        attention=[*attention, "efficient", "math", "flex"],
        nccl=True,
        cpu_cores=16,
        ram=128 * _GIB,
        peak_16bit=p16,
        peak_fp8=p8,
    )
