"""float8 training for the linear layers: torchao's recipes, or a native path on `torch._scaled_mm`.

Backends (plan.fp8):
  tensorwise  torchao `convert_to_float8_training`, one dynamic scale per tensor (the fastest torchao recipe:
              +25% on Llama-3-8B in torchao's own numbers)
  rowwise     torchao, one scale per row: more accurate, less speed-up
  native      hopperlm's own Float8Linear: dynamic tensorwise scaling, e4m3 activations and weights, e5m2
              gradients, `torch._scaled_mm` for the three matmuls of each layer (no torchao needed)
Which layers: only those where float8 pays (dims multiples of 16, which the tensor cores require, and large
enough that the casts cost less than the faster matmul saves: the thresholds of torchao's H100 tables) and
never the LM head, whose logits feed the softmax. Everything here needs `torch.compile` to be fast (without
it the casts run as separate kernels: torchao#685), and tokens per micro-batch divisible by 16.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from hopperlm.plan.float8_payoff import BACKENDS, pays_off
from hopperlm.plan.record import Float8


def convertible(
    model: nn.Module, recipe: str = "tensorwise", only_if_pays: bool = True
) -> Iterator[tuple[str, nn.Linear]]:
    """The linear layers of the blocks that float8 would convert (never the LM head). only_if_pays=False
    keeps every layer whose dims are multiples of 16 (tests use it on small models). Layers with a bias
    (Qwen2's q/k/v) and frozen layers (a LoRA base: float8 training is for weights that learn) stay as they
    are."""
    for name, module in model.named_modules():
        if not (isinstance(module, nn.Linear) and name.startswith("layers.")):
            continue
        if module.bias is not None or not module.weight.requires_grad:
            continue
        out_features, in_features = module.weight.shape
        if pays_off(out_features, in_features, recipe) or (
            not only_if_pays and out_features % 16 == 0 and in_features % 16 == 0
        ):
            yield name, module


# ---- the native backend --------------------------------------------------------------------------------
def _cast(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(t scaled into dtype's range and cast, the inverse scale _scaled_mm multiplies back)."""
    fmax = torch.finfo(dtype).max
    amax = t.detach().abs().max().float().clamp(min=1e-12)
    scale = fmax / amax
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype), scale.reciprocal()


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column-major, as _scaled_mm wants its second operand."""
    return t.t().contiguous().t()


class _Float8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, out_dtype):
        # x (M, K), weight (N, K) -> (M, N); e4m3 for the forward operands
        xq, x_inv = _cast(x, torch.float8_e4m3fn)
        wq, w_inv = _cast(weight, torch.float8_e4m3fn)
        ctx.save_for_backward(xq, x_inv, wq, w_inv)  # the fp8 copies: a quarter of fp32's bytes
        ctx.weight_dtype = weight.dtype
        return torch._scaled_mm(xq, wq.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, grad):
        xq, x_inv, wq, w_inv = ctx.saved_tensors
        gq, g_inv = _cast(grad, torch.float8_e5m2)  # gradients need range more than precision: e5m2
        grad_x = torch._scaled_mm(gq, _col_major(wq), scale_a=g_inv, scale_b=w_inv, out_dtype=grad.dtype)
        grad_w = torch._scaled_mm(
            gq.t().contiguous(), _col_major(xq), scale_a=g_inv, scale_b=x_inv, out_dtype=torch.float32
        )
        return grad_x, grad_w.to(ctx.weight_dtype), None


class Float8NativeLinear(nn.Linear):
    """nn.Linear whose matmuls run in float8 through torch._scaled_mm (bias-free layers only, as in our
    model). Parameters and state-dict keys are those of nn.Linear: checkpoints do not change."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        out_dtype = (
            torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        )
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] % 16:  # e.g. decoding one token: the fp8 matmul needs M divisible by 16
            return F.linear(x.to(out_dtype), self.weight.to(out_dtype))
        with torch.autocast(device_type, enabled=False):
            out = _Float8Matmul.apply(x2, self.weight, out_dtype)
        return out.reshape(*x.shape[:-1], out.shape[-1])


# ---- applying it ---------------------------------------------------------------------------------------
def apply_fp8(
    model: nn.Module, backend: Float8, only_if_pays: bool = True, fsdp_float8_all_gather: bool = False
) -> int:
    """Convert the block linears that pay off to float8 with `backend`; returns how many were converted.
    `fsdp_float8_all_gather` (torchao tensorwise, before FSDP2 shards the model): FSDP all-gathers these
    weights already cast to float8. Raises (ImportError, RuntimeError, ...) when the backend cannot run: the
    caller falls back to bf16."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown fp8 backend {backend!r}; one of {BACKENDS}")
    recipe = "rowwise" if backend == "rowwise" else "tensorwise"
    targets = dict(convertible(model, recipe, only_if_pays))
    if backend == "native":
        for module in targets.values():
            module.__class__ = Float8NativeLinear
        return len(targets)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ImportError(f"fp8 {backend} needs torchao (pip install torchao)") from None
    if not targets:
        return 0
    config = Float8LinearConfig.from_recipe_name(backend)
    if fsdp_float8_all_gather:
        import dataclasses

        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: fqn in targets)
    return len(targets)
