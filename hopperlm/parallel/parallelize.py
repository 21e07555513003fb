"""Data parallelism on torch.distributed, chosen by the plan and applied after the speed-ups, in torchtitan's
order:

    float8 -> fused loss -> activation checkpointing -> torch.compile (speed/)  ->  DDP or FSDP2 (here)

Strategies (`parallel.strategy`, plan.strategy):
  none  one process
  ddp   DistributedDataParallel: every rank holds a replica; gradients are all-reduced in buckets while the
        backward runs, on the last micro-batch of each step only (`no_sync` on the others)
  fsdp  FSDP2 `fully_shard` on every block, then on the root: parameters, gradients and optimizer state are
        sharded over all ranks; a block's weights are all-gathered just before it runs and freed after it;
        gradients are reduce-scattered after every micro-batch, so only sharded gradients are kept between
        micro-batches. On GPUs: bf16 parameters for compute, fp32 gradient reduction
        (MixedPrecisionPolicy); with tensorwise float8 the weights are all-gathered in float8
        (torchao's enable_fsdp_float8_all_gather) and their scales precomputed after each optimizer step
  hsdp  FSDP2 on a 2-D mesh (replicate x shard): sharded within groups of `parallel.shard_size` ranks (one
        node by default), replicated across groups; the cross-group all-reduce runs on the last micro-batch
`auto`: none for one process; with several, DDP when the model, its gradients and AdamW state and one
sequence fit one device (memory.py's estimate), FSDP otherwise; the plan chooses (plan/strategy.py) and says
which and why.

LoRA/QLoRA: DDP buckets only parameters that require gradients, so only the adapters' gradients cross ranks.
FSDP2 shards the frozen base with the adapters (per-parameter sharding: frozen and trainable parameters share
a block's unit) and reduce-scatters the adapters' gradients only. QLoRA's NF4 data is stored in the dtype FSDP2
gathers in (train/initial_model.py, model/qlora.py), so the mixed-precision cast leaves it as it is.
bitsandbytes' paged optimizer steps plain tensors, not DTensor shards: refused under fsdp/hsdp.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn

from hopperlm.parallel.runtime import Runtime
from hopperlm.plan import SHARDED, Plan, Strategy


@dataclass
class Parallel:
    """The model as the training step uses it: `module` is what the forward goes through (the DDP wrapper, or
    the model itself, sharded in place by FSDP2)."""

    strategy: Strategy
    module: nn.Module
    fp8_all_gather: bool = False
    world_size: int = 1  # the ranks whose gradients are averaged

    def grad_sync(self, last: bool) -> AbstractContextManager:
        """Around a micro-batch's forward and backward: gradients cross ranks on the last one only (DDP), or
        across replica groups on the last one only (HSDP)."""
        if self.strategy == "ddp" and not last:
            return self.module.no_sync()
        if self.strategy == "hsdp":
            self.module.set_requires_all_reduce(last)
        return nullcontext()

    def clip_grad_norm_(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """The global gradient norm (before clipping) as a plain tensor, for every strategy."""
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def after_optimizer_step(self) -> None:
        if self.fp8_all_gather:  # one all-reduce for every float8 weight's scale, instead of one per layer
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(self.module)

    def grad_scaler(self, loss_scaling: bool):
        """fp16's loss scaler; with sharded gradients the inf/NaN check must cover every shard."""
        if not loss_scaling:
            return None
        if self.strategy in SHARDED:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler("cuda")
        return torch.amp.GradScaler("cuda")


def device_mesh(plan: Plan, rt: Runtime):
    from torch.distributed.device_mesh import init_device_mesh

    kind = plan.device.type
    if plan.strategy == "hsdp":
        shape = (rt.world_size // plan.dp_shard, plan.dp_shard)
        return init_device_mesh(kind, shape, mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(kind, (rt.world_size,), mesh_dim_names=("shard",))


def parallelize(
    model: nn.Module, plan: Plan, rt: Runtime, log: Callable[[str], None], *, fp8_all_gather: bool = False
) -> Parallel:
    """Wrap (DDP) or shard in place (FSDP2/HSDP) the model, after apply_speedups; none: the model as it is.
    `fp8_all_gather`: the plan's, if float8 is in effect after the speed-ups."""
    if plan.strategy == "none":
        return Parallel("none", model)
    if plan.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        with warnings.catch_warnings():  # torch 2.13 renames broadcast_buffers; 2.11 knows only this name
            warnings.filterwarnings("ignore", message=".*broadcast_buffers", category=FutureWarning)
            ddp = DistributedDataParallel(
                model,
                device_ids=[plan.device.index] if plan.device.type == "cuda" else None,
                broadcast_buffers=False,  # the RoPE tables are the only buffers, identical everywhere
                gradient_as_bucket_view=True,  # gradients live in the all-reduce buckets: no second copy
            )
        log(f"parallel: DDP over {rt.world_size} ranks ({rt.backend})")
        return Parallel("ddp", ddp, world_size=rt.world_size)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = device_mesh(plan, rt)
    if plan.autocast_dtype is not None:
        # blocks keep their fp32 RoPE tables as inputs (cast_forward_inputs off); the root casts nothing
        # floating either (its inputs are token ids)
        mp = MixedPrecisionPolicy(
            param_dtype=plan.autocast_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    else:
        mp = MixedPrecisionPolicy()
    last = len(model.layers) - 1
    for i, block in enumerate(model.layers):
        # the last block's weights are needed again at once by the backward: keep them gathered
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < last)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    shape = " x ".join(str(s) for s in mesh.shape)
    log(
        f"parallel: {plan.strategy.upper()} over {rt.world_size} ranks (mesh {shape}, {rt.backend}), "
        f"{len(model.layers)} blocks + root sharded"
        + (f", {plan.autocast_dtype} params / fp32 gradient reduction" if plan.autocast_dtype else "")
        + (", float8 all-gather" if fp8_all_gather else "")
    )
    return Parallel(plan.strategy, model, fp8_all_gather, rt.world_size)
