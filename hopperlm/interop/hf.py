"""Hugging Face interop, configs: a `config.json` of the Llama family <-> hopperlm's ModelConfig.

hopperlm's module names follow HF's Llama layout (q_proj ... down_proj) and its RoPE is HF's rotate-half, so the
families below map one to one onto a ModelConfig:
  llama    Llama 2, Llama 3 (rope_theta 500000) and 3.1+ (llama3 RoPE scaling), TinyLlama
  mistral  as llama, plus a sliding attention window: contexts up to the window are exact
  qwen2    as llama, plus biases on q/k/v (and often tied embeddings)
  qwen3    as llama, plus per-head RMSNorm of queries and keys before RoPE (model.qk_norm)
  arcee    as llama, with the non-gated ReLU² MLP (hidden_act relu2: up_proj, down_proj; model.mlp relu2)
Export picks the family from the model's features (hf_family); a model no family describes (a logit softcap,
QK-norm with ReLU², either with q/k/v biases) is refused in one line naming the keys and `--format hopperlm`.
Anything a ModelConfig cannot express (another activation, o_proj or MLP biases, a head size other than
hidden/heads, dynamic or YaRN RoPE scaling) is refused with the key at fault, never converted approximately.
`transformers` itself is not needed to read or write these files; it is imported lazily for `llama_config`
(the HF baseline of `hopperlm bench`) and by the tests. The weights are hf_convert.py's; model.init_from's use
of these configs is init_from.py's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from hopperlm.checkpoint.layout import is_hf_dir, read_model_config, resolve_model_dir
from hopperlm.config import ModelConfig
from hopperlm.errors import CheckpointError, ConfigError

FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "arcee": "ArceeForCausalLM",
}
# family -> (its config.json's hidden_act, the model.mlp that computes it); every other family: silu, swiglu
ACTIVATIONS = {"arcee": ("relu2", "relu2")}
HOPPERLM_FORMAT = "export it with --format hopperlm"


def require_transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError("this needs Hugging Face transformers: pip install 'hopperlm[hf]'") from None
    return transformers


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"cannot read {path} ({e}); point at a model folder with a valid config.json"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a JSON object; point at a model folder with a valid config.json")
    return data


def _rope(raw: dict, where: str) -> tuple[float, dict[str, float] | None]:
    """(rope_theta, scaling) from either layout: transformers 4 (rope_theta + rope_scaling) or 5
    (rope_parameters holding both)."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    theta = float(raw.get("rope_theta", params.get("rope_theta", 10000.0)))
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return theta, None
    if kind == "linear":
        return theta, {"factor": float(scaling["factor"])}
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in scaling]
        if missing:
            raise ConfigError(f"{where}: llama3 rope scaling lacks {', '.join(missing)}")
        return theta, {k: float(scaling[k]) for k in keys}
    raise ConfigError(
        f"{where}: RoPE scaling type {kind!r} is not supported (hopperlm runs default, linear and llama3 "
        "RoPE); use a checkpoint without it"
    )


def model_values_from_hf(raw: dict, where: str, log=None) -> dict[str, Any]:
    """ModelConfig fields for a transformers config.json of a supported family (ConfigError otherwise)."""
    family = raw.get("model_type")
    if family not in FAMILIES:
        raise ConfigError(
            f"{where}: model_type {family!r} is not supported; hopperlm converts "
            f"{', '.join(FAMILIES)} checkpoints (Llama 2/3, TinyLlama, Mistral, Qwen2, Qwen3, Arcee)"
        )
    act, mlp = ACTIVATIONS.get(family, ("silu", "swiglu"))
    if raw.get("hidden_act", act) != act:
        raise ConfigError(
            f"{where}: hidden_act={raw['hidden_act']!r}; hopperlm's {family} MLP is "
            + ("SwiGLU (silu)" if act == "silu" else f"ReLU² ({act})")
        )
    if raw.get("mlp_bias"):
        raise ConfigError(f"{where}: mlp_bias=true is not supported (hopperlm's MLP has no biases)")
    if family != "qwen2" and raw.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias=true (biases on q/k/v and o) is not supported")
    dim, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    head_dim = raw.get("head_dim")
    if head_dim is not None and int(head_dim) * heads != dim:
        raise ConfigError(
            f"{where}: head_dim={head_dim} differs from hidden_size/num_attention_heads={dim // heads}; "
            "hopperlm's attention uses hidden/heads"
        )
    theta, scaling = _rope(raw, where)
    max_len = int(raw.get("max_position_embeddings", 2048))
    window = raw.get("sliding_window")
    if family in ("qwen2", "qwen3") and not raw.get("use_sliding_window"):
        window = None  # Qwen configs name a window they do not use
    if window is not None:
        window = int(window)
        if window < max_len:
            if log is not None:
                log(
                    f"{where}: sliding window {window} < max_position_embeddings {max_len}: contexts are "
                    f"limited to {window} tokens, where full causal attention is the same"
                )
            max_len = window
    return {
        "dim": dim,
        "n_layers": int(raw["num_hidden_layers"]),
        "n_heads": heads,
        "n_kv_heads": int(raw.get("num_key_value_heads") or heads),
        "ffn_dim": int(raw["intermediate_size"]),
        "vocab_size": int(raw["vocab_size"]),
        "max_seq_len": max_len,
        "rope_theta": theta,
        "norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "dropout": 0.0,
        "init_std": float(raw.get("initializer_range", 0.02)),
        "qkv_bias": family == "qwen2",
        "qk_norm": family == "qwen3",
        "mlp": mlp,
        "rope_scaling": scaling,
        "sliding_window": window,
    }


def model_values(path: str | Path, log=None) -> dict[str, Any]:
    """ModelConfig fields of a checkpoint: a Hugging Face folder, or anything `hopperlm generate` loads."""
    path = Path(path)
    if is_hf_dir(path):
        return model_values_from_hf(read_json(path / "config.json"), str(path / "config.json"), log)
    try:
        cfg = read_model_config(resolve_model_dir(path))
    except CheckpointError as e:
        raise ConfigError(
            f"model.init_from={path} is neither a Hugging Face model folder (config.json with model_type) nor a "
            f"hopperlm checkpoint ({e})"
        ) from None
    values = dataclasses.asdict(cfg)
    for key in ("preset", "init_from"):
        values.pop(key)
    return values


def refuse_unexportable(cfg: ModelConfig) -> None:
    """One ConfigError, naming the keys, for a model no Llama-family format describes: not the Hugging Face
    families of FAMILIES, nor llama.cpp's llama, qwen3 and arcee (gguf.py asks here too)."""
    if cfg.logit_softcap is not None:
        raise ConfigError(
            f"model.logit_softcap={cfg.logit_softcap}: no Llama-family format carries a logit softcap "
            f"(transformers' and llama.cpp's Llama, Qwen3 and Arcee have none); {HOPPERLM_FORMAT}, or train "
            "without it"
        )
    if cfg.qk_norm and cfg.mlp == "relu2":
        raise ConfigError(
            "model.qk_norm=true with model.mlp=relu2: no Llama-family format has both (Qwen3 has QK-norm with "
            f"SwiGLU, Arcee ReLU² without QK-norm); {HOPPERLM_FORMAT}, or train with one of them"
        )
    for present, key, family in (
        (cfg.qk_norm, "qk_norm=true", "Qwen3"),
        (cfg.mlp == "relu2", "mlp=relu2", "Arcee"),
    ):
        if present and cfg.qkv_bias:
            raise ConfigError(
                f"model.qkv_bias=true with model.{key}: {family}, the format for model.{key}, has no biases on "
                f"q/k/v alone (its attention_bias puts one on o_proj too); {HOPPERLM_FORMAT}"
            )


def hf_family(cfg: ModelConfig, base_family: str | None = None) -> str:
    """The Hugging Face family that describes `cfg` (ConfigError where none does: refuse_unexportable): arcee
    for ReLU², qwen3 for QK-norm, qwen2 for q/k/v biases; otherwise the base's llama or mistral (the
    config.json a run started from), else mistral for a window and llama."""
    refuse_unexportable(cfg)
    if cfg.mlp == "relu2":
        return "arcee"
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias:
        return "qwen2"
    if base_family in ("llama", "mistral"):
        return base_family
    return "mistral" if cfg.sliding_window else "llama"


def hf_config_dict(cfg: ModelConfig, dtype: str, base: dict | None = None) -> dict[str, Any]:
    """A transformers config.json for `cfg`, of hf_family's family. `base` (the config.json a run started
    from) keeps its token ids, and its family where the features allow it (llama or mistral)."""
    if cfg.vocab_size is None:
        raise ConfigError("model.vocab_size must be set to write a Hugging Face config")
    base = base or {}
    family = hf_family(cfg, base.get("model_type"))
    out: dict[str, Any] = {
        "architectures": [FAMILIES[family]],
        "model_type": family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": ACTIVATIONS.get(family, ("silu",))[0],
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if cfg.rope_scaling is not None:
        kind = "linear" if set(cfg.rope_scaling) == {"factor"} else "llama3"
        scaling = {
            k: (int(v) if k == "original_max_position_embeddings" else v) for k, v in cfg.rope_scaling.items()
        }
        out["rope_scaling"] = {"rope_type": kind, **scaling}
    if family in ("llama", "arcee"):
        out.update(attention_bias=False, mlp_bias=False)
    elif family == "mistral":
        out["sliding_window"] = cfg.sliding_window
    else:  # qwen2, qwen3: a window only caps hopperlm's context (max_position_embeddings), attention is full
        out.update(use_sliding_window=False, sliding_window=None)
    if family == "qwen3":
        out.update(attention_bias=False, max_window_layers=cfg.n_layers)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in base:
            out[key] = base[key]
    return out


def with_token_ids(config: dict[str, Any], ids: dict[str, int]) -> dict[str, Any]:
    """config.json's token ids: the base's (hf_config_dict), else the tokenizer's `ids`; an Arcee config
    without them says null, where ArceeConfig would default to Llama 3's 128000/128001."""
    for key, value in ids.items():
        config.setdefault(key, value)
    if config["model_type"] == "arcee":
        for key in ("bos_token_id", "eos_token_id"):
            config.setdefault(key, None)
    return config


def llama_config(cfg: ModelConfig):
    """transformers.LlamaConfig with the same shapes, RoPE base, norm epsilon and tying as `cfg` (a model of
    another family, or of none, is refused: a LlamaConfig would be another network)."""
    transformers = require_transformers()
    if cfg.vocab_size is None:
        raise ConfigError("model.vocab_size must be set to build a Hugging Face config")
    family = hf_family(cfg)
    if family not in ("llama", "mistral"):
        raise ConfigError(
            f"this model is of transformers' {family} family (model.mlp={cfg.mlp}, model.qk_norm="
            f"{str(cfg.qk_norm).lower()}, model.qkv_bias={str(cfg.qkv_bias).lower()}), not a LlamaConfig"
        )
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.hidden_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=cfg.dropout,
        hidden_act="silu",
    )
