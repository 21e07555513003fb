"""The whole recipe: a Config of fourteen sections, and the checks that span two of them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hopperlm.config.finetune import LoRAConfig, SFTConfig
from hopperlm.config.model import ModelConfig
from hopperlm.config.optim import MuonConfig, OptimConfig, ScheduleConfig, muon_refusal
from hopperlm.config.run import CheckpointConfig, EvalConfig, LogConfig, ParallelConfig, RunConfig
from hopperlm.config.training import DataConfig, GuardConfig, TrainConfig
from hopperlm.errors import ConfigError


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    muon: MuonConfig = field(default_factory=MuonConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(max_steps=1000))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    log: LogConfig = field(default_factory=LogConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        if self.lora.enabled and self.train.embed_warmup_steps:
            raise ConfigError(
                "train.embed_warmup_steps trains new embedding rows, which LoRA keeps frozen; "
                "drop one of train.embed_warmup_steps and lora.rank"
            )
        refusal = muon_refusal(self.optim, self.muon)
        if refusal is not None:
            raise refusal
        # (a model section awaiting model.init_from is checked once resolve_init_from has filled it in)
        if not self.model.awaits_init_from and self.train.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}; "
                "lower train.seq_len or raise model.max_seq_len"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "muon": MuonConfig,
    "schedule": ScheduleConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "guard": GuardConfig,
    "log": LogConfig,
    "parallel": ParallelConfig,
    "run": RunConfig,
    "lora": LoRAConfig,
    "sft": SFTConfig,
    "eval": EvalConfig,
}
