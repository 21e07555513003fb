"""Validation loss during training: the same fixed windows every time, split over ranks under torchrun."""

from __future__ import annotations

import torch

from hopperlm.data.loader import TokenShards, read_batch
from hopperlm.dist.runtime import Runtime
from hopperlm.plan import Plan


@torch.no_grad()
def evaluate(
    model,
    data: TokenShards,
    starts: list[int],
    plan: Plan,
    *,
    micro_batch: int | None = None,
    packing: bool = False,
    rt: Runtime | None = None,
) -> float:
    """Mean loss over fixed validation windows (the same windows every time, in every run). With several
    ranks each evaluates every world_size-th window and the sums are added up; every rank runs the same
    number of forwards (FSDP gathers weights in lockstep), a rank short of windows repeats one at weight 0."""
    was_training = model.training
    model.eval()
    T, B = plan.seq_len, micro_batch or plan.micro_batch
    rank, world = (rt.rank, rt.world_size) if rt is not None else (0, 1)
    mine = starts[rank::world]
    total = torch.zeros((), device=plan.device)
    for i in range(0, -(-len(starts) // world), B):
        chunk, weight = mine[i : i + B], len(mine[i : i + B])
        rows = chunk or starts[:1]
        if hasattr(data, "read_rows"):  # instruction data (data/sft.py): rows of whole examples
            batch = data.read_rows(rows).to(plan.device)
        else:
            batch = read_batch(data, rows, T, packing).to(plan.device)
        with plan.autocast(), plan.sdpa_backends():
            total += model(batch.x, batch.y, **batch.model_kwargs) * weight
    model.train(was_training)
    if world > 1:
        rt.all_reduce(total)
    return total.item() / len(starts)
