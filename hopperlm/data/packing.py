"""Packing with document masks: which document each token of a packed window belongs to.

Windows are cut from the token stream regardless of document boundaries (no padding, no token wasted); the
per-shard document index (shards.py) says where documents start inside a window. The model turns these
numbers into attention that stays inside each document and RoPE positions that restart at each document
(model/attention.py).
"""

from __future__ import annotations

import numpy as np


def window_doc_ids(shards, start: int, seq_len: int) -> np.ndarray:
    """(seq_len,) int64: 0 for the (maybe partial) first document of tokens [start, start+seq_len), +1 at every
    document start after it."""
    marks = np.zeros(seq_len, dtype=np.int64)
    starts = shards.doc_starts(start, seq_len)
    marks[starts[starts > 0]] = 1
    return np.cumsum(marks)


def batch_doc_ids(shards, starts: list[int], seq_len: int) -> np.ndarray:
    """(len(starts), seq_len) document numbers for the inputs x of windows starting at `starts`."""
    return np.stack([window_doc_ids(shards, int(s), seq_len) for s in starts])
