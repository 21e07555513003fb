"""torch.compile of the model, in place (module names and checkpoints unchanged).

Scopes (plan.compile_scope):
  block  each transformer block is compiled on its own, and the final norm + LM head + loss as one more
         region (torchtitan's way): the blocks share one compiled graph, so compile time does not grow with
         depth, and inductor still fuses RMSNorm, RoPE, SwiGLU and the cross-entropy
  model  the whole forward as one graph: also fuses across block boundaries, compile time grows with depth
Where the residual add meets the next RMSNorm (a block is x += attn(attn_norm(x)); x += mlp(mlp_norm(x))):
  block  inside a block, inductor fuses the attention's residual add with mlp_norm (one kernel reads x and
         the attention output, writes the new x and the normalised input of the MLP); the MLP's add ends the
         block's graph as a kernel of its own, and the next block's attn_norm reads x back in another graph:
         one extra write and read of the fp32 residual stream per block boundary (on CPU, torch 2.13, a
         compiled Block's forward has `..._add_mean_mul_pow_rsqrt` and a lone `..._add` kernel)
  model  one graph: the MLP's add fuses with the next block's attn_norm too (and the last with the final norm)
The bench's compile_scope rows measure the difference; the blocks are not restructured for it.
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
