"""Memory-mapped shards and reproducible batches, on Tiny Shakespeare prepared into several shards."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from shared_data import DATA_DIR

from hopperlm.data.loader import RandomWindows, TokenShards, eval_windows
from hopperlm.data.prepare import PrepareOptions, prepare
from hopperlm.errors import DataError

SHAKESPEARE = DATA_DIR / "tinyshakespeare" / "input.txt"
SHARD = 300_000


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("loader") / "ts"
    prepare([SHAKESPEARE], out, PrepareOptions(shard_tokens=SHARD), progress=False)
    return out


@pytest.fixture(scope="module")
def corpus() -> np.ndarray:
    """The byte stream prepare must have written: the file's bytes then EOS (256)."""
    return np.append(np.frombuffer(SHAKESPEARE.read_bytes(), dtype=np.uint8).astype(np.int64), 256)


def test_lengths_and_read_across_shard_boundaries(prepared, corpus):
    train, val = TokenShards(prepared, "train"), TokenShards(prepared, "val")
    assert (len(train), len(val)) == (1_003_855, 111_540)
    got = train.read(SHARD - 10, 20)
    assert got.dtype == np.int64
    assert np.array_equal(got, corpus[SHARD - 10 : SHARD + 10])
    # One read spanning three shard boundaries equals the concatenation.
    assert np.array_equal(train.read(SHARD - 5, 2 * SHARD + 10), corpus[SHARD - 5 : 3 * SHARD + 5])
    assert np.array_equal(train.read(len(train) - 3, 3), corpus[len(train) - 3 : len(train)])
    assert np.array_equal(val.read(0, len(val)), corpus[len(train) :])
    with pytest.raises(IndexError):
        train.read(len(train) - 2, 3)


def test_random_windows_are_a_pure_function_of_seed_step_micro(prepared, corpus):
    train = TokenShards(prepared, "train")
    windows = RandomWindows(train, seq_len=64, micro_batch=8, seed=1337)
    x, y = windows.batch(step=10, micro_step=0)
    assert x.shape == y.shape == (8, 64) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    again = RandomWindows(TokenShards(prepared, "train"), seq_len=64, micro_batch=8, seed=1337)
    x2, y2 = again.batch(step=10, micro_step=0)  # a fresh loader, as after a resume
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, windows.batch(step=11, micro_step=0)[0])
    assert not torch.equal(x, windows.batch(step=10, micro_step=1)[0])
    assert not torch.equal(x, RandomWindows(train, 64, 8, seed=1).batch(10, 0)[0])
    # Every row is a real contiguous slice of the corpus.
    text = corpus[: len(train)].astype(np.uint8).tobytes()
    for row_x, row_y in zip(x.numpy(), y.numpy(), strict=True):
        start = text.find(row_x.astype(np.uint8).tobytes())
        assert start >= 0 and corpus[start + 64] == row_y[-1]


def test_random_windows_stay_in_bounds(prepared, corpus):
    val = TokenShards(prepared, "val")
    whole = RandomWindows(val, seq_len=len(val) - 1, micro_batch=2, seed=0)  # exactly one possible window
    x, y = whole.batch(0, 0)
    assert np.array_equal(x[0].numpy(), corpus[-len(val) : -1]) and np.array_equal(
        y[1].numpy(), corpus[-len(val) + 1 :]
    )
    small = RandomWindows(val, seq_len=len(val) - 3, micro_batch=64, seed=0)  # three possible windows
    firsts = {int(row[0]) for step in range(5) for row in small.batch(step, 0)[0]}
    assert firsts == {int(t) for t in corpus[-len(val) : -len(val) + 3]}


def test_eval_windows(prepared):
    val = TokenShards(prepared, "val")
    all_starts = eval_windows(val, seq_len=256, max_windows=10_000)
    assert len(all_starts) == len(val) // 257 == 434
    assert all_starts == [i * 257 for i in range(434)]
    some = eval_windows(val, seq_len=256, max_windows=200)
    assert len(some) == 200 and some == eval_windows(val, seq_len=256, max_windows=200)
    assert set(some) <= set(all_starts)
    assert all(b - a >= 257 for a, b in zip(some, some[1:], strict=False))  # non-overlapping, in order
    assert some[0] == 0 and some[-1] + 257 <= len(val) and some[-1] >= 400 * 257  # spread over the split
    assert eval_windows(val, seq_len=256, max_windows=0) == []


def test_split_too_short(prepared):
    val = TokenShards(prepared, "val")
    for make in (lambda: RandomWindows(val, len(val), 1, 0), lambda: eval_windows(val, len(val), 10)):
        with pytest.raises(
            DataError, match=r"val split .* 111,540 tokens.*shorter train.seq_len or prepare more"
        ):
            make()


def test_verify_detects_a_flipped_byte(prepared, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    TokenShards(copy, "train", verify=True)  # intact copy verifies
    shard = copy / "train_000001.bin"
    data = bytearray(shard.read_bytes())
    data[12345] ^= 0x01
    shard.write_bytes(bytes(data))
    assert len(TokenShards(copy, "train")) == 1_003_855  # same size: only the checksum can tell
    with pytest.raises(
        DataError, match=r"train_000001.bin does not match its sha256.*re-run `hopperlm prepare"
    ):
        TokenShards(copy, "train", verify=True)


def test_size_mismatch_and_missing_shards(prepared, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    with open(copy / "val_000000.bin", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(DataError, match=r"val_000000.bin has 1000 bytes but the manifest says 111540"):
        TokenShards(copy, "val")
    (copy / "train_000002.bin").unlink()
    with pytest.raises(DataError, match="train_000002.bin listed in the manifest is missing"):
        TokenShards(copy, "train")
    with pytest.raises(DataError, match="has no manifest.json"):
        TokenShards(tmp_path, "train")
