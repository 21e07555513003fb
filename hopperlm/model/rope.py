"""RoPE frequency scaling of long-context checkpoints, as Hugging Face configs describe it.

Two kinds are supported, each a pure function of the base inverse frequencies (the formulas of the papers and
of transformers' modeling_rope_utils, written here so no transformers is needed at run time):
  linear  every frequency divided by `factor` (position interpolation, Chen et al. 2023)
  llama3  Llama-3.1's: frequencies whose wavelength exceeds original_max_position_embeddings / low_freq_factor
          are divided by `factor`, those shorter than .../high_freq_factor are kept, and those in between
          are blended smoothly
Other kinds (dynamic NTK, YaRN, LongRoPE) change attention at run time or per length; they are refused.
"""

from __future__ import annotations

import math

import torch

from hopperlm.errors import ConfigError

LINEAR_KEYS = {"factor"}
LLAMA3_KEYS = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}


def check_rope_scaling(scaling: dict[str, float], where: str) -> None:
    """ConfigError unless `scaling` holds exactly the keys of one supported kind, with sane values."""
    keys = set(scaling)
    if keys not in (LINEAR_KEYS, LLAMA3_KEYS):
        raise ConfigError(
            f"{where} has keys {sorted(keys)}; expected {{factor}} (linear) or {sorted(LLAMA3_KEYS)} (llama3)"
        )
    if scaling["factor"] <= 0:
        raise ConfigError(f"{where}.factor={scaling['factor']} must be positive")
    if keys == LLAMA3_KEYS and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ConfigError(f"{where}: high_freq_factor must exceed low_freq_factor")


def scale_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, float] | None) -> torch.Tensor:
    """The inverse frequencies after `scaling` (None: unchanged)."""
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if set(scaling) == LINEAR_KEYS:
        return inv_freq / factor
    old_len = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)
