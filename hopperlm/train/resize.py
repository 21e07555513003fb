"""A pretrained model meets an extended tokenizer: new embedding and LM-head rows, and where they start.

`tokenizer extend` appends new pieces after the base vocabulary (every old id keeps its meaning), so the old
rows of the embedding and the LM head load unchanged and only rows [base_rows, vocab_size) are new. Each new
row starts as the mean of the rows of the pieces its text decomposes into under the base tokenizer (for a
Tigrinya word piece: the byte-fallback pieces of its UTF-8), the start that keeps the new token's meaning
closest to what the model already computes for the same text (Hewitt 2021; Gee et al. 2022). Rows past
the tokenizer's vocabulary (padding to a multiple of 64) and pieces with no decomposition get the mean of
all old rows. Old-token outputs are unchanged by construction: their logits over the old vocabulary are the
base model's, exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hopperlm.data.tokenizer import HFTokenizer, Tokenizer

SPACE_MARK = "\u2581"


def decompositions(tokenizer: Tokenizer, base: Tokenizer, base_rows: int, rows: int) -> list[list[int]]:
    """For each new id in [base_rows, rows): the base ids its text encodes to ([] = no decomposition)."""
    continuation = base.continuation() if isinstance(base, HFTokenizer) else None
    out = []
    for i in range(base_rows, rows):
        piece = tokenizer.id_to_piece(i) if i < tokenizer.vocab_size else None
        if piece is None:
            out.append([])
            continue
        if continuation is not None:  # SentencePiece style: the piece's own text, no start-of-text mark added
            ids = continuation.encode(piece.replace(SPACE_MARK, " "))
        else:
            ids = base.encode(tokenizer.decode([i]))
        out.append([t for t in ids if t < base_rows])
    return out


@torch.no_grad()
def init_new_rows(model: torch.nn.Module, base_rows: int, sources: list[list[int]]) -> int:
    """Set rows [base_rows, vocab) of the embedding and (untied) LM head from `sources` (see module doc);
    returns how many rows had a decomposition."""
    weights = [model.embed.weight]
    if not model.cfg.tie_embeddings:
        weights.append(model.lm_head.weight)
    decomposed = 0
    for w in weights:
        mean = w[:base_rows].float().mean(dim=0)
        for offset, ids in enumerate(sources):
            row = w[ids].float().mean(dim=0) if ids else mean
            w[base_rows + offset] = row.to(w.dtype)
    decomposed = sum(1 for ids in sources if ids)
    return decomposed


def resize_for_tokenizer(
    model: torch.nn.Module,
    base_rows: int,
    tokenizer: Tokenizer,
    base_tokenizer: Tokenizer | None,
    log: Callable[[str], None],
) -> None:
    """Initialise the rows the base did not have, and say how."""
    rows = model.cfg.vocab_size
    if base_rows >= rows:
        return
    if base_tokenizer is None:
        sources: list[list[int]] = [[] for _ in range(base_rows, rows)]
        how = "the mean embedding (the base has no tokenizer to decompose new pieces with)"
    else:
        sources = decompositions(tokenizer, base_tokenizer, base_rows, rows)
        how = "the mean of the base pieces each new token decomposes into"
    done = init_new_rows(model, base_rows, sources)
    log(
        f"vocabulary {base_rows:,} -> {rows:,}: {rows - base_rows:,} new embedding/LM-head rows from {how} "
        f"({done:,} decomposed, {rows - base_rows - done:,} from the mean of all rows)"
    )
