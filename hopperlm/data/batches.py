"""The one interface the training loop reads batches through (`BatchSource`), and its pretraining sources.

Every source gives micro-batch `micro` of data step `step` for this rank (`next`), saves and restores its
position (`state_dict`, `load_state_dict`), re-cuts the step being redone after an out-of-memory error
(`set_micro_batch`) and stops its threads (`close`). Each rank reads its block of every global micro-batch
from a rank-independent position, so a run's batches do not depend on the number of ranks.

- `WindowBatches`: `data.sampling: random` over one dataset; the batch of (step, micro) is a pure function of
  the seed, nothing to save beyond the step.
- `StreamBatches`: sequential epochs, or a weighted mixture; a `SampleStream` whose position is saved in each
  checkpoint and restored on resume.
- Instruction data's rows (data/sft.py `SFTBatches`) implement the same interface.
Both pretraining sources can prepare (and pin) the next batches in a background thread (`prefetch`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

from hopperlm.config import DataConfig
from hopperlm.data.loader import Batch, RandomWindows, TokenShards
from hopperlm.data.prefetch import Prefetcher
from hopperlm.data.sampling import SampleStream, Source
from hopperlm.data.train_data import Dataset
from hopperlm.errors import DataError


@dataclass(frozen=True)
class BatchLayout:
    """How one rank reads a step: `grad_accum` micro-batches of `micro_batch` sequences each, its block `rank`
    of `world_size` of every global micro-batch. Made once from the plan (train/run.py), it travels as one to
    the source that cuts the batches."""

    micro_batch: int  # per rank
    grad_accum: int = 1
    rank: int = 0
    world_size: int = 1


class BatchSource(Protocol):
    def next(self, step: int, micro: int) -> Batch:
        """Micro-batch `micro` of data step `step`, this rank's block of it."""

    def state_dict(self) -> dict | None:
        """The position to save in a checkpoint (None: the step is the position)."""

    def load_state_dict(self, state: dict | None) -> None: ...

    def set_micro_batch(self, micro_batch: int, grad_accum: int) -> None:
        """Back to the start of the step being redone or dropped (after an out-of-memory error, or a signal
        mid-step; between steps, the start of the next one), with micro-batches of this size from there."""

    def close(self) -> None: ...


class _Prefetched:
    """What both pretraining sources share: pinning and the prefetch thread's lifetime."""

    pin: bool
    _prefetcher: Prefetcher | None = None

    def _ready(self, batch: Batch) -> Batch:
        return batch.pin_memory() if self.pin else batch

    def _stop(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def close(self) -> None:
        self._stop()


class WindowBatches(_Prefetched):
    """Random windows of one dataset (nanoGPT's sampling), optionally prefetched and pinned."""

    def __init__(
        self,
        shards: TokenShards,
        *,
        seq_len: int,
        layout: BatchLayout,
        seed: int,
        packing: bool,
        pin: bool,
        prefetch: int,
    ) -> None:
        self.shards, self.seq_len, self.seed, self.packing = shards, seq_len, seed, packing
        self.grad_accum, self.pin, self.depth = layout.grad_accum, pin, prefetch
        self.rank, self.world_size = layout.rank, layout.world_size
        self.windows = self._windows(layout.micro_batch)
        self._prefetcher: Prefetcher | None = None
        self._next_key: tuple[int, int] | None = None

    def _windows(self, micro_batch: int) -> RandomWindows:
        return RandomWindows(
            self.shards, self.seq_len, micro_batch, self.seed, self.packing, self.rank, self.world_size
        )

    def next(self, step: int, micro: int) -> Batch:
        if not self.depth:
            return self._ready(self.windows.get(step, micro))
        if self._prefetcher is None or self._next_key != (step, micro):
            self._stop()  # a rollback or an out-of-memory redo changed the order of steps
            keys = (
                (s, m)
                for s in itertools.count(step)
                for m in range(micro if s == step else 0, self.grad_accum)
            )
            self._prefetcher = Prefetcher(lambda: self._ready(self.windows.get(*next(keys))), self.depth)
        self._next_key = (step, micro + 1) if micro + 1 < self.grad_accum else (step + 1, 0)
        return self._prefetcher.get()

    def state_dict(self) -> None:
        return None  # the step is the position

    def load_state_dict(self, state: dict | None) -> None:
        pass

    def set_micro_batch(self, micro_batch: int, grad_accum: int) -> None:
        self._stop()
        self.grad_accum, self.windows = grad_accum, self._windows(micro_batch)


class StreamBatches(_Prefetched):
    """Sequential epochs or a mixture: the stream's position is what the loop consumed, not what the
    prefetch thread read ahead."""

    def __init__(
        self,
        cfg: DataConfig,
        datasets: list[Dataset],
        shards: list[TokenShards],
        *,
        seq_len: int,
        layout: BatchLayout,
        seed: int,
        pin: bool,
        prefetch: int,
    ) -> None:
        self.cfg, self.pin, self.depth = cfg, pin, prefetch
        sources = [Source(d.name, s, d.weight) for d, s in zip(datasets, shards, strict=True)]
        self.stream = SampleStream(
            sources,
            seq_len,
            layout.micro_batch,
            seed,
            cfg.sampling,
            cfg.shuffle,
            cfg.packing,
            layout.rank,
            layout.world_size,
        )
        self._consumed = self.stream.state_dict()  # the position of the next batch the loop will use
        # where the step being run (or the next one, between steps) starts: what set_micro_batch rewinds to.
        # It moves when a step's last micro-batch is read (the loop reads whole steps, or rewinds)
        self._step_start = self._consumed
        self.grad_accum = layout.grad_accum
        self._prefetcher: Prefetcher | None = None

    def next(self, step: int, micro: int) -> Batch:
        if not self.depth:
            batch = self._ready(self.stream.next_batch())
            self._consumed = self.stream.state_dict()
        else:
            if self._prefetcher is None:
                self._prefetcher = Prefetcher(
                    lambda: (self._ready(self.stream.next_batch()), self.stream.state_dict()), self.depth
                )
            batch, self._consumed = self._prefetcher.get()
        if micro == self.grad_accum - 1:  # read whole: a step dropped even before its first micro-batch
            self._step_start = self._consumed  # (a signal between steps) rewinds to here
        return batch

    def state_dict(self) -> dict:
        return dict(self._consumed)

    def load_state_dict(self, state: dict | None) -> None:
        if state is None:
            raise DataError(
                f"the checkpoint holds no data position, so data.sampling={self.cfg.sampling} "
                "(or data.mixture) cannot resume exactly; resume with the run's own data config"
            )
        self._stop()
        self.stream.load_state_dict(state)
        self._consumed = self._step_start = self.stream.state_dict()

    def set_micro_batch(self, micro_batch: int, grad_accum: int) -> None:
        self._stop()
        self.stream.micro_batch, self.grad_accum = micro_batch, grad_accum
        self.stream.load_state_dict(self._step_start)
        self._consumed = self._step_start


def train_batches(
    cfg: DataConfig,
    datasets: list[Dataset],
    shards: list[TokenShards],
    *,
    seq_len: int,
    layout: BatchLayout,
    seed: int,
    pin: bool,
    prefetch: int,
) -> BatchSource:
    """The pretraining source the data section asks for: random windows of one dataset, else a stream."""
    if cfg.sampling == "random" and len(datasets) == 1:
        return WindowBatches(
            shards[0],
            seq_len=seq_len,
            layout=layout,
            seed=seed,
            packing=cfg.packing,
            pin=pin,
            prefetch=prefetch,
        )
    return StreamBatches(
        cfg, datasets, shards, seq_len=seq_len, layout=layout, seed=seed, pin=pin, prefetch=prefetch
    )
