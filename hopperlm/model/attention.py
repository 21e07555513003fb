"""Attention that never crosses a document boundary, for sequences packed from several documents.

A packed row holds the end of one document, whole documents, and the start of another; `doc_ids` (B, T) numbers
the documents of each row. Token i may attend to token j only when j <= i and both lie in the same document:
a block-diagonal causal mask. Two ways to run it, chosen once per forward by `document_mask`:

- CUDA with FlexAttention (torch.nn.attention.flex_attention): a `BlockMask` built from a document mask_mod
  by a compiled create_block_mask; blocks entirely outside every document are skipped, so packing costs no
  extra FLOPs.
- everywhere else (CPU, no FlexAttention, attention dropout): an explicit boolean (B, 1, T, T) mask through
  `scaled_dot_product_attention`; exact, but it materialises T x T per row, so it is the fallback.

The unmasked path (doc_ids is None) is not here: Attention keeps its fast `is_causal=True` SDPA call.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class DocumentMask:
    """What a forward pass needs to mask attention by document: exactly one of the two fields is set."""

    block_mask: Any = None  # a FlexAttention BlockMask (CUDA)
    dense: torch.Tensor | None = None  # (B, 1, T, T) bool, True = may attend


def flex_unavailable_reason(device: torch.device) -> str | None:
    """None when FlexAttention can serve document masks on `device`, else why not (one phrase)."""
    if device.type != "cuda":
        return f"FlexAttention kernels are compiled for CUDA, this is {device.type}"
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError as e:  # torch builds without it
        return f"torch {torch.__version__} has no FlexAttention ({e})"
    return None


def describe_backend(device: torch.device, dropout: float = 0.0) -> str:
    """The one line a run prints about how packed documents are kept apart on this device."""
    reason = flex_unavailable_reason(device)
    if reason is None and dropout == 0.0:
        return "document masks: FlexAttention BlockMask (blocks outside every document are skipped)"
    if reason is None:
        reason = "FlexAttention has no attention dropout"
    return f"document masks: boolean mask through SDPA ({reason})"


def positions_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """RoPE positions that restart at 0 where each document starts: (B, T) int64.

    doc_ids must be non-decreasing along each row (packing numbers documents in order)."""
    B, T = doc_ids.shape
    index = torch.arange(T, device=doc_ids.device).expand(B, T)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    # index of the latest document start at or before each position
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def dense_document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool: causal and within one document. The diagonal is always True, so no row is empty."""
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    return (same_doc & causal).unsqueeze(1)


def document_mask(doc_ids: torch.Tensor, dropout: float = 0.0) -> DocumentMask:
    """Build the mask once per forward pass; every layer reuses it."""
    if flex_unavailable_reason(doc_ids.device) is None and dropout == 0.0:
        # a new closure each forward: compiled creation reuses its graph (see _create_block_mask)
        def same_document(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

        B, T = doc_ids.shape
        return DocumentMask(
            block_mask=_create_block_mask()(same_document, B, None, T, T, device=doc_ids.device)
        )
    return DocumentMask(dense=dense_document_mask(doc_ids))


def _create_block_mask():
    """create_block_mask, compiled unless a compiled model is tracing it already (then it fuses into that
    graph). Eager, it materialises the (B, T, T) boolean mask through many small kernels every micro-batch;
    compiled, a few fused kernels reduce it to blocks without materialising it. Each forward's new
    `same_document` closure reuses the compiled graph: dynamo guards on its code and on the shape of the
    doc_ids it closes over, not on the closure's identity."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask if torch.compiler.is_compiling() else _compiled_create_block_mask()


@lru_cache(maxsize=1)
def _compiled_create_block_mask():
    """torch.compile(create_block_mask), as torchtitan and attention-gym build per-batch masks; torch 2.13
    deprecates create_block_mask(..., _compile=True) in favour of exactly this."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


@lru_cache(maxsize=1)
def _compiled_flex():
    """flex_attention only runs fused when compiled; compiling it alone also works inside a compiled model."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: Any,
    enable_gqa: bool,
    compiled: bool = True,
) -> torch.Tensor:
    """q (B, nh, T, hd), k/v (B, nkv, T, hd) -> (B, nh, T, hd) under a FlexAttention BlockMask."""
    if compiled:
        return _compiled_flex()(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: DocumentMask,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Attention restricted to each token's own document, through whichever form `mask` holds."""
    if mask.block_mask is not None:
        return flex_document_attention(q, k, v, mask.block_mask, enable_gqa)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask.dense, dropout_p=dropout_p, enable_gqa=enable_gqa
    )  # (B, nh, T, hd)
