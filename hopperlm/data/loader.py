"""Reading prepared token shards for training: memory-mapped, stateless, reproducible.

The default training batch for (step, micro_step) is a pure function of (seed, step, micro_step), the nanoGPT
recipe: random windows need no epoch bookkeeping, and a resumed run sees exactly the data it would have seen
without the interruption, with nothing to save but the step. Epoch order and mixtures (sampling.py) keep a
position that goes into the checkpoint instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hopperlm.data.shards import (
    INDEX_DTYPE,
    REPREPARE,
    DocumentFormat,
    index_name,
    read_manifest,
)
from hopperlm.errors import DataError
from hopperlm.files import file_sha256


@dataclass
class Batch:
    """One micro-batch: x and y (B, T) int64, y = x shifted left by one token; doc_ids (B, T) numbers the
    documents of each row when packing with document masks, else None.

    loss_share: the fraction of the whole step's learned tokens (every micro-batch of every rank) that this
    micro-batch holds, when they differ (instruction data: prompts and padding carry no loss). The step then
    weighs each micro-batch's mean loss by it, so the gradient is the mean over the step's tokens however the
    step is split into micro-batches and ranks. None: every micro-batch holds as many (1 / micro-batches)."""

    x: torch.Tensor
    y: torch.Tensor
    doc_ids: torch.Tensor | None = None
    loss_share: float | None = None

    @property
    def model_kwargs(self) -> dict:
        """Keyword arguments for the model beyond (x, y): doc_ids only when packing, so the default call
        stays model(x, y) for anything that wraps the forward."""
        return {} if self.doc_ids is None else {"doc_ids": self.doc_ids}

    def pin_memory(self) -> Batch:
        pin = lambda t: None if t is None else t.pin_memory()
        return Batch(pin(self.x), pin(self.y), pin(self.doc_ids), self.loss_share)

    def to(self, device: torch.device) -> Batch:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)
        return Batch(move(self.x), move(self.y), move(self.doc_ids), self.loss_share)


class TokenShards:
    """One split ("train" or "val") of a prepared data dir, memory-mapped (np.memmap, mode="r"), never read
    fully into RAM. Pages the OS has cached are shared between processes (e.g. data-parallel ranks)."""

    def __init__(self, data_dir: Path, split: str, verify: bool = False) -> None:
        self.data_dir = Path(data_dir)
        self.split = split
        manifest = read_manifest(self.data_dir)
        if split not in manifest["shards"]:
            raise DataError(
                f"{self.data_dir}/manifest.json has no {split!r} split; re-run `hopperlm prepare`"
            )
        self.dtype = np.dtype(manifest["dtype"])
        self.eos_id = manifest["eos_id"]
        self.has_index = all("docs" in s for s in manifest["shards"][split])  # format v2
        self.doc_format, marks = DocumentFormat.of_manifest(manifest)
        # (id, shift): a document starts at every position of this id plus shift (BOS: 0, EOS: 1), and nowhere
        # else, so packing may find documents from the tokens alone; None: only the .idx index says where
        self.boundary = self.doc_format.marker() if marks and self.has_index else None
        self.eos_marks_documents = self.boundary == (self.eos_id, 1)
        self._maps: list[np.memmap] = []
        self._index: list[np.ndarray] = []  # per shard: where documents start, local offsets
        starts = [0]
        for shard in manifest["shards"][split]:
            path = self.data_dir / shard["file"]
            self._check_file(
                path, shard["tokens"] * self.dtype.itemsize, f"{shard['tokens']} {self.dtype.name} tokens"
            )
            if verify and file_sha256(path) != shard["sha256"]:
                raise DataError(
                    f"shard {path} does not match its sha256 in the manifest (corrupt); {REPREPARE}"
                )
            if self.has_index:
                index = self.data_dir / index_name(shard["file"])
                self._check_file(
                    index, shard["docs"] * INDEX_DTYPE.itemsize, f"{shard['docs']} document starts"
                )
                if verify and file_sha256(index) != shard.get("index_sha256"):
                    raise DataError(
                        f"{index} does not match its sha256 in the manifest (corrupt); {REPREPARE}"
                    )
            if shard["tokens"] > 0:  # np.memmap cannot map an empty file
                self._maps.append(np.memmap(path, dtype=self.dtype, mode="r"))
                if self.has_index:
                    self._index.append(self._read_index(index, shard))
                starts.append(starts[-1] + shard["tokens"])
        self._starts = np.array(starts, dtype=np.int64)  # _starts[i] = first global index of shard i
        self._len = int(starts[-1])

    @staticmethod
    def _check_file(path: Path, expected: int, what: str) -> None:
        if not path.is_file():
            raise DataError(f"shard file {path} listed in the manifest is missing; {REPREPARE}")
        size = path.stat().st_size
        if size != expected:
            raise DataError(
                f"shard file {path} has {size} bytes but the manifest says {what} ({expected} bytes); "
                f"it is truncated or does not belong to this manifest, {REPREPARE}"
            )

    def _read_index(self, path: Path, shard: dict) -> np.ndarray:
        index = np.memmap(path, dtype=INDEX_DTYPE, mode="r") if shard["docs"] else np.zeros(0, INDEX_DTYPE)
        # cheap sanity check of the ends: a corrupt index would silently mis-mask attention
        if len(index) and (index[0] < 0 or index[-1] >= shard["tokens"]):
            raise DataError(f"document index {path} points outside its shard (corrupt); {REPREPARE}")
        return index

    def __len__(self) -> int:
        return self._len

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start+length) of the split as one int64 array, crossing shard boundaries."""
        if start < 0 or length < 0 or start + length > self._len:
            raise IndexError(
                f"read({start}, {length}) is outside the {self.split} split of {self._len} tokens"
            )
        out = np.empty(length, dtype=np.int64)
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        done = 0
        while done < length:
            offset = start + done - int(self._starts[i])
            take = min(length - done, len(self._maps[i]) - offset)
            out[done : done + take] = self._maps[i][offset : offset + take]
            done += take
            i += 1
        return out

    def doc_starts(self, start: int, length: int) -> np.ndarray:
        """Offsets in [0, length) of the window [start, start+length) where a document starts (sorted)."""
        if not self.has_index:
            raise DataError(
                f"{self.data_dir} was prepared without a document index (format v1); data.packing needs it, "
                f"{REPREPARE}"
            )
        out = []
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        end = start + length
        while i < len(self._maps) and self._starts[i] < end:
            base = int(self._starts[i])
            index = self._index[i]
            lo, hi = np.searchsorted(index, [max(start - base, 0), end - base])
            out.append(np.asarray(index[lo:hi]) + (base - start))
            i += 1
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def check_window(self, seq_len: int) -> None:
        """DataError unless the split holds at least one window of seq_len + 1 tokens."""
        if self._len < seq_len + 1:
            raise DataError(
                f"the {self.split} split of {self.data_dir} has {self._len:,} tokens, fewer than one "
                f"window of train.seq_len + 1 = {seq_len + 1:,}; "
                "use a shorter train.seq_len or prepare more data"
            )


def read_batch(shards: TokenShards, starts, seq_len: int, packing: bool = False) -> Batch:
    """The windows of seq_len + 1 tokens at `starts` as a Batch (doc_ids only when packing)."""
    windows = np.stack([shards.read(int(s), seq_len + 1) for s in starts])
    return windows_batch(windows, [shards] * len(windows), starts, packing)


def windows_batch(windows: np.ndarray, shards: list[TokenShards], starts, packing: bool) -> Batch:
    """A Batch from windows (B, T + 1) read from shards[i] at starts[i]."""
    x, y = torch.from_numpy(windows[:, :-1].copy()), torch.from_numpy(windows[:, 1:].copy())
    if not packing:
        return Batch(x, y)
    from hopperlm.data.packing import batch_doc_ids

    return Batch(x, y, torch.from_numpy(batch_doc_ids(shards, starts, windows[:, :-1])))


class RandomWindows:
    """nanoGPT-style random windows: the batch for (step, micro_step) is a pure function of
    (seed, step, micro_step), so resuming at a step reproduces exactly the same data with no saved loader
    state beyond the step. With packing, each batch also carries the windows' document numbers.

    Data-parallel ranks split one global micro-batch of micro_batch * world_size windows: rank r reads the
    block [r * micro_batch, (r + 1) * micro_batch) of it, so N ranks of micro-batch m see exactly the windows
    one process of micro-batch N * m sees."""

    def __init__(
        self,
        shards: TokenShards,
        seq_len: int,
        micro_batch: int,
        seed: int,
        packing: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        shards.check_window(seq_len)
        self.shards, self.seq_len, self.micro_batch, self.seed = shards, seq_len, micro_batch, seed
        self.packing, self.rank, self.world_size = packing, rank, world_size

    def starts(self, step: int, micro_step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step, micro_step])
        last_start = len(self.shards) - self.seq_len - 1
        every_rank = rng.integers(0, last_start, size=self.micro_batch * self.world_size, endpoint=True)
        return every_rank[self.rank * self.micro_batch : (self.rank + 1) * self.micro_batch]

    def batch(self, step: int, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), int64 of shape (micro_batch, seq_len); y is x shifted left by one token."""
        b = read_batch(self.shards, self.starts(step, micro_step), self.seq_len)
        return b.x, b.y

    def get(self, step: int, micro_step: int) -> Batch:
        """The same windows as batch(), as a Batch with doc_ids when packing."""
        if not self.packing:
            return Batch(*self.batch(step, micro_step))
        return read_batch(self.shards, self.starts(step, micro_step), self.seq_len, packing=True)


def eval_windows(shards: TokenShards, seq_len: int, max_windows: int) -> list[int]:
    """Start offsets of non-overlapping windows (each seq_len+1 tokens) that cover the split in order; if
    there are more than max_windows, take max_windows evenly spaced ones. Deterministic, so val losses of
    different runs are comparable."""
    shards.check_window(seq_len)
    span = seq_len + 1
    count = len(shards) // span
    if max_windows <= 0:
        return []
    if count <= max_windows:
        return [i * span for i in range(count)]
    return [(i * count // max_windows) * span for i in range(max_windows)]
