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


def batch_doc_ids(shards: list, starts, x: np.ndarray) -> np.ndarray:
    """(B, T) document numbers for the inputs x (B, T) of windows read from shards[i] at starts[i].

    Fast path (vectorised over the batch): when prepare found that the document format's one separator id
    occurs only between documents (manifest "document_format": "marks_documents"), a document starts right
    after every EOS (the eos format) or at every BOS (the tokenizer format of Llama tokenizers). Otherwise, and
    when the rows come from datasets of different formats, the per-shard document index says where, row by
    row."""
    boundaries = {s.boundary for s in shards}
    if len(boundaries) == 1 and None not in boundaries:
        token, shift = boundaries.pop()
        hit = x == token
        marks = np.zeros(x.shape, dtype=np.int64)
        marks[:, 1:] = hit[:, :-1] if shift else hit[:, 1:]
        return np.cumsum(marks, axis=1)
    return np.stack([window_doc_ids(sh, int(s), x.shape[1]) for sh, s in zip(shards, starts, strict=True)])
