"""What the training loop reads: its datasets (one, or a weighted mixture), the micro-batches of every step
and the validation sets, chosen from the `data` section of the config.

- `data.sampling: random` over one dataset (the default) is `RandomWindows`: the batch of (step, micro_step) is
  a pure function of the seed, nothing to save. Everything else (`sequential`, or a `mixture`) is a
  `SampleStream` whose position is saved in each checkpoint (`state_dict`) and restored on resume.
- `data.packing` adds document numbers to every batch, so attention stays within documents.
- `data.prefetch` batches are prepared (and pinned) by a background thread.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

from hopperlm.config import DataConfig
from hopperlm.data.loader import Batch, RandomWindows, TokenShards, eval_windows
from hopperlm.data.prefetch import Prefetcher
from hopperlm.data.sampling import SampleStream, Source
from hopperlm.data.shards import read_manifest
from hopperlm.errors import ConfigError, DataError


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
    for path, weight in entries:
        if weight <= 0:
            raise ConfigError(f"data.mixture weight of {path} is {weight}; weights must be positive")
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


def open_train_shards(datasets: list[Dataset], seq_len: int, verify: bool) -> list[TokenShards]:
    """The train split of every dataset, each checked to hold at least one window."""
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
        parts.append("mixture " + " + ".join(f"{Path(p).name} {w:g}" for p, w in cfg.mixture.items()))
    if cfg.packing:
        from hopperlm.model.attention import describe_backend

        parts.append(f"packing with {describe_backend(device, dropout)}")
    prefetch = default_prefetch(cfg, device)
    parts.append(f"prefetch {prefetch} batches in a background thread" if prefetch else "no prefetch thread")
    return "; ".join(parts)


class TrainBatches:
    """The micro-batches of each step, ready for the device (pinned when asked), prefetched when asked."""

    def __init__(
        self,
        cfg: DataConfig,
        datasets: list[Dataset],
        shards: list[TokenShards],
        seq_len: int,
        micro_batch: int,
        grad_accum: int,
        seed: int,
        pin: bool,
        prefetch: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.cfg, self.seq_len, self.seed, self.pin, self.depth = cfg, seq_len, seed, pin, prefetch
        self.grad_accum, self.rank, self.world_size = grad_accum, rank, world_size
        self.stateless = cfg.sampling == "random" and len(datasets) == 1
        if self.stateless:
            self.windows = RandomWindows(shards[0], seq_len, micro_batch, seed, cfg.packing, rank, world_size)
        else:
            sources = [Source(d.name, s, d.weight) for d, s in zip(datasets, shards, strict=True)]
            self.stream = SampleStream(
                sources, seq_len, micro_batch, seed, cfg.sampling, cfg.shuffle, cfg.packing, rank, world_size
            )
            self._consumed = self.stream.state_dict()  # the position of the next batch the loop will use
            self._step_start = self._consumed
        self._prefetcher: Prefetcher | None = None
        self._next_key: tuple[int, int] | None = None

    # ---- the checkpointed position -------------------------------------------------------------------------
    def state_dict(self) -> dict | None:
        """None for stateless random windows (the step is the position), else the stream's position."""
        return None if self.stateless else dict(self._consumed)

    def load_state_dict(self, state: dict | None) -> None:
        if self.stateless:
            return
        if state is None:
            raise DataError(
                f"the checkpoint holds no data position, so data.sampling={self.cfg.sampling} "
                "(or data.mixture) cannot resume exactly; resume with the run's own data config"
            )
        self._stop()
        self.stream.load_state_dict(state)
        self._consumed = self._step_start = self.stream.state_dict()

    # ---- batches -------------------------------------------------------------------------------------------
    def _ready(self, batch: Batch) -> Batch:
        return batch.pin_memory() if self.pin else batch

    def _start_prefetch(self, step: int, micro: int) -> None:
        if self.stateless:
            keys = (
                (s, m)
                for s in itertools.count(step)
                for m in range(micro if s == step else 0, self.grad_accum)
            )

            def produce():
                key = next(keys)
                return key, self._ready(self.windows.get(*key))
        else:

            def produce():
                batch = self._ready(self.stream.next_batch())
                return None, batch, self.stream.state_dict()

        self._prefetcher = Prefetcher(produce, self.depth)

    def _stop(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def next(self, step: int, micro: int) -> Batch:
        """Micro-batch `micro` of data step `step` (the stateless sampler uses both; a stream gives its next)."""
        if micro == 0 and not self.stateless:
            self._step_start = self._consumed
        if not self.depth:
            if self.stateless:
                return self._ready(self.windows.get(step, micro))
            batch = self._ready(self.stream.next_batch())
            self._consumed = self.stream.state_dict()
            return batch
        if self.stateless:
            if self._prefetcher is None or self._next_key != (step, micro):
                self._stop()  # a rollback or an out-of-memory redo changed the order of steps
                self._start_prefetch(step, micro)
            key, batch = self._prefetcher.get()
            self._next_key = (step, micro + 1) if micro + 1 < self.grad_accum else (step + 1, 0)
            return batch
        if self._prefetcher is None:
            self._start_prefetch(step, micro)
        _, batch, self._consumed = self._prefetcher.get()
        return batch

    def set_micro_batch(self, micro_batch: int, grad_accum: int) -> None:
        """After an out-of-memory error: smaller micro-batches from the start of the step being redone."""
        self._stop()
        self.grad_accum = grad_accum
        if self.stateless:
            self.windows = RandomWindows(
                self.windows.shards,
                self.seq_len,
                micro_batch,
                self.seed,
                self.cfg.packing,
                self.rank,
                self.world_size,
            )
        else:
            self.stream.micro_batch = micro_batch
            self.stream.load_state_dict(self._step_start)
            self._consumed = self._step_start

    def close(self) -> None:
        self._stop()


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
    """The mixture's validation loss: the per-dataset losses weighted like the training mixture."""
    if len(sets) == 1:
        return losses[sets[0].name]
    total = sum(s.weight for s in sets)
    return sum(losses[s.name] * s.weight for s in sets) / total


def default_prefetch(cfg: DataConfig, device: torch.device) -> int:
    """data.prefetch, or 2 on CUDA (keep the GPU fed) and 0 on CPU (a thread would compete for its cores)."""
    if cfg.prefetch is not None:
        return cfg.prefetch
    return 2 if device.type == "cuda" else 0
