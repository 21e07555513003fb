"""An out-of-memory error in a training step: the micro-batch halves and accumulation doubles (the global
batch, and so the run's data, stays the same), then the step is redone; where that cannot be done, the run
stops with one line naming the settings that would fit."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hopperlm.errors import HopperError

if TYPE_CHECKING:  # (the Run is built in train/run.py)
    from hopperlm.train.run import Run


class OutOfMemory(HopperError):
    """Out of memory where the micro-batch cannot be halved: at 1 (or odd), with several ranks, or under CUDA
    graphs."""


def back_off(run: Run) -> None:
    """After an out-of-memory error: free what the failed step held, halve the micro-batch and double the
    accumulation, then the loop redoes the step. Under CUDA graphs the run stops instead: accumulating into
    gradients a graph owns is unsafe (plan/make.py)."""
    s, rt = run.state, run.rt
    run.parts.optimizer.zero_grad(set_to_none=True)
    if run.plan.device.type == "cuda":
        torch.cuda.empty_cache()
    if run.parts.mark_step is not None:  # the step runs CUDA graphs (compile mode reduce-overhead)
        fresh = (
            f", or start afresh with --train.micro_batch {s.micro_batch // 2}" if s.micro_batch > 1 else ""
        )
        raise OutOfMemory(
            f"out of memory at step {s.step + 1} with micro-batch {s.micro_batch} under CUDA graphs: halving "
            "it would double accumulation into gradients a CUDA graph owns (pytorch/pytorch#169545); resume "
            f"with --train.compile_mode default (an out-of-memory error then halves the micro-batch){fresh}"
        ) from None
    if s.micro_batch == 1 or s.micro_batch % 2 or rt.world_size > 1:
        # (several ranks must change the micro-batch together: not attempted, the run stops)
        raise OutOfMemory(
            f"out of memory at step {s.step + 1} with micro-batch {s.micro_batch}"
            f"{f' on rank {rt.rank}' if rt.world_size > 1 else ''}; use a smaller --train.micro_batch,"
            " --train.activation_checkpointing full, a shorter train.seq_len, or FSDP"
        ) from None
    s.micro_batch, s.grad_accum = s.micro_batch // 2, s.grad_accum * 2
    run.batches.set_micro_batch(s.micro_batch, s.grad_accum)
    run.log(
        f"out of memory at step {s.step + 1}: micro-batch halved to {s.micro_batch}, accumulation "
        f"doubled to {s.grad_accum} (global batch unchanged); redoing the step"
    )
