"""LoRA adapters in PEFT's format: export a LoRA run's adapters, and read a PEFT adapter folder.

A PEFT folder is adapter_config.json + adapter_model.safetensors, with Hugging Face module names under
`base_model.model.` (`...q_proj.lora_A.weight`); hopperlm's adapters (model/lora.py) carry the same names
without the prefix, so both directions are a renaming. What hopperlm's LoRA cannot express (DoRA, per-layer
ranks, bias training, other modules) is refused, never approximated.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hopperlm.checkpoint.layout import (
    TOKENIZER_DIR,
    read_adapters,
    read_lora_config,
    read_model_config,
    resolve_model_dir,
)
from hopperlm.config import LoRAConfig
from hopperlm.config.finetune import TARGETS
from hopperlm.diskspace import staged_output
from hopperlm.errors import CheckpointError, ConfigError
from hopperlm.files import save_safetensors
from hopperlm.interop.hf_convert import fold_output_multiplier
from hopperlm.interop.hf_tokenizer import write_hf_tokenizer
from hopperlm.interop.tensors import from_hf_name, to_hf_name

PEFT_PREFIX = "base_model.model."
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def peft_config(lora_cfg: LoRAConfig, base_path: str | None) -> dict:
    """PEFT's adapter_config.json for adapters of `lora_cfg` on the base at `base_path`."""
    modules = sorted(
        {to_hf_name(f"layers.0.{TARGETS[t]}.weight").split(".")[-2] for t in lora_cfg.target_list}
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
    `peft.PeftModel.from_pretrained(hf_base_model, out_dir)` loads, and the run's tokenizer files (its chat
    template and special tokens, as `export` writes them) for `AutoTokenizer.from_pretrained(out_dir)`. The base
    they go on is the exported one, whose o_proj and down_proj carry CompleteP's residual multiplier
    (hf_convert.fold_output_multiplier): lora_B of those modules carries it too, so PEFT adds what hopperlm adds."""
    model_dir = resolve_model_dir(source)
    lora_cfg = read_lora_config(model_dir)
    if lora_cfg is None:
        raise CheckpointError(f"{model_dir} is not a LoRA checkpoint (no adapters); export it without --peft")
    model_cfg = read_model_config(model_dir)
    tensors = {}
    for name, t in read_adapters(model_dir).items():
        module, _, kind = name.partition(".lora_")  # layers.0.attn.q_proj / A.weight
        # B @ A is added to the weight, so B carries the multiplier the exported weight has folded in
        if kind.startswith("B."):
            t = fold_output_multiplier(module + ".weight", t, model_cfg)
        tensors[PEFT_PREFIX + to_hf_name(module + ".weight").removesuffix(".weight") + ".lora_" + kind] = t
    needed = sum(t.numel() * t.element_size() for t in tensors.values())
    with staged_output(out_dir, overwrite, what="the PEFT adapters", needed=needed) as tmp:
        save_safetensors(tensors, tmp / PEFT_WEIGHTS, metadata={"format": "pt"})
        (tmp / PEFT_CONFIG).write_text(
            json.dumps(peft_config(lora_cfg, model_cfg.init_from), indent=2) + "\n"
        )
        write_hf_tokenizer(model_dir / TOKENIZER_DIR, tmp, model_cfg.max_seq_len)
    return Path(out_dir)


def read_peft(adapter_dir: Path) -> tuple[LoRAConfig, dict[str, torch.Tensor]]:
    """A PEFT LoRA adapter folder -> (LoRAConfig, adapter tensors under hopperlm's names). Refuses what
    hopperlm's LoRA cannot express (DoRA, per-layer ranks, bias training, other modules)."""
    from safetensors.torch import load_file

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
