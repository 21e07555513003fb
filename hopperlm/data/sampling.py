"""Stateful sampling: epoch order and weighted mixtures, with a position that goes into the checkpoint.

The data is one global stream of samples (windows of seq_len + 1 tokens) numbered 0, 1, 2, ...; sample n is a
pure function of (seed, n) and the per-dataset counters. A micro-step takes the next micro_batch * world_size
samples; rank r reads the block [r * micro_batch, (r + 1) * micro_batch) of them. The position (the global
sample number and how many samples each dataset has given) does not depend on the number of ranks, so a run
resumed with a different world size, or a different micro-batch with the same global batch, goes on with
exactly the next samples.

Orders within a dataset:
- sequential: the non-overlapping windows of the split, each once per epoch; shuffled per epoch by
  (seed, epoch) unless shuffle is off.
- random: window k of dataset d starts at a random offset drawn from (seed, d, k) (nanoGPT style).
Mixtures draw the dataset of sample n from the weights with (seed, n): the proportions hold over any stretch
of the run, and each dataset keeps its own order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hopperlm.data.loader import Batch, TokenShards, windows_batch
from hopperlm.errors import DataError

CHOICE_BLOCK = 4096  # dataset choices are drawn this many samples at a time


class EpochOrder:
    """Window k of an epoch-ordered split: every non-overlapping window once per epoch."""

    def __init__(self, shards: TokenShards, seq_len: int, seed: int, shuffle: bool) -> None:
        shards.check_window(seq_len)
        self.seq_len, self.seed, self.shuffle = seq_len, seed, shuffle
        self.windows = (len(shards) - 1) // seq_len  # window i reads [i*T, i*T + T + 1)
        self._epoch, self._perm = -1, None

    def start(self, k: int) -> int:
        epoch, i = divmod(k, self.windows)
        if not self.shuffle:
            return i * self.seq_len
        if epoch != self._epoch:
            self._epoch, self._perm = (
                epoch,
                np.random.default_rng([self.seed, epoch]).permutation(self.windows),
            )
        return int(self._perm[i]) * self.seq_len


class RandomOrder:
    """Window k starts at a random offset, drawn CHOICE_BLOCK at a time from (seed, dataset, k // CHOICE_BLOCK)."""

    def __init__(self, shards: TokenShards, seq_len: int, seed: int, dataset: int) -> None:
        shards.check_window(seq_len)
        self.seed, self.dataset, self.last = seed, dataset, len(shards) - seq_len - 1
        self._block, self._starts = -1, None

    def start(self, k: int) -> int:
        block, i = divmod(k, CHOICE_BLOCK)
        if block != self._block:
            rng = np.random.default_rng([self.seed, self.dataset, block])
            self._block, self._starts = block, rng.integers(0, self.last, size=CHOICE_BLOCK, endpoint=True)
        return int(self._starts[i])


@dataclass
class Source:
    name: str
    shards: TokenShards
    weight: float


class SampleStream:
    """The training micro-batches of one rank, from one dataset or a weighted mixture; see the module doc."""

    def __init__(
        self,
        sources: list[Source],
        seq_len: int,
        micro_batch: int,
        seed: int,
        order: str = "sequential",
        shuffle: bool = True,
        packing: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if order not in ("sequential", "random"):
            raise DataError(f"data.sampling={order!r} is unknown; use random or sequential")
        self.sources, self.seq_len, self.micro_batch, self.seed = sources, seq_len, micro_batch, seed
        self.packing, self.rank, self.world_size = packing, rank, world_size
        self.order = order
        self.orders = [
            EpochOrder(s.shards, seq_len, seed, shuffle)
            if order == "sequential"
            else RandomOrder(s.shards, seq_len, seed, d)
            for d, s in enumerate(sources)
        ]
        weights = np.array([s.weight for s in sources], dtype=np.float64)
        if (weights <= 0).any():
            raise DataError("data.mixture weights must be positive")
        self._cdf = np.cumsum(weights / weights.sum())
        self._block, self._choices = -1, None
        self.position = 0  # global samples consumed, all ranks together
        self.counts = [0] * len(sources)  # samples each dataset has given

    # ---- position ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "kind": "stream",
            "order": self.order,
            "position": self.position,
            "counts": list(self.counts),
            "datasets": [s.name for s in self.sources],
        }

    def load_state_dict(self, state: dict) -> None:
        names = [s.name for s in self.sources]
        if (
            state.get("kind") != "stream"
            or state.get("datasets") != names
            or state.get("order") != self.order
        ):
            raise DataError(
                f"the checkpoint's data position is for {state.get('order')} sampling over "
                f"{state.get('datasets')}, not {self.order} over {names}; resume with the run's own data config"
            )
        self.position, self.counts = int(state["position"]), [int(c) for c in state["counts"]]

    # ---- sampling ------------------------------------------------------------------------------------------
    def dataset_of(self, n: int) -> int:
        if len(self.sources) == 1:
            return 0
        block, i = divmod(n, CHOICE_BLOCK)
        if block != self._block:
            u = np.random.default_rng([self.seed, 0x6D1, block]).random(CHOICE_BLOCK)
            self._block = block
            self._choices = np.minimum(np.searchsorted(self._cdf, u, side="right"), len(self.sources) - 1)
        return int(self._choices[i])

    def next_batch(self) -> Batch:
        """This rank's next micro-batch; advances the global position by micro_batch * world_size."""
        mine = range(self.rank * self.micro_batch, (self.rank + 1) * self.micro_batch)
        picks: list[tuple[int, int]] = []  # (dataset, window start) of this rank's rows
        for j in range(self.micro_batch * self.world_size):
            d = self.dataset_of(self.position + j)
            k = self.counts[d]
            self.counts[d] += 1
            if j in mine:
                picks.append((d, self.orders[d].start(k)))
        self.position += self.micro_batch * self.world_size
        shards = [self.sources[d].shards for d, _ in picks]
        starts = [s for _, s in picks]
        windows = np.stack([sh.read(s, self.seq_len + 1) for sh, s in zip(shards, starts, strict=True)])
        return windows_batch(windows, shards, starts, self.packing)
