"""torch.compile of the model, in place (module names and checkpoints unchanged).

Scopes (plan.compile_scope):
  block  each transformer block is compiled on its own, and the final norm + LM head + loss as one more
         region (torchtitan's way): the blocks share one compiled graph, so compile time does not grow with
         depth, and inductor still fuses RMSNorm, RoPE, SwiGLU and the cross-entropy
  model  the whole forward as one graph: also fuses across block boundaries, compile time grows with depth
Mode "reduce-overhead" adds CUDA graphs (for static shapes, and only with one micro-batch per step: a graph
owns the gradients it writes, plan/make.py): train_step then marks each step's start.
"""

from __future__ import annotations

import torch

from hopperlm.plan.record import CompileMode

SCOPES = ("block", "model")


def apply_compile(model: torch.nn.Module, mode: CompileMode | None, scope: str) -> None:
    if scope not in SCOPES:
        raise ValueError(f"unknown compile scope {scope!r}; one of {SCOPES}")
    mode = None if mode in (None, "default") else mode
    if scope == "model":
        model.compile(mode=mode)
        return
    for block in model.layers:
        block.compile(mode=mode)
    model.output_loss = torch.compile(model.output_loss, mode=mode)


def uses_cuda_graphs(mode: CompileMode | None) -> bool:
    return mode == "reduce-overhead"
