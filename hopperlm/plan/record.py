"""The plan's record: every choice for one run with its reason, immutable once made."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Literal

import torch

from hopperlm.memory import MemoryEstimate

# the plan's choices, named as the config names them (config/training.py's Literal fields)
Precision = Literal["fp32", "bf16", "fp16"]
Checkpointing = Literal["none", "selective-op", "selective-block", "full"]
Float8 = Literal["off", "tensorwise", "rowwise", "native"]
OptimizerName = Literal["adamw", "adamw8bit", "muon", "paged_adamw8bit"]
CompileMode = Literal["default", "max-autotune", "max-autotune-no-cudagraphs", "reduce-overhead"]
Strategy = Literal["none", "ddp", "fsdp", "hsdp"]
Kernels = Literal["compiler", "liger"]


class Reasons(dict):
    """The plan's reasons, key -> one line; read-only once the plan is made (a frozen plan's reasons too)."""

    def _frozen(self, *args, **kwargs):
        raise TypeError("a Plan is immutable: what changes during a run belongs to the run's state")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _frozen

    def __reduce__(self):
        return Reasons, (dict(self),)


@dataclass(frozen=True)
class Plan:
    """Every choice for one run on one machine, each with a one-line reason. Immutable once made: what changes
    while a run goes (the micro-batch after an out-of-memory error, a float8 backend that fails at start-up)
    is the run's state, logged when it changes (train/run.py)."""

    device: torch.device
    precision: Precision
    autocast_dtype: torch.dtype | None
    loss_scaling: bool
    tf32: bool
    attention: str  # "auto" (SDPA's own dispatch), "cudnn-first" (the probe's pick) or the one backend forced
    compile: bool
    compile_mode: CompileMode | None
    activation_checkpointing: Checkpointing
    fused_adamw: bool
    pin_memory: bool
    expandable_segments: bool
    seq_len: int
    compile_scope: Literal["block", "model"] = "block"
    ac_every: int = 2
    fp8: Float8 = "off"
    fused_loss: bool = False
    fused_projections: bool = False  # q/k/v and gate/up as one GEMM each (speed/fused_projections.py)
    kernels: Kernels = "compiler"  # the elementwise kernels' author: inductor or Liger (speed/liger.py)
    optimizer: OptimizerName = "adamw"
    # Muon's Newton–Schulz precision (train/muon.py): bf16 on CUDA, fp32 on a CPU; a resume keeps its checkpoint's
    muon_ns: Literal["bf16", "fp32"] = "bf16"
    lora: str = "none"  # "none", or what is adapted and how the base is stored
    micro_batch: int = 0  # per rank
    grad_accum: int = 1
    memory: MemoryEstimate | None = None
    strategy: Strategy = "none"  # chosen by plan/strategy.py, carried out by parallel/parallelize.py
    world_size: int = 1
    dp_shard: int = 1  # ranks one copy of the weights/grads/optimizer state is sharded over
    fp8_all_gather: bool = False  # FSDP all-gathers float8 weights (tensorwise fp8 only)
    threads: int | None = None  # torch's CPU threads (None: torch's default)
    keep_freed_memory: bool = False  # glibc keeps freed blocks for reuse (cpu_allocator.py; CPU runs)
    reasons: Mapping[str, str] = field(default_factory=Reasons)

    def __post_init__(self) -> None:
        if not isinstance(self.reasons, Reasons):
            object.__setattr__(self, "reasons", Reasons(self.reasons))

    def replace(self, **changes) -> Plan:
        """A new plan with `changes` (and reasons updated from changes["reasons"], if given)."""
        reasons = {**self.reasons, **changes.pop("reasons", {})}
        return dataclasses.replace(self, reasons=Reasons(reasons), **changes)

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step, all ranks together."""
        return self.micro_batch * self.seq_len * self.grad_accum * self.world_size

    def lines(self) -> list[str]:
        return [f"{key}: {reason}" for key, reason in self.reasons.items()]

    def autocast(self) -> AbstractContextManager:
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def sdpa_backends(self) -> AbstractContextManager:
        """The attention kernels SDPA may use: SDPA's own dispatch (auto), or exactly the one the config
        forced (on a CPU only math can be forced: SDPA's CPU flash kernel is the other one). Training holds it
        around the backward too: activation checkpointing recomputes the forward there, and a different
        kernel would not save the same tensors (torch.utils.checkpoint's CheckpointError)."""
        if self.attention == "auto":
            return nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from hopperlm.plan.attention_probe import CUDNN_FIRST

        # the probe's pick (plan/attention_probe.py): cuDNN where it takes the call, else flash and the rest in
        # SDPA's order (an eval or finder shape cuDNN refuses still runs)
        if self.attention == CUDNN_FIRST:
            order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
            return sdpa_kernel([*order, SDPBackend.MATH], set_priority=True)

        names = {
            "flash": SDPBackend.FLASH_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH,
        }
        return sdpa_kernel([names[self.attention]])

    def apply_runtime_settings(self, log: Callable[[str], None]) -> None:
        """Process-wide switches the plan owns (CPU threads, TF32, allocator)."""
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        if self.keep_freed_memory:
            from hopperlm.cpu_allocator import TO_KEEP_DEFAULT, keep_freed_memory

            if not keep_freed_memory():
                log(f"allocator: glibc's default (mallopt refused the thresholds); {TO_KEEP_DEFAULT}")
        if self.device.type != "cuda":
            return
        torch.backends.cuda.matmul.allow_tf32 = self.tf32
        torch.backends.cudnn.allow_tf32 = self.tf32
        if self.expandable_segments:
            # private APIs (the env var only works before CUDA starts); newer torch renamed the setter
            setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
            setter = setter or torch.cuda.memory._set_allocator_settings
            try:
                setter("expandable_segments:True")
            except (AttributeError, RuntimeError):
                log("allocator: default (this torch cannot switch on expandable segments at run time)")
