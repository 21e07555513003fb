"""Typed run configuration: dataclasses with one docstring per field, YAML loading and strict CLI overrides.

A config file has up to fourteen sections (model, data, optim, muon, schedule, train, checkpoint, guard, log,
parallel, run, lora, sft, eval).
`model.preset` starts the model section from a preset in presets.py; keys beside it override the preset.
`model.init_from` starts it from a Hugging Face or hopperlm checkpoint instead: reading a config opens no
checkpoint, so such a section awaits an explicit `hopperlm.interop.init_from.resolve_init_from(cfg)`,
which fills in the checkpoint's shape. Every key is checked against the dataclass: an unknown key, a wrong type
or an impossible shape raises ConfigError naming the field and the fix.

The sections live in model.py, optim.py, training.py, run.py and finetune.py; recipe.py joins them into a Config and
loading.py reads one from YAML. Everything but the presets is importable from `hopperlm.config`.
"""

from hopperlm.config.finetune import LoRAConfig, SFTConfig
from hopperlm.config.loading import (
    config_from_dict,
    config_yaml,
    load_config,
    merge,
    parse_overrides,
    read_yaml,
)
from hopperlm.config.model import ModelConfig
from hopperlm.config.optim import MuonConfig, OptimConfig, ParamGroupConfig, ScheduleConfig
from hopperlm.config.recipe import SECTIONS, Config
from hopperlm.config.run import CheckpointConfig, EvalConfig, LogConfig, ParallelConfig, RunConfig
from hopperlm.config.training import DataConfig, GuardConfig, TrainConfig

__all__ = [
    "SECTIONS",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "EvalConfig",
    "GuardConfig",
    "LoRAConfig",
    "LogConfig",
    "ModelConfig",
    "MuonConfig",
    "OptimConfig",
    "ParallelConfig",
    "ParamGroupConfig",
    "RunConfig",
    "SFTConfig",
    "ScheduleConfig",
    "TrainConfig",
    "config_from_dict",
    "config_yaml",
    "load_config",
    "merge",
    "parse_overrides",
    "read_yaml",
]
