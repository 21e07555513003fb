"""The plan: the concrete choices for one run on one machine, each with a one-line reason.

`make_plan(config, model_config, hardware)` turns every `auto` in the config into a choice (precision, TF32,
attention kernel, compile and its mode, activation checkpointing, fused AdamW, pinned memory, allocator
settings, micro-batch and accumulation). Explicit config values always win and are reported as such.
Hardware can be simulated, so the choices for an H100 or a T4 are tested on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from hopperlm.config import Config, ModelConfig
from hopperlm.data.train_data import describe as describe_data
from hopperlm.errors import ConfigError
from hopperlm.hardware import Hardware
from hopperlm.memory import MemoryEstimate, estimate_memory

CPU_MICRO_BATCH_CAP = 16  # on a CPU, throughput stops improving well before memory runs out
GPU_MICRO_BATCH_CAP_TOKENS = 1 << 19  # without a global batch, do not grow one micro-batch past 512K tokens
LONG_RUN_HOURS = 1.0
LONG_RUN_STEPS = 20_000

# micro_batch_finder(model_cfg, plan, cap) -> (micro_batch, reason): measures on the real GPU (batch_finder.py)
Finder = Callable[[ModelConfig, "Plan", int], tuple[int, str]]


@dataclass
class Plan:
    device: torch.device
    precision: str  # "fp32" | "bf16" | "fp16"
    autocast_dtype: torch.dtype | None
    loss_scaling: bool
    tf32: bool
    attention: str  # "auto" (SDPA's own dispatch) or the backend forced first
    compile: bool
    compile_mode: str | None
    activation_checkpointing: str  # "none" | "full"
    fused_adamw: bool
    pin_memory: bool
    expandable_segments: bool
    seq_len: int
    micro_batch: int = 0
    grad_accum: int = 1
    memory: MemoryEstimate | None = None
    reasons: dict[str, str] = field(default_factory=dict)

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.seq_len * self.grad_accum

    def lines(self) -> list[str]:
        return [f"{key}: {reason}" for key, reason in self.reasons.items()]

    def autocast(self) -> AbstractContextManager:
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def sdpa_backends(self) -> AbstractContextManager:
        """The attention kernels SDPA may use: the chosen one first, safe fallbacks after (auto), or
        exactly the one the config forced."""
        if self.attention == "auto" or self.device.type != "cuda":
            return nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        names = {
            "flash": SDPBackend.FLASH_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH,
        }
        return sdpa_kernel([names[self.attention]])

    def apply_runtime_settings(self) -> None:
        """Process-wide switches the plan owns (TF32, allocator)."""
        if self.device.type != "cuda":
            return
        torch.backends.cuda.matmul.allow_tf32 = self.tf32
        torch.backends.cudnn.allow_tf32 = self.tf32
        if self.expandable_segments:
            try:  # private but stable since torch 2.1; the env var only works before CUDA starts
                torch.cuda.memory._set_allocator_settings("expandable_segments:True")
            except (AttributeError, RuntimeError):
                self.reasons["allocator"] = (
                    "default (this torch cannot switch on expandable segments at run time)"
                )


def _precision(
    cfg: Config, model_cfg: ModelConfig, hw: Hardware, why: dict
) -> tuple[str, torch.dtype | None]:
    want = cfg.train.precision
    if hw.device_type != "cuda":
        if want in ("bf16", "fp16"):
            raise ConfigError(f"train.precision={want} needs a CUDA GPU; on CPU use --train.precision fp32")
        why["precision"] = "fp32 (CPU: 16-bit autocast buys nothing here)"
        return "fp32", None
    if want == "bf16" and not hw.bf16:
        raise ConfigError(f"train.precision=bf16 but {hw.name} ({hw.sm}) has no bf16; use fp16 or auto")
    if want != "auto":
        why["precision"] = f"{want} (set by train.precision)"
        return want, {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[want]
    if not hw.bf16:
        why["precision"] = f"fp16 + dynamic loss scaling ({hw.sm} has no bf16 tensor cores)"
        return "fp16", torch.float16
    note = ""
    if hw.fp8:
        pays = model_cfg.dim >= 2048 and model_cfg.dim % 16 == 0 and model_cfg.hidden_dim % 16 == 0
        note = (
            "; fp8 tensor cores present and this model's matmuls are large enough, but float8 training is not "
            "in hopperlm yet"
            if pays
            else f"; fp8 would not pay off for d={model_cfg.dim} (float8 helps from about d=2048)"
        )
    why["precision"] = f"bf16 autocast, fp32 master weights ({hw.sm} has bf16 tensor cores){note}"
    return "bf16", torch.bfloat16


def _attention(cfg: Config, model_cfg: ModelConfig, hw: Hardware, precision: str, why: dict) -> str:
    want = cfg.train.attention
    if hw.device_type != "cuda":
        if want not in ("auto", "math"):
            raise ConfigError(f"train.attention={want} needs a CUDA GPU; on CPU use auto")
        why["attention"] = "SDPA's CPU kernel (PyTorch picks it)"
        return "auto"
    if want != "auto":
        if want not in hw.attention:
            raise ConfigError(
                f"train.attention={want} is not available on {hw.name} ({hw.sm}); "
                f"available: {', '.join(hw.attention)}; or use auto"
            )
        why["attention"] = f"SDPA {want} only (set by train.attention)"
        return want
    hd = model_cfg.head_dim
    if "flash" in hw.attention and precision != "fp32" and hd <= 256:
        why["attention"] = f"SDPA flash ({hw.sm}, {precision}, head_dim {hd}); others as fallback"
    elif precision == "fp32":
        why["attention"] = "SDPA memory-efficient kernel (flash needs 16-bit inputs)"
    else:
        why["attention"] = f"SDPA memory-efficient kernel (no flash kernel for {hw.sm} / head_dim {hd})"
    return "auto"


def _compile(cfg: Config, hw: Hardware, why: dict) -> tuple[bool, str | None]:
    tc = cfg.train
    on = tc.compile if tc.compile is not None else hw.device_type == "cuda"
    if not on:
        why["compile"] = (
            "off (set by train.compile)"
            if tc.compile is False
            else "off (CPU: inductor's start-up outweighs its gain on a short CPU run)"
        )
        return False, None
    long_run = (tc.max_hours or 0) >= LONG_RUN_HOURS or (tc.max_steps or 0) >= LONG_RUN_STEPS
    if tc.compile_mode != "auto":
        mode, reason = tc.compile_mode, "set by train.compile_mode"
    elif long_run:
        mode, reason = "max-autotune-no-cudagraphs", "a long run repays minutes of kernel autotuning"
    else:
        mode, reason = "default", "a short run: autotuning would cost more than it saves"
    why["compile"] = f"on, mode {mode} ({reason})"
    return True, mode


def _micro_batch(cfg: Config, plan: Plan, hw: Hardware, model_cfg: ModelConfig, finder: Finder | None):
    tc = cfg.train
    seqs = tc.batch_seqs
    est = plan.memory
    if hw.device_type == "cuda":
        budget = tc.memory_target * hw.free_memory
        where = f"{tc.memory_target:.0%} of {hw.free_memory / 1024**3:.1f} GiB free"
    else:
        budget = tc.memory_target * hw.ram * 0.5
        where = f"{tc.memory_target:.0%} of half the RAM ({hw.ram / 1024**3:.0f} GiB)"
    if tc.micro_batch is not None:
        micro, reason = tc.micro_batch, "set by train.micro_batch"
        if est.total(micro) > budget:
            reason += f"; warning: estimated {est.total(micro) / 1e9:.1f} GB exceeds {where}"
    else:
        if hw.device_type == "cuda":
            cap = seqs or max(1, GPU_MICRO_BATCH_CAP_TOKENS // tc.seq_len)
        else:
            cap = seqs or CPU_MICRO_BATCH_CAP
        if finder is not None:
            micro, reason = finder(model_cfg, plan, cap)
        else:
            fit = est.largest_micro_batch(budget)
            micro, reason = min(fit, cap), f"largest that the estimate fits in {where}, at most {cap}"
        if micro < 1:
            raise ConfigError(
                f"one sequence of {tc.seq_len} tokens does not fit {where} (estimate {est.describe(1)}); "
                "use train.activation_checkpointing full, a shorter train.seq_len or a smaller model"
            )
        if seqs is not None:
            while seqs % micro:  # accumulation must reach the global batch exactly
                micro -= 1
    accum = 1 if seqs is None else seqs // micro
    plan.micro_batch, plan.grad_accum = micro, accum
    global_note = "" if seqs is None else f" -> {accum} accumulation step(s) for {seqs} sequences"
    plan.reasons["micro_batch"] = f"{micro} ({reason}){global_note}"


def make_plan(cfg: Config, model_cfg: ModelConfig, hw: Hardware, finder: Finder | None = None) -> Plan:
    """Every choice for this run, with reasons. `finder` measures the micro-batch on a real GPU; without it
    (CPU, simulated hardware) the memory estimate decides."""
    tc = cfg.train
    why: dict[str, str] = {"device": hw.summary()[0].removeprefix("device: ")}
    precision, autocast_dtype = _precision(cfg, model_cfg, hw, why)
    cuda = hw.device_type == "cuda"
    tf32 = tc.tf32 if tc.tf32 is not None else hw.tf32
    if cuda:
        why["tf32"] = ("on" if tf32 else "off") + (
            " (set by train.tf32)"
            if tc.tf32 is not None
            else f" ({hw.sm} {'has' if hw.tf32 else 'lacks'} TF32)"
        )
    attention = _attention(cfg, model_cfg, hw, precision, why)
    compile_on, compile_mode = _compile(cfg, hw, why)
    fused = cfg.optim.fused if cfg.optim.fused is not None else cuda
    if cfg.optim.fused is not None:
        why["optimizer"] = f"AdamW, {'fused' if fused else 'unfused'} (set by optim.fused)"
    else:
        why["optimizer"] = "AdamW, fused kernel" if cuda else "AdamW, unfused (the fused kernel is for CUDA)"
    pin = tc.pin_memory if tc.pin_memory is not None else cuda
    why["data"] = describe_data(cfg.data, hw.device, model_cfg.dropout) + (
        ", pinned host memory + non-blocking copies" if pin else ""
    )
    if cuda:
        why["allocator"] = "expandable segments (less fragmentation when batch shapes change)"

    plan = Plan(
        device=hw.device,
        precision=precision,
        autocast_dtype=autocast_dtype,
        loss_scaling=precision == "fp16",
        tf32=tf32,
        attention=attention,
        compile=compile_on,
        compile_mode=compile_mode,
        activation_checkpointing="none",
        fused_adamw=fused,
        pin_memory=pin,
        expandable_segments=cuda,
        seq_len=tc.seq_len,
        reasons=why,
    )
    # activation checkpointing: only when a single sequence would not fit without it
    plan.memory = estimate_memory(model_cfg, tc.seq_len, precision, "none")
    budget = tc.memory_target * (hw.free_memory if cuda else hw.ram * 0.5)
    if tc.activation_checkpointing != "auto":
        plan.activation_checkpointing = tc.activation_checkpointing
        why["activation_checkpointing"] = (
            f"{tc.activation_checkpointing} (set by train.activation_checkpointing)"
        )
    elif plan.memory.largest_micro_batch(budget) < 1:
        plan.activation_checkpointing = "full"
        why["activation_checkpointing"] = "full (without it one sequence does not fit the memory target)"
    else:
        why["activation_checkpointing"] = "none (activations fit; recomputing would cost ~30% speed)"
    if plan.activation_checkpointing == "full":
        plan.memory = estimate_memory(model_cfg, tc.seq_len, precision, "full")
    _micro_batch(cfg, plan, hw, model_cfg, finder)
    why["memory"] = f"estimated {plan.memory.describe(plan.micro_batch)}"
    return plan
