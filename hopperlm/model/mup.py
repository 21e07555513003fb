"""μP (the Maximal Update Parametrization, Yang et al. 2022, "Tensor Programs V"): the multipliers that make the
best learning rate of a narrow proxy the best learning rate of the wide model (model.parametrization: mup).

Each parameter is compared with its shape in the same model at model.base_dim (heads scaled to keep head_dim,
the SwiGLU width computed as at any width). A dimension that differs grows with width ("infinite"); following
Microsoft's `mup` package (its set_base_shapes, MuAdamW and init), a parameter with two such dimensions is
*matrix-like* (the blocks' projections) and gets, with m its fan-in's width multiplier (fan-in / base fan-in):
  init std x m^-1/2, AdamW learning rate / m, weight decay x m (so lr x weight decay stays the same);
everything else is *vector-like* (embeddings, the LM head, norms) and keeps init_std and optim.lr. The LM head's
output is multiplied by base_dim / dim (mup's MuReadout), so logits do not grow with width.

Muon on the blocks' matrices (optim.name muon), per muon.lr_adjust: match_rms_adamw scales each update to
AdamW's RMS, so it takes the same 1/m; spectral keeps each update's spectral norm as width grows (Yang, Simon and
Bernstein 2023's condition, torch's "original" adjustment) and takes no width factor. Both equal each other, and
standard, at base_dim. bench/transfer.py measures which transfers.
"""

from __future__ import annotations

import dataclasses
import math

import torch.nn as nn

from hopperlm.config import ModelConfig
from hopperlm.errors import ConfigError

MUON_RMS = 0.2  # torch's match_rms_adamw: Muon's update RMS is 0.2 * lr * ..., AdamW's about 0.2 * lr


def base_config(cfg: ModelConfig) -> ModelConfig:
    """The model at model.base_dim: the same depth, vocabulary and head size, fewer heads; a fixed ffn_dim scales
    with the width."""
    if not cfg.base_dim:
        raise ConfigError("model.parametrization mup needs model.base_dim (the proxy's width)")
    if cfg.base_dim % cfg.head_dim:
        raise ConfigError(
            f"model.base_dim={cfg.base_dim} is not a multiple of head_dim {cfg.head_dim}: μP grows the width by "
            "adding heads of the same size; pick a multiple"
        )
    scale = cfg.base_dim / cfg.dim
    heads = cfg.base_dim // cfg.head_dim
    kv = max(1, round(cfg.kv_heads * scale)) if cfg.n_kv_heads is not None else None
    ffn = None if cfg.ffn_dim is None else max(cfg.multiple_of, round(cfg.ffn_dim * scale))
    return dataclasses.replace(
        cfg, dim=cfg.base_dim, n_heads=heads, n_kv_heads=kv, ffn_dim=ffn, init_from=None
    )


def matrix_multipliers(wide: dict[str, tuple], base: dict[str, tuple]) -> dict[str, float]:
    """name -> the width multiplier m (fan-in / base fan-in) of each matrix-like parameter, given every
    parameter's shape in the model and at base_dim (transformer.py's parameter_shapes)."""
    out = {}
    for name, shape in wide.items():
        grown = [i for i, (a, b) in enumerate(zip(shape, base[name], strict=True)) if a != b]
        if len(grown) == 2:  # matrix-like: (fan_out, fan_in); mup's "main" dimension is the fan-in
            out[name] = shape[1] / base[name][1]
    return out


def output_multiplier(cfg: ModelConfig) -> float:
    """What the LM head's output is multiplied by: base_dim / dim under mup, 1 under standard."""
    return cfg.base_dim / cfg.dim if cfg.parametrization == "mup" else 1.0


def optimizer_multipliers(
    model: nn.Module,
    cfg: ModelConfig,
    shapes,
    *,
    muon_lr_adjust: str = "match_rms_adamw",
    muon_ids=frozenset(),
) -> dict[int, float]:
    """id(parameter) -> its learning-rate factor, for the parameters that have one; `shapes(cfg)`: every
    parameter's shape (transformer.py's parameter_shapes). AdamW's matrix-like parameters under mup: 1/m
    (MuAdamW). Muon's matrices (`muon_ids`): match_rms_adamw the same 1/m; spectral the factor that makes
    torch's "original" adjustment equal match_rms_adamw at base_dim (under standard, at the model's own width);
    original none (torch's rule as it is keeps the spectral norm of the update as width grows by itself).
    model/parametrization.py divides each group's weight decay by the same factor, so the decay per step,
    lr x weight decay, stays what optim.lr and optim.weight_decay say (MuAdamW does the same)."""
    mup = cfg.parametrization == "mup"
    base = shapes(base_config(cfg)) if mup else {}
    mults = matrix_multipliers(shapes(cfg), base) if mup else {}
    factors = {}
    for name, p in named_params(model):
        m = mults.get(name)
        if m is not None:
            factors[id(p)] = 1.0 / m
        if id(p) in muon_ids and muon_lr_adjust == "original":  # Muon's own LR, spectral by itself: no factor
            factors.pop(id(p), None)
        if id(p) in muon_ids and muon_lr_adjust == "spectral":
            fan_out, fan_in = base[name] if m is not None else tuple(p.shape)
            # torch's original: lr x max(1, sqrt(fan_out / fan_in)); match_rms_adamw: lr x 0.2 x sqrt(max side)
            factors[id(p)] = (
                MUON_RMS * math.sqrt(max(fan_out, fan_in)) / max(1.0, math.sqrt(fan_out / fan_in))
            )
    return factors


def named_params(model: nn.Module):
    """named_parameters() under hopperlm's own names: DDP's `module.`, torch.compile's `_orig_mod.` and
    activation checkpointing's wrapper prefixes taken off."""
    for name, p in model.named_parameters():
        for prefix in ("module.", "_orig_mod.", "_checkpoint_wrapped_module."):
            name = name.replace(prefix, "")
        yield name, p


def describe(cfg: ModelConfig) -> str:
    """The banner's line: which parametrization is in effect, and what it does at this width."""
    if cfg.parametrization != "mup":
        return "parametrization: standard (every matrix at init_std and optim.lr)"
    m = cfg.dim / cfg.base_dim
    return (
        f"parametrization: mup (base_dim {cfg.base_dim}, width x{m:g}): the blocks' matrices start at init x{m**-0.5:.2f} "
        f"and train at AdamW LR x{1 / m:.3g} (weight decay x{m:g}); LM head output x{1 / m:.3g}; embeddings, norms "
        "and the head at optim.lr"
    )
