"""Activation checkpointing: keep less for the backward, recompute it instead.

Modes (plan.activation_checkpointing):
  none             keep every activation (fastest when it fits)
  selective-op     per operator: keep the outputs of matmuls and attention, recompute the cheap elementwise
                   ops (norms, RoPE, SiLU, products) in the backward: most of the memory of `full`'s saving
                   on the elementwise tensors for a few percent of time (torchtitan's "op" SAC)
  selective-block  recompute every `every`-th block whole, keep the others
  full             recompute every block (keeps only each block's input): the least memory, ~30% more compute
The recompute function goes on each Block (`block.recompute`), so module names and checkpoints are unchanged,
and torch.compile traces through it when the block is compiled afterwards (apply order: fp8 -> AC -> compile).
"""

from __future__ import annotations

from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from hopperlm.plan.record import Checkpointing

MODES = ("none", "selective-op", "selective-block", "full")

_aten = torch.ops.aten
# Outputs worth keeping: each costs a matmul (or an attention pass) to recompute.
_SAVE_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten._scaled_mm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _op_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_op_policy)


def apply_activation_checkpointing(model: torch.nn.Module, mode: Checkpointing, every: int = 2) -> int:
    """Set the recompute function of each block for `mode`; returns how many blocks recompute."""
    if mode not in MODES:
        raise ValueError(f"unknown activation checkpointing mode {mode!r}; one of {MODES}")
    full = partial(checkpoint, use_reentrant=False)
    ops = partial(checkpoint, use_reentrant=False, context_fn=_selective_context)
    count = 0
    for i, block in enumerate(model.layers):
        if mode == "full" or (mode == "selective-block" and i % every == 0):
            block.recompute = full
        elif mode == "selective-op":
            block.recompute = ops
        else:
            block.recompute = None
        count += block.recompute is not None
    return count
