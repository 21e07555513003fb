"""Whether float8 pays for a model, decided from its config before any module is built: torchao's H100
thresholds per linear shape, the share of the blocks' linear FLOPs that would convert, and whether torchao is
installed. The plan (plan/choices.py) chooses fp8 with these; speed/float8.py converts the same layers.
"""

from __future__ import annotations

import importlib.util
from typing import get_args

from hopperlm.config import ModelConfig
from hopperlm.plan.record import Float8

BACKENDS = tuple(b for b in get_args(Float8) if b != "off")  # ("tensorwise", "rowwise", "native")
PAYOFF_SHARE = 0.5  # fp8 is chosen automatically only when at least this share of linear FLOPs converts


def pays_off(out_features: int, in_features: int, recipe: str = "tensorwise") -> bool:
    """Whether a (out x in) linear layer gains from float8 on Hopper: torchao's published H100 thresholds."""
    if out_features % 16 or in_features % 16:
        return False  # the fp8 tensor-core matmul needs every dimension divisible by 16
    n, k = out_features, in_features
    if recipe == "rowwise":
        return n > 2048 and k > 1024 and not (n <= 4096 and k <= 2048)
    return not (k <= 4096 and n <= 1024)


def converted_share(model_cfg: ModelConfig, recipe: str = "tensorwise") -> float:
    """Share of the blocks' linear FLOPs in layers that float8 would convert, from the config alone."""
    d, kv, h = model_cfg.dim, model_cfg.kv_heads * model_cfg.head_dim, model_cfg.hidden_dim
    q = model_cfg.n_heads * model_cfg.head_dim
    shapes = [(q, d), (kv, d), (kv, d), (d, q), (h, d), (h, d), (d, h)]  # (out, in) per block
    total = sum(n * k for n, k in shapes)
    return sum(n * k for n, k in shapes if pays_off(n, k, recipe)) / total


def torchao_available() -> bool:
    return importlib.util.find_spec("torchao") is not None
