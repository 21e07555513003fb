"""q/k/v and gate/up as one GEMM each, at compute time: the stored parameters stay as they are.

`apply_fused_projections(model)` sets `Attention.fused_qkv` and `SwiGLU.fused_gate_up` (model/transformer.py):
the forward then concatenates the projections' weights and runs one `F.linear`, whose output it splits into
views. The backward's input gradient becomes one GEMM instead of three (two for gate/up) plus the adds that sum
them. Parameters, state-dict keys, HF/GGUF conversion, LoRA targets, μP multipliers and Muon's per-matrix
updates see q_proj ... up_proj as before.

Only plain `nn.Linear` projections are fused: a LoRA wrapper adds its own low-rank path per projection, and a
float8 layer (torchao's Float8Linear, hopperlm's Float8NativeLinear: subclasses of nn.Linear) runs its own
matmul, so neither may be bypassed by reading `.weight`. The types are checked here, once, not every forward;
apply_speedups calls this after float8 has converted (or been undone) and before checkpointing and compile.
"""

from __future__ import annotations

import torch.nn as nn

from hopperlm.model.transformer import Attention, SwiGLU

ALL_FUSED = "fused projections: q/k/v and gate/up as one GEMM each in every block"


def fusable(layers: tuple[nn.Module, ...]) -> str | None:
    """None when `layers` can run as one GEMM, else why not (one phrase)."""
    for layer in layers:
        if type(layer) is not nn.Linear:  # exact type: float8's classes subclass nn.Linear
            return f"{type(layer).__name__}, not nn.Linear"
    if len({layer.bias is None for layer in layers}) > 1:
        return "some have a bias and some do not"
    if len({(layer.weight.dtype, layer.weight.device) for layer in layers}) > 1:
        return "their weights differ in dtype or device"
    return None


def apply_fused_projections(model: nn.Module) -> str:
    """Turn on the fused q/k/v and gate/up GEMMs wherever the projections are plain nn.Linear layers (and
    off elsewhere); returns the one line saying where: ALL_FUSED, or which groups stay separate and why."""
    fused, total, why_not = 0, 0, []
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            group = (module.q_proj, module.k_proj, module.v_proj)
        elif isinstance(module, SwiGLU):
            group = (module.gate_proj, module.up_proj)
        else:
            continue
        reason = fusable(group)
        on = reason is None
        if isinstance(module, Attention):
            module.fused_qkv = on
        else:
            module.fused_gate_up = on
        total += 1
        fused += on
        if not on:
            why_not.append(f"{name} ({reason})")
    if fused == total:
        return ALL_FUSED
    kept = f"{why_not[0]}" + (f" and {len(why_not) - 1} more" if len(why_not) > 1 else "")
    return f"fused projections: {fused} of {total} groups fused; kept separate: {kept}"
