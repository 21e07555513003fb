"""LoRA: low-rank adapters around the frozen linear layers of an existing model (composition, not subclasses).

`apply_lora(model, cfg)` freezes every parameter and replaces the chosen projections of each block by a
`LoRALinear` that holds the original layer as `base` (an nn.Linear, or bitsandbytes' 4-bit layer for QLoRA)
and adds  scale * B(A(dropout(x)))  with A (r x in) Kaiming-uniform and B (out x r) zero, so the model's
outputs are unchanged until B learns. scale = alpha / r, or alpha / sqrt(r) with rsLoRA. The transformer's own
forward, fused loss, activation checkpointing and torch.compile work on the wrapped model as they are; apply
LoRA before `apply_speedups` (float8 converts only trainable layers, so the frozen base is left alone).

Names follow PEFT (`q_proj.lora_A.weight`, `q_proj.lora_B.weight`), so the PEFT export is a renaming.
Checkpoints of a LoRA run hold the adapters only; the base comes from model.init_from.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn as nn

from hopperlm.config import LoRAConfig, ModelConfig
from hopperlm.errors import CheckpointError, ConfigError

# short name -> the module path inside a block
TARGETS = {
    "q": "attn.q_proj",
    "k": "attn.k_proj",
    "v": "attn.v_proj",
    "o": "attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
PEFT_PREFIX = "base_model.model."
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def parse_targets(text: str) -> list[str]:
    """'q,k,v' -> ['q', 'k', 'v']; 'all-linear' -> all seven. ConfigError naming unknown entries."""
    if text.strip() == "all-linear":
        return list(TARGETS)
    names = [t.strip() for t in text.split(",") if t.strip()]
    names = [n.removesuffix("_proj") for n in names]  # accept PEFT's q_proj spelling too
    unknown = [n for n in names if n not in TARGETS]
    if unknown or not names:
        raise ConfigError(
            f"lora.targets={text!r}: {'unknown ' + ', '.join(unknown) if unknown else 'empty'}; "
            f"use a comma-separated subset of {','.join(TARGETS)} or all-linear"
        )
    return list(dict.fromkeys(names))


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


def count_trainable(model_cfg: ModelConfig, cfg: LoRAConfig) -> int:
    """Exact number of adapter parameters: r * (in + out) per adapted projection per block."""
    shapes = target_shapes(model_cfg)
    per_block = sum(cfg.rank * (shapes[t][0] + shapes[t][1]) for t in parse_targets(cfg.targets))
    return model_cfg.n_layers * per_block


def training_flops_per_token(model_cfg: ModelConfig, seq_len: int, cfg: LoRAConfig) -> int:
    """FLOPs per trained token. Without LoRA: 6N + 12*L*d*T (transformer.flops_per_token). With LoRA the
    frozen matrices (the LM head too) skip their weight gradient: 4 FLOPs per parameter instead of 6, the
    adapters 6; the attention term is unchanged (its input gradients are still needed)."""
    from hopperlm.model.transformer import count_params, flops_per_token

    if not cfg.enabled:
        return flops_per_token(model_cfg, seq_len)
    counts = count_params(model_cfg)
    frozen = counts["non_embedding"] + (counts["embedding"] if model_cfg.tie_embeddings else 0)
    return (
        4 * frozen + 6 * count_trainable(model_cfg, cfg) + 12 * model_cfg.n_layers * model_cfg.dim * seq_len
    )


def target_module_names(model_cfg: ModelConfig, cfg: LoRAConfig) -> list[str]:
    """Full module names of the adapted projections, e.g. layers.0.attn.q_proj."""
    paths = [TARGETS[t] for t in parse_targets(cfg.targets)]
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


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The adapters' tensors by name (e.g. layers.0.attn.q_proj.lora_A.weight), or None without LoRA."""
    if getattr(model, "lora", None) is None:
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


def merged_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a LoRA checkpoint's model with its adapters folded in, streamed from its base
    (model.init_from) one tensor at a time: what `merge` and `export` write."""
    from safetensors.torch import load_file

    from hopperlm.model.hf_convert import iter_model_tensors
    from hopperlm.train import checkpoint as ckpt_io

    model_cfg, lora_cfg = ckpt_io.read_model_config(model_dir), ckpt_io.read_lora_config(model_dir)
    if lora_cfg is None or not model_cfg.init_from:
        raise CheckpointError(f"{model_dir} holds adapters without a lora config and a model.init_from base")
    ckpt_io.check_base(model_dir)
    adapters = load_file(str(model_dir / ckpt_io.ADAPTER_FILE))
    scale = scale_of(lora_cfg)
    for name, tensor in iter_model_tensors(model_cfg.init_from):
        module = name.removesuffix(".weight")
        a = adapters.get(f"{module}.lora_A.weight")
        if a is not None:
            b = adapters[f"{module}.lora_B.weight"]
            tensor = (tensor.float() + (b.float() @ a.float()) * scale).to(tensor.dtype)
        yield name, tensor


# ---- PEFT format -------------------------------------------------------------------------------------------
def peft_config(lora_cfg: LoRAConfig, base_path: str | None) -> dict:
    from hopperlm.model.hf_convert import to_hf_name

    modules = sorted(
        {to_hf_name(f"layers.0.{TARGETS[t]}.weight").split(".")[-2] for t in parse_targets(lora_cfg.targets)}
    )
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_path,
        "r": lora_cfg.rank,
        "lora_alpha": lora_cfg.alpha,
        "lora_dropout": lora_cfg.dropout,
        "target_modules": modules,
        "use_rslora": lora_cfg.rslora,
        "use_dora": False,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def export_peft(source: Path, out_dir: Path, overwrite: bool = False) -> Path:
    """A LoRA run/checkpoint -> adapter_config.json + adapter_model.safetensors with PEFT's key names, which
    `peft.PeftModel.from_pretrained(hf_base_model, out_dir)` loads."""
    from safetensors.torch import load_file, save_file

    from hopperlm.model.hf_convert import staged_dir, to_hf_name
    from hopperlm.train import checkpoint as ckpt_io

    model_dir = ckpt_io.resolve_model_dir(source)
    lora_cfg = ckpt_io.read_lora_config(model_dir)
    if lora_cfg is None:
        raise CheckpointError(f"{model_dir} is not a LoRA checkpoint (no adapters); export it without --peft")
    model_cfg = ckpt_io.read_model_config(model_dir)
    tensors = {}
    for name, t in load_file(str(model_dir / ckpt_io.ADAPTER_FILE)).items():
        module, _, kind = name.partition(".lora_")  # layers.0.attn.q_proj / A.weight
        tensors[PEFT_PREFIX + to_hf_name(module + ".weight").removesuffix(".weight") + ".lora_" + kind] = t
    with staged_dir(out_dir, overwrite) as tmp:
        save_file(tensors, str(tmp / PEFT_WEIGHTS), metadata={"format": "pt"})
        (tmp / PEFT_CONFIG).write_text(
            json.dumps(peft_config(lora_cfg, model_cfg.init_from), indent=2) + "\n"
        )
    return Path(out_dir)


def read_peft(adapter_dir: Path) -> tuple[LoRAConfig, dict[str, torch.Tensor]]:
    """A PEFT LoRA adapter folder -> (LoRAConfig, adapter tensors under hopperlm's names). Refuses what
    hopperlm's LoRA cannot express (DoRA, per-layer ranks, bias training, other modules)."""
    from safetensors.torch import load_file

    from hopperlm.model.hf_convert import from_hf_name

    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / PEFT_CONFIG).is_file() or not (adapter_dir / PEFT_WEIGHTS).is_file():
        raise CheckpointError(f"{adapter_dir} is not a PEFT adapter folder ({PEFT_CONFIG} + {PEFT_WEIGHTS})")
    raw = json.loads((adapter_dir / PEFT_CONFIG).read_text())
    problems = [
        why
        for bad, why in (
            (raw.get("peft_type") != "LORA", f"peft_type {raw.get('peft_type')}"),
            (raw.get("use_dora"), "DoRA"),
            (raw.get("bias", "none") != "none", f"bias={raw.get('bias')}"),
            (raw.get("rank_pattern") or raw.get("alpha_pattern"), "per-module ranks"),
            (raw.get("modules_to_save"), "modules_to_save"),
        )
        if bad
    ]
    if problems:
        raise ConfigError(f"{adapter_dir}: {', '.join(problems)} not supported by hopperlm's LoRA")
    modules = raw["target_modules"]
    modules = [modules] if isinstance(modules, str) else modules
    cfg = LoRAConfig(
        rank=int(raw["r"]),
        alpha=float(raw["lora_alpha"]),
        dropout=float(raw.get("lora_dropout", 0.0)),
        targets=",".join(m.removesuffix("_proj") for m in modules)
        if modules != "all-linear"
        else "all-linear",
        rslora=bool(raw.get("use_rslora", False)),
    )
    tensors = {}
    for name, t in load_file(str(adapter_dir / PEFT_WEIGHTS)).items():
        module, _, kind = name.removeprefix(PEFT_PREFIX).partition(".lora_")
        kind = kind.replace(".default.", ".")  # PEFT in memory names the adapter; saved files do not
        tensors[from_hf_name(module + ".weight").removesuffix(".weight") + ".lora_" + kind] = t
    return cfg, tensors
