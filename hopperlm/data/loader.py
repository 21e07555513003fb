"""Reading prepared token shards for training: memory-mapped, stateless, reproducible.

The training batch for (step, micro_step) is a pure function of (seed, step, micro_step), the nanoGPT recipe:
random windows need no epoch bookkeeping, and a resumed run sees exactly the data it would have seen
without the interruption, with nothing to save but the step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hopperlm.data.shards import file_sha256, read_manifest
from hopperlm.errors import DataError


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
        self._maps: list[np.memmap] = []
        starts = [0]
        for shard in manifest["shards"][split]:
            path = self.data_dir / shard["file"]
            fix = "re-run `hopperlm prepare --overwrite`"
            if not path.is_file():
                raise DataError(f"shard {path} listed in the manifest is missing; {fix}")
            expected = shard["tokens"] * self.dtype.itemsize
            if path.stat().st_size != expected:
                raise DataError(
                    f"shard {path} has {path.stat().st_size} bytes but the manifest says {shard['tokens']} "
                    f"{self.dtype.name} tokens ({expected} bytes); it is truncated or was changed, {fix}"
                )
            if verify and file_sha256(path) != shard["sha256"]:
                raise DataError(f"shard {path} does not match its sha256 in the manifest (corrupt); {fix}")
            if shard["tokens"] > 0:  # np.memmap cannot map an empty file
                self._maps.append(np.memmap(path, dtype=self.dtype, mode="r"))
                starts.append(starts[-1] + shard["tokens"])
        self._starts = np.array(starts, dtype=np.int64)  # _starts[i] = first global index of shard i
        self._len = int(starts[-1])

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

    def check_window(self, seq_len: int) -> None:
        """DataError unless the split holds at least one window of seq_len + 1 tokens."""
        if self._len < seq_len + 1:
            raise DataError(
                f"the {self.split} split of {self.data_dir} has {self._len:,} tokens, fewer than one "
                f"window of train.seq_len + 1 = {seq_len + 1:,}; "
                "use a shorter train.seq_len or prepare more data"
            )


class RandomWindows:
    """nanoGPT-style random windows: the batch for (step, micro_step) is a pure function of
    (seed, step, micro_step), so resuming at a step reproduces exactly the same data with no saved loader
    state beyond the step."""

    def __init__(self, shards: TokenShards, seq_len: int, micro_batch: int, seed: int) -> None:
        shards.check_window(seq_len)
        self.shards, self.seq_len, self.micro_batch, self.seed = shards, seq_len, micro_batch, seed

    def batch(self, step: int, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), int64 of shape (micro_batch, seq_len); y is x shifted left by one token."""
        rng = np.random.default_rng([self.seed, step, micro_step])
        last_start = len(self.shards) - self.seq_len - 1
        starts = rng.integers(0, last_start, size=self.micro_batch, endpoint=True)
        windows = np.stack([self.shards.read(int(s), self.seq_len + 1) for s in starts])
        return torch.from_numpy(windows[:, :-1].copy()), torch.from_numpy(windows[:, 1:].copy())


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
