"""Validation loss during training: the same fixed windows every time, split over ranks under torchrun."""

from __future__ import annotations

import torch

from hopperlm.data.loader import TokenShards, read_batch
from hopperlm.model.loss import IGNORE_INDEX
from hopperlm.parallel.runtime import Runtime
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
    """Mean loss per learned token over fixed validation windows (the same windows every time, in every run).
    With several ranks each evaluates every world_size-th window and the sums are added up; every rank runs
    the same number of forwards (FSDP gathers weights in lockstep). Every forward sees exactly B rows, so a
    compiled model never recompiles (nor autotunes again) for a short last batch: the rows a batch lacks (the
    last one, a rank short of windows) repeat a window with every target ignored, adding nothing."""
    was_training = model.training
    model.eval()
    T, B = plan.seq_len, micro_batch or plan.micro_batch
    rank, world = (rt.rank, rt.world_size) if rt is not None else (0, 1)
    mine = starts[rank::world]
    total = torch.zeros(2, device=plan.device)  # loss summed over the learned tokens, their count
    for i in range(0, -(-len(starts) // world), B):
        chunk = list(mine[i : i + B])
        rows = chunk + [(chunk or starts)[0]] * (B - len(chunk))
        # instruction data (data/sft.py) reads rows of whole examples, token data windows
        batch = data.read_rows(rows) if hasattr(data, "read_rows") else read_batch(data, rows, T, packing)
        batch.y[len(chunk) :] = IGNORE_INDEX  # padding rows: no loss, and the model's mean is over the rest
        batch = batch.to(plan.device)
        with plan.autocast(), plan.sdpa_backends():
            loss = model(batch.x, batch.y, **batch.model_kwargs)
        # weighted by its learned tokens (instruction rows differ), so the mean does not depend on how the
        # windows are batched or split over ranks; an all-padding batch's mean is 0/0, hence the where
        learned = (batch.y != IGNORE_INDEX).sum()
        total += torch.stack([torch.where(learned > 0, loss.float() * learned, 0.0), learned.float()])
    model.train(was_training)
    if world > 1:
        rt.all_reduce(total)
    loss_sum, learned = total.tolist()
    return loss_sum / learned
