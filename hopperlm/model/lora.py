"""LoRA: low-rank adapters around the frozen linear layers of an existing model (composition, not subclasses).

`apply_lora(model, cfg)` freezes every parameter and replaces the chosen projections of each block by a
`LoRALinear` that holds the original layer as `base` (an nn.Linear, or bitsandbytes' 4-bit layer for QLoRA)
and adds  scale * B(A(dropout(x)))  with A (r x in) Kaiming-uniform and B (out x r) zero, so the model's
outputs are unchanged until B learns. scale = alpha / r, or alpha / sqrt(r) with rsLoRA. The transformer's own
forward, fused loss, activation checkpointing and torch.compile work on the wrapped model as they are; apply
LoRA before `apply_speedups` (float8 converts only trainable layers, so the frozen base is left alone).

Names follow PEFT (`q_proj.lora_A.weight`, `q_proj.lora_B.weight`), so the PEFT export is a renaming
(interop/peft.py). Checkpoints of a LoRA run hold the adapters only; the base comes from model.init_from
(interop/tensors.py folds them into it on the way out).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn as nn

from hopperlm.config import LoRAConfig, ModelConfig
from hopperlm.config.finetune import TARGETS
from hopperlm.errors import CheckpointError, ConfigError
from hopperlm.model.transformer import count_params, flops_per_token


def scale_of(cfg: LoRAConfig) -> float:
    return cfg.alpha / (math.sqrt(cfg.rank) if cfg.rslora else cfg.rank)


def target_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) features of each target projection."""
    d, q, kv, h = (
        model_cfg.dim,
        model_cfg.n_heads * model_cfg.head_dim,
        model_cfg.kv_heads * model_cfg.head_dim,
        model_cfg.hidden_dim,
    )
    return {
        "q": (q, d),
        "k": (kv, d),
        "v": (kv, d),
        "o": (d, q),
        "gate": (h, d),
        "up": (h, d),
        "down": (d, h),
    }


def adapted_targets(model_cfg: ModelConfig, cfg: LoRAConfig) -> list[str]:
    """lora.targets that this model has: a ReLU² MLP (model.mlp relu2) has no gate projection, so every
    projection (all-linear, or the seven listed: the default) adapts the other six; naming `gate` among fewer is
    an error."""
    if model_cfg.mlp != "relu2" or "gate" not in cfg.target_list:
        return cfg.target_list
    if set(cfg.target_list) != set(TARGETS):
        raise ConfigError(
            "lora.targets names gate, which a ReLU² MLP (model.mlp relu2) does not have; drop it, or use "
            "all-linear"
        )
    return [t for t in cfg.target_list if t != "gate"]


def count_trainable(model_cfg: ModelConfig, cfg: LoRAConfig) -> int:
    """Exact number of adapter parameters: r * (in + out) per adapted projection per block."""
    shapes = target_shapes(model_cfg)
    per_block = sum(cfg.rank * (shapes[t][0] + shapes[t][1]) for t in adapted_targets(model_cfg, cfg))
    return model_cfg.n_layers * per_block


def training_flops_per_token(model_cfg: ModelConfig, seq_len: int, cfg: LoRAConfig) -> int:
    """FLOPs per trained token. Without LoRA: 6N + 12*L*d*T (transformer.flops_per_token). With LoRA the
    frozen matrices (the LM head too) skip their weight gradient: 4 FLOPs per parameter instead of 6, the
    adapters 6; the attention term is unchanged (its input gradients are still needed)."""
    if not cfg.enabled:
        return flops_per_token(model_cfg, seq_len)
    counts = count_params(model_cfg)
    frozen = counts["non_embedding"] + (counts["embedding"] if model_cfg.tie_embeddings else 0)
    return (
        4 * frozen + 6 * count_trainable(model_cfg, cfg) + 12 * model_cfg.n_layers * model_cfg.dim * seq_len
    )


def target_module_names(model_cfg: ModelConfig, cfg: LoRAConfig) -> list[str]:
    """Full module names of the adapted projections, e.g. layers.0.attn.q_proj."""
    paths = [TARGETS[t] for t in adapted_targets(model_cfg, cfg)]
    return [f"layers.{i}.{p}" for i in range(model_cfg.n_layers) for p in paths]


class LoRALinear(nn.Module):
    """base(x) + scale * lora_B(lora_A(dropout(x))), with `base` frozen."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0, rslora: bool = False):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank = rank
        self.scale = alpha / (math.sqrt(rank) if rslora else rank)
        device = next(base.parameters()).device
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=device)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=device)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_adapter()

    @torch.no_grad()
    def reset_adapter(self) -> None:
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's (and nn.Linear's) default
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            # one 16-bit copy of x, saved once for the backward of both the base and the adapter
            x = x.to(torch.get_autocast_dtype(device_type))
        return self.base(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scale

    @torch.no_grad()
    def delta(self) -> torch.Tensor:
        """scale * B @ A in fp32: what merging adds to the base weight."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scale


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return model.get_submodule(path), attr


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> int:
    """Freeze the model and wrap the target projections of every block; returns how many were wrapped. The
    adapters are fp32 on the base's device (autocast computes them in 16-bit); model.lora records `cfg`."""
    for p in model.parameters():
        p.requires_grad_(False)
    names = target_module_names(model.cfg, cfg)
    for name in names:
        parent, attr = _parent(model, name)
        base = getattr(parent, attr)
        if isinstance(base, LoRALinear):
            raise ConfigError(f"{name} already has a LoRA adapter; merge it first (hopperlm merge)")
        setattr(parent, attr, LoRALinear(base, cfg.rank, cfg.alpha, cfg.dropout, cfg.rslora))
    model.lora = cfg
    return len(names)


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield name, module


def has_lora(model: nn.Module) -> bool:
    """A model apply_lora wrapped (and merge_lora has not folded back)."""
    return getattr(model, "lora", None) is not None


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The adapters' tensors by name (e.g. layers.0.attn.q_proj.lora_A.weight), or None without LoRA."""
    if not has_lora(model):
        return None
    out = {}
    for name, module in lora_modules(model):
        out[f"{name}.lora_A.weight"] = module.lora_A.weight.detach()
        out[f"{name}.lora_B.weight"] = module.lora_B.weight.detach()
    return out


@torch.no_grad()
def load_adapter_state(model: nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Copy adapters into a LoRA model; every adapter must be present with its shape, nothing else."""
    expected = adapter_state(model)
    if expected is None:
        raise CheckpointError(f"{where} holds LoRA adapters but the model has none; set the lora section")
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{where} does not match the model's adapters (missing {missing[:2]}, unexpected {unexpected[:2]}); "
            "the lora section must equal the run's"
        )
    for name, tensor in tensors.items():
        if tensor.shape != expected[name].shape:
            raise CheckpointError(
                f"{where}: {name} has shape {tuple(tensor.shape)}, the model's is {tuple(expected[name].shape)}"
            )
        expected[name].copy_(tensor)


@torch.no_grad()
def merge_lora(model: nn.Module) -> int:
    """Fold every adapter into its base weight (W + scale * B @ A) and put the plain nn.Linear back, so the
    model is the base architecture again; returns how many were merged."""
    merged = 0
    for name, module in list(lora_modules(model)):
        base = module.base
        if not isinstance(base, nn.Linear):
            raise ConfigError(
                f"{name}: cannot merge into a {type(base).__name__} base; load the base unquantized"
            )
        base.weight.copy_((base.weight.float() + module.delta().to(base.weight.device)).to(base.weight.dtype))
        parent, attr = _parent(model, name)
        setattr(parent, attr, base)
        merged += 1
    model.lora = None
    return merged
