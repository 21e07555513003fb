"""QLoRA's frozen base: linear layers in 4-bit NormalFloat with double quantisation, through bitsandbytes.

NF4 (Dettmers et al. 2023) stores each weight in 4 bits against a per-64-block absmax scale; double
quantisation stores those scales in 8 bits too (about 0.127 extra bits per weight). The matmul dequantises
to the compute dtype (bf16) on the fly. bitsandbytes is optional: imported only here, on first use, with a
message naming the package when it is missing. The training path needs CUDA (the plan refuses nf4 on a CPU);
bitsandbytes' own CPU backend is enough for the unit tests of this module.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from hopperlm.errors import ConfigError

BLOCK_SIZE = 64  # NF4 quantisation block (bitsandbytes' default)


def require_bitsandbytes():
    try:
        import bitsandbytes
    except ImportError:
        raise ConfigError(
            "lora.quantize=nf4 (QLoRA) and optim.name=paged_adamw8bit need bitsandbytes: pip install bitsandbytes"
        ) from None
    return bitsandbytes


def nf4_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    device: torch.device,
    compute_dtype: torch.dtype,
    storage: torch.dtype = torch.uint8,
) -> nn.Module:
    """A frozen bitsandbytes Linear4bit holding `weight` (out, in) in NF4 with double quantisation; the
    quantisation happens when the weight reaches `device`, one layer at a time.

    `storage`: the dtype the packed 4-bit data is stored as (the same bytes either way). Under FSDP2 it must
    be the dtype FSDP gathers parameters in (the compute dtype): the packed data then goes through the
    mixed-precision cast untouched, and all of a block's parameters gather in one dtype. FSDP2 replaces the
    parameter with its gathered copy, which loses bitsandbytes' quantisation state; the layer keeps a copy
    (`module=`) that bitsandbytes' forward puts back."""
    bnb = require_bitsandbytes()
    out_features, in_features = weight.shape
    with torch.device("meta"):  # no full-precision allocation of the layer's own: the weight comes next
        layer = bnb.nn.Linear4bit(
            in_features,
            out_features,
            bias=bias is not None,
            compute_dtype=compute_dtype,
            quant_type="nf4",
            compress_statistics=True,
            quant_storage=storage,
        )
    layer.weight = bnb.nn.Params4bit(
        weight.detach().to(torch.bfloat16).cpu(),
        requires_grad=False,
        quant_type="nf4",
        compress_statistics=True,
        blocksize=BLOCK_SIZE,
        quant_storage=storage,
        module=layer,
    )
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().float().cpu(), requires_grad=False)
    return layer.to(device)


def is_quantized(module: nn.Module) -> bool:
    return type(module).__name__ == "Linear4bit"


def dequantized_weight(layer: nn.Module) -> torch.Tensor:
    """The weight a Linear4bit computes with, in its compute dtype (for tests and merging)."""
    bnb = require_bitsandbytes()
    return bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)


def nf4_bytes(n_params: int) -> float:
    """Bytes of n weights in NF4 with double quantisation: 4 bits each, an 8-bit scale per block of 64, and
    the second-level fp32 scales per 256 blocks."""
    blocks = n_params / BLOCK_SIZE
    return n_params / 2 + blocks + 4 * blocks / 256
