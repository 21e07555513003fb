"""Speed-ups, each an `apply_*` function, applied by `apply_speedups` in one fixed order (torchtitan's):

    float8 (swap linear layers)  ->  fused q/k/v and gate/up GEMMs  ->  Liger's kernels (train.kernels)
    ->  fused loss  ->  activation checkpointing  ->  torch.compile
    ->  DDP / FSDP2 (parallel/parallelize.py; train/step.py `build_step` applies both, in this order)

Swapping modules comes first so that checkpointing and compile see the final modules (the projections are fused
only where float8 left them plain nn.Linear layers); compile comes before
the data-parallel wrapping, so that it traces through the recompute wrappers and fuses the float8 casts while
FSDP2's hooks stay outside the compiled blocks (torchtitan's order). Each step is chosen by the plan (plan/)
and can be overridden from config.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hopperlm.errors import first_line
from hopperlm.plan import Plan
from hopperlm.plan.record import Float8
from hopperlm.speed.activation_checkpointing import apply_activation_checkpointing
from hopperlm.speed.compile import apply_compile
from hopperlm.speed.float8 import Float8NativeLinear, apply_fp8
from hopperlm.speed.fused_projections import ALL_FUSED, apply_fused_projections
from hopperlm.speed.liger import apply_liger

PROBE_ROWS = 64  # rows of the probe's input: a multiple of 16, as the float8 matmuls need


def apply_speedups(model: torch.nn.Module, plan: Plan, log: Callable[[str], None]) -> Float8:
    """Apply the plan's speed-ups to `model` in place; returns the float8 backend in effect. A backend that
    cannot run here is undone (training continues in bf16): "off" is returned, with one line saying why. The
    plan itself never changes: the run keeps what is in effect in its state."""
    fp8 = plan.fp8
    if fp8 != "off":
        try:
            n = apply_fp8(model, fp8, fsdp_float8_all_gather=plan.fp8_all_gather)
            if n == 0:
                raise RuntimeError("no linear layer is large enough, with dims divisible by 16, to gain")
            unverified = _probe(model, plan)
        except Exception as e:  # ImportError, a CUDA capability error, a shape error: all mean bf16
            _undo_fp8(model)
            log(f"fp8: off ({fp8} failed at start-up: {first_line(e)}); training continues in bf16")
            fp8 = "off"
        else:
            done = f"fp8: {n} linear layers in float8 ({fp8})"
            if unverified is None:
                log(f"{done}; the LM head and small layers stay bf16")
            else:
                log(f"{done}, unverified: {unverified}; a float8 failure would show at the first step")
    # the plan never pairs fused projections with float8 (whose layers run their own matmuls); a plan replaced
    # by hand may, and float8 then wins. The plan's reasons already say "on": only a fallback gets a line.
    if plan.fused_projections and fp8 == "off":
        line = apply_fused_projections(model)
        if line != ALL_FUSED:
            log(line)
    if plan.kernels == "liger":
        log(apply_liger(model))
    model.fused_loss = plan.fused_loss
    apply_activation_checkpointing(model, plan.activation_checkpointing, plan.ac_every)
    if plan.compile:
        apply_compile(model, plan.compile_mode, plan.compile_scope)
    return fp8


def _probe(model: torch.nn.Module, plan: Plan) -> str | None:
    """One forward/backward of one float8 layer of each distinct shape, on PROBE_ROWS random rows, so a
    float8 failure shows at start-up, not at step 1. The gradients come back from autograd.grad and are
    dropped: no parameter's .grad is ever set, so the probe holds one layer's weight gradient at most, whatever
    the model's size (a forward/backward of the whole model would hold fp32 gradients of every weight before
    FSDP shards them: an out-of-memory on exactly the models that need FSDP). Returns None when every shape
    ran, else why the check could not run (an out-of-memory, which shows nothing about float8); any other
    failure raises."""
    layers = {}  # (type, weight shape, dtype) -> the first such layer
    for module in model.modules():
        if _is_float8(module):
            w = module.weight
            layers.setdefault((type(module), tuple(w.shape), w.dtype), module)
    devices = [plan.device] if plan.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), plan.autocast():
            for module in layers.values():
                w = module.weight
                x = torch.randn(PROBE_ROWS, w.shape[1], device=w.device, dtype=w.dtype, requires_grad=True)
                out = module(x)  # (PROBE_ROWS, out_features)
                inputs = (x, w) if w.requires_grad else (x,)
                torch.autograd.grad(out.float().sum(), inputs)  # the backward's matmuls, results dropped
    except torch.OutOfMemoryError as e:
        # says nothing about float8, and bf16 would need more memory, not less: float8 stays on
        if plan.device.type == "cuda":
            torch.cuda.empty_cache()
        return f"the start-up check ran out of memory ({first_line(e)})"
    return None


def _is_float8(module: torch.nn.Module) -> bool:
    return isinstance(module, Float8NativeLinear) or type(module).__name__ == "Float8Linear"  # torchao's


def _undo_fp8(model: torch.nn.Module) -> None:
    """Turn converted layers back into nn.Linear (they keep the same weight parameter)."""
    for module in model.modules():
        if _is_float8(module):
            module.__class__ = torch.nn.Linear
