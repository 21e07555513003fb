"""Speed-ups, each an `apply_*` function, applied by `apply_speedups` in one fixed order (torchtitan's):

    float8 (swap linear layers)  ->  fused loss  ->  activation checkpointing  ->  torch.compile
    ->  DDP / FSDP2 (parallel/parallelize.py; train/step.py `build_step` applies both, in this order)

Swapping modules comes first so that checkpointing and compile see the final modules; compile comes before
the data-parallel wrapping, so that it traces through the recompute wrappers and fuses the float8 casts while
FSDP2's hooks stay outside the compiled blocks (torchtitan's order). Each step is chosen by the plan (plan/)
and can be overridden from config.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hopperlm.speed.checkpointing import apply_activation_checkpointing
from hopperlm.speed.compile import apply_compile
from hopperlm.speed.float8 import Float8NativeLinear, apply_fp8


def apply_speedups(model: torch.nn.Module, plan, log: Callable[[str], None]) -> str:
    """Apply the plan's speed-ups to `model` in place; returns the float8 backend in effect. A backend that
    cannot run here is undone (training continues in bf16): "off" is returned, with one line saying why. The
    plan itself never changes: the run keeps what is in effect in its state."""
    fp8 = plan.fp8
    if fp8 != "off":
        try:
            n = apply_fp8(model, fp8, fsdp_float8_all_gather=plan.fp8_all_gather)
            if n == 0:
                raise RuntimeError("no linear layer is large enough, with dims divisible by 16, to gain")
            _probe(model, plan)
            log(f"fp8: {n} linear layers in float8 ({fp8}); the LM head and small layers stay bf16")
        except Exception as e:  # ImportError, a CUDA capability error, a shape error: all mean bf16
            _undo_fp8(model)
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            log(f"fp8: off ({fp8} failed at start-up: {reason}); training continues in bf16")
            fp8 = "off"
    model.fused_loss = plan.fused_loss
    apply_activation_checkpointing(model, plan.activation_checkpointing, plan.ac_every)
    if plan.compile:
        apply_compile(model, plan.compile_mode, plan.compile_scope)
    return fp8


def _probe(model: torch.nn.Module, plan) -> None:
    """One eager forward/backward of one sequence, so a float8 failure shows at start-up, not at step 1."""
    tokens = torch.zeros(1, plan.seq_len, dtype=torch.long, device=plan.device)
    devices = [plan.device] if plan.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), plan.autocast():
        model(tokens, tokens).backward()
    model.zero_grad(set_to_none=True)


def _undo_fp8(model: torch.nn.Module) -> None:
    """Turn converted layers back into nn.Linear (they keep the same weight parameter)."""
    for module in model.modules():
        if isinstance(module, Float8NativeLinear) or type(module).__name__ == "Float8Linear":  # torchao's
            module.__class__ = torch.nn.Linear
