"""What a pretraining run reads, chosen from the `data` section of the config: its datasets (one, or a
weighted mixture), their train shards and the validation sets. The micro-batches of every step come from
data/batches.py; `data.packing` adds document numbers to every batch, so attention stays within documents.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hopperlm.config import DataConfig
from hopperlm.data.loader import TokenShards, eval_windows
from hopperlm.data.shards import read_manifest
from hopperlm.errors import ConfigError, DataError
from hopperlm.model.attention import describe_backend


@dataclass
class Dataset:
    name: str
    path: Path
    weight: float
    manifest: dict


def resolve_datasets(cfg: DataConfig) -> list[Dataset]:
    """data.path, or the data.mixture {path: weight}; every dataset must share one tokenizer."""
    if cfg.mixture:
        if cfg.path and cfg.path not in cfg.mixture:
            raise ConfigError(
                f"data.path={cfg.path} and data.mixture are both set; list every dataset in data.mixture "
                "and leave data.path empty"
            )
        entries = list(cfg.mixture.items())
    elif cfg.path:
        entries = [(cfg.path, 1.0)]
    else:
        raise ConfigError(
            "data.path is not set; point it at a `hopperlm prepare` output, e.g. --data.path DIR"
        )
    datasets, names = [], set()
    for path, weight in entries:  # (DataConfig checked the weights: >= 0, one of them positive)
        name = Path(path).name or str(path)
        while name in names:  # two folders with the same base name: keep the labels apart
            name += "'"
        names.add(name)
        datasets.append(Dataset(name, Path(path), float(weight), read_manifest(Path(path))))
    first = datasets[0]
    for d in datasets[1:]:
        if d.manifest["tokenizer"]["sha256"] != first.manifest["tokenizer"]["sha256"]:
            raise DataError(
                f"data.mixture: {d.path} was prepared with another tokenizer than {first.path} "
                f"({d.manifest['tokenizer'].get('name')} vs {first.manifest['tokenizer'].get('name')}); "
                "prepare every dataset of a mixture with the same tokenizer"
            )
    return datasets


def trained(datasets: list[Dataset]) -> list[Dataset]:
    """The datasets training draws from: those of positive weight (a weight of 0 is a validation set only)."""
    return [d for d in datasets if d.weight > 0]


def open_train_shards(datasets: list[Dataset], seq_len: int, verify: bool) -> list[TokenShards]:
    """The train split of every dataset given (`trained(...)`: never a 0-weight one's), each checked to hold at
    least one window."""
    shards = [TokenShards(d.path, "train", verify=verify) for d in datasets]
    for s in shards:
        s.check_window(seq_len)
    return shards


def describe(cfg: DataConfig, device: torch.device, dropout: float) -> str:
    """The plan's line about how training data is read (and, when packing, how documents are kept apart)."""
    if cfg.sampling == "random":
        order = "random windows (batch = f(seed, step))"
    else:
        order = "sequential epochs" + ("" if cfg.shuffle else " in file order")
    parts = [f"{order} read in-process from memory-mapped shards"]
    if cfg.mixture:
        parts.append(
            "mixture "
            + " + ".join(
                f"{Path(p).name} {w:g}" + ("" if w else " (validation only)") for p, w in cfg.mixture.items()
            )
        )
    if cfg.packing:
        parts.append(f"packing with {describe_backend(device, dropout)}")
    prefetch = default_prefetch(cfg, device)
    parts.append(f"prefetch {prefetch} batches in a background thread" if prefetch else "no prefetch thread")
    return "; ".join(parts)


@dataclass
class ValSet:
    name: str
    shards: TokenShards
    starts: list[int]
    weight: float


def open_val_sets(datasets: list[Dataset], seq_len: int, max_windows: int, verify: bool) -> list[ValSet]:
    """One validation set per dataset that has a val split (a mixture reports each separately)."""
    sets = []
    for d in datasets:
        if d.manifest["tokens"].get("val", 0) > 0:
            shards = TokenShards(d.path, "val", verify=verify)
            sets.append(ValSet(d.name, shards, eval_windows(shards, seq_len, max_windows), d.weight))
    return sets


def combined_val_loss(losses: dict[str, float], sets: list[ValSet]) -> float:
    """The mixture's validation loss: the per-dataset losses weighted like the training mixture (a 0-weight
    validation set counts for nothing; where no trained dataset has a val split, the plain mean)."""
    if len(sets) == 1:
        return losses[sets[0].name]
    total = sum(s.weight for s in sets)
    if total <= 0:
        return sum(losses[s.name] for s in sets) / len(sets)
    return sum(losses[s.name] * s.weight for s in sets) / total


def default_prefetch(cfg: DataConfig, device: torch.device) -> int:
    """data.prefetch, or 2 on CUDA (keep the GPU fed) and 0 on CPU (a thread would compete for its cores)."""
    if cfg.prefetch is not None:
        return cfg.prefetch
    return 2 if device.type == "cuda" else 0
