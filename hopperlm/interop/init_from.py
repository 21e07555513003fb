"""model.init_from as an explicit step: a config's model section filled in from the checkpoint it names.

Reading a config opens no checkpoint (config/loading.py); `resolve_init_from(cfg)` does, before anything uses
the model section (like litgpt's `Config.from_checkpoint`): the checkpoint's config (a Hugging Face config.json,
or a hopperlm run/checkpoint/export's) gives the shape, and the keys the recipe set beside init_from are laid
over it. Those may only lower max_seq_len, grow vocab_size (new rows for an extended tokenizer) or set
dropout/init_std; a shape key must equal the checkpoint's. Every command that runs or plans a loaded config
calls it (cli/runs.py, cli/measure.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from hopperlm.config import Config, ModelConfig
from hopperlm.errors import ConfigError
from hopperlm.interop.hf import model_values

# keys of the model section that must equal the checkpoint's when model.init_from is set
SHAPE_KEYS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_dim",
    "rope_theta",
    "norm_eps",
    "tie_embeddings",
    "qkv_bias",
    "rope_scaling",
    "sliding_window",
    "parametrization",  # a checkpoint keeps the one it was trained with: standard for Hugging Face models
    "base_dim",
    "depth_parametrization",
    "base_depth",
)


def init_from_values(values: dict[str, Any]) -> dict[str, Any]:
    """The model section of a config with model.init_from: the checkpoint's shape under the keys the user set,
    which may only lower max_seq_len, grow vocab_size (new token rows) or set dropout/init_std."""
    path = values["init_from"]
    if values.get("preset") is not None:
        raise ConfigError(
            f"model.preset={values['preset']} and model.init_from={path} are both set; the shape comes from "
            "init_from, drop model.preset"
        )
    if not Path(path).exists():
        raise ConfigError(f"model.init_from={path} does not exist; point it at a Hugging Face model folder")
    base = model_values(path)
    defaults = ModelConfig.__dataclass_fields__
    for key in SHAPE_KEYS:
        # a Hugging Face config has no parametrization (nor base_dim, nor a depth one): its model is standard
        theirs = base.get(key, defaults[key].default)
        if key in values and values[key] != theirs:
            raise ConfigError(
                f"model.{key}={values[key]} but {path} has {theirs}; the shape comes from model.init_from, "
                f"drop model.{key}"
            )
    if values.get("max_seq_len") is not None and values["max_seq_len"] > base["max_seq_len"]:
        raise ConfigError(
            f"model.max_seq_len={values['max_seq_len']} exceeds {path}'s {base['max_seq_len']} positions; "
            "lower it (or drop it)"
        )
    if values.get("vocab_size") is not None and values["vocab_size"] < base["vocab_size"]:
        raise ConfigError(
            f"model.vocab_size={values['vocab_size']} is smaller than {path}'s {base['vocab_size']}; "
            "rows can be added (an extended tokenizer), not removed"
        )
    return {**base, **values}


def resolve_init_from(cfg: Config) -> Config:
    """`cfg` with its model section taken from model.init_from under the keys the recipe set beside it (the
    config unchanged without init_from). A section built in Python counts every field as set, so resolving
    twice changes nothing; ConfigError when the recipe's keys contradict the checkpoint."""
    model = cfg.model
    if model.init_from is None:
        return cfg
    given = model.recipe_keys
    if given is None:
        given = dataclasses.asdict(model)
    return dataclasses.replace(cfg, model=ModelConfig(**init_from_values(given)))
