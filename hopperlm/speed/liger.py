"""Liger-Kernel's Triton kernels in place of the compiler's fusion (train.kernels liger): a bench row to measure.

`apply_liger(model)` swaps four things through the seams of model/transformer.py, never touching a weight or a
state-dict key:
  RMSNorm        every nn.RMSNorm becomes `LigerNorm` (same module, same weight) calling LigerRMSNormFunction
                 with Llama's casting (only the inverse RMS in fp32, as HF's LlamaRMSNorm)
  SwiGLU         `SwiGLU.act` = LigerSiLUMulFunction (silu(gate) * up in one kernel, forward and backward)
  RoPE           `Attention.rope` = liger_rotary_pos_emb, which takes q/k (B, H, T, hd) and cos/sin in HF's
                 (1 or B, T, hd) layout; q/k arrive (B, T, H, hd), so it gets their transposed views (the
                 physical layout its kernel reads) and rotates them in place
  the loss       `Transformer.head_loss` = LigerFusedLinearCrossEntropyLoss (the LM head, softmax and loss in
                 chunks, as model/loss.py's chunked loss does in plain PyTorch)
liger-kernel is not a dependency (it needs Triton and CUDA); the plan chooses liger only where it imports and
the device is CUDA (plan/choices.py choose_kernels), and this module falls back with one line where it does
not import. The kernels' numerics are checked against the compiler path on a GPU (tests/test_fused_kernels.py,
marked gpu); on a CPU the wiring is checked with plain-torch stand-ins.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from hopperlm.errors import first_line
from hopperlm.model.loss import IGNORE_INDEX
from hopperlm.model.transformer import Attention, SwiGLU

INSTALL = "pip install liger-kernel"


class LigerNorm(nn.RMSNorm):
    """nn.RMSNorm computed by Liger's kernel: the same parameter and state-dict key (a class swap, as float8's)."""

    liger_function: type  # LigerRMSNormFunction, set per module by apply_liger

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        # in_place=False: Liger's in-place backward overwrites dY, which is wrong wherever dY is used again
        # (its own docstring names the case); the few MB it saves are not what this row measures
        return self.liger_function.apply(x, self.weight, eps, 0.0, "llama", False)


def liger_rope(rotary: Callable) -> Callable:
    """Attention.rope (q (B, T, nh, hd), k (B, T, nkv, hd), cos/sin (T, hd) or (B, T, hd)) through Liger's
    liger_rotary_pos_emb. The fp32 tables are passed as they are (the compiler path rotates in fp32 too)."""

    def rope(q, k, cos, sin):
        if cos.dim() == 2:  # one table for every row: HF's (1, T, hd)
            cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
        q, k = rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # (B, H, T, hd) views
        return q.transpose(1, 2), k.transpose(1, 2)

    return rope


def liger_head_loss(loss_module: nn.Module) -> Callable:
    """Transformer.head_loss through LigerFusedLinearCrossEntropyLoss, whose forward takes (weight, hidden
    (N, d), targets (N,)). Under autocast both matmul operands are cast to the autocast dtype first, as
    model/loss.py's chunked loss computes them; the softmax runs in fp32 inside Liger's kernel."""

    def head_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        device_type = h.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            h, weight = h.to(dtype), weight.to(dtype)
        return loss_module(weight, h.reshape(-1, h.shape[-1]), targets.reshape(-1))

    return head_loss


def apply_liger(model: nn.Module) -> str:
    """Swap Liger's RMSNorm, SiLU-mul, RoPE and fused linear cross-entropy into `model` (in place); returns the
    one line saying what was done, or, when liger-kernel does not import, that nothing was."""
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except ImportError as e:
        return f"kernels: compiler fusion (liger-kernel not installed: {INSTALL}; {first_line(e)})"
    norms = 0
    for module in model.modules():
        if isinstance(module, nn.RMSNorm):
            module.__class__ = LigerNorm
            module.liger_function = LigerRMSNormFunction
            norms += 1
        elif isinstance(module, Attention):
            module.rope = liger_rope(liger_rotary_pos_emb)
        elif isinstance(module, SwiGLU):
            module.act = LigerSiLUMulFunction.apply
    # model.logit_softcap: Liger's loss takes the same cap (asked for only where it is set)
    softcap = getattr(getattr(model, "cfg", None), "logit_softcap", None)
    capped = {"softcap": softcap} if softcap is not None else {}
    model.head_loss = liger_head_loss(LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, **capped))
    return (
        f"kernels: Liger-Kernel's RMSNorm ({norms} norms), SiLU-mul, RoPE and fused linear cross-entropy "
        "(train.kernels liger)"
    )
