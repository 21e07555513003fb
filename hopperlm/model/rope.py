"""RoPE frequency scaling of long-context checkpoints, as Hugging Face configs describe it.

Two kinds are supported, each a pure function of the base inverse frequencies (the formulas of the papers and
of transformers' modeling_rope_utils, written here so no transformers is needed at run time):
  linear  every frequency divided by `factor` (position interpolation, Chen et al. 2023)
  llama3  Llama-3.1's: frequencies whose wavelength exceeds original_max_position_embeddings / low_freq_factor
          are divided by `factor`, those shorter than .../high_freq_factor are kept, and those in between
          are blended smoothly
Other kinds (dynamic NTK, YaRN, LongRoPE) change attention at run time or per length; they are refused
(config/model.py's check_rope_scaling checks a model section's scaling when the config is read).
"""

from __future__ import annotations

import math

import torch

from hopperlm.config.model import LINEAR_KEYS


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
