"""The training step: the only one. `hopperlm train`, `hopperlm bench` and the micro-batch finder all run
`train_step`, so a benchmark times what training does and the finder measures what training needs.

One step = `grad_accum` micro-batches (forward, backward; gradients cross ranks on the last one only), the
gradient norm clipped, then the optimizer update, or its skip when the loss or the gradient norm is not finite.
Nothing here waits on the host where it can be avoided: a fused AdamW on CUDA, hopperlm's Muon and their pair drop
a bad update on the device (`found_inf`); every other optimizer would apply it, so for those the finite flag is
read on the host first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from hopperlm.config import MuonConfig, OptimConfig
from hopperlm.data.loader import Batch
from hopperlm.errors import ConfigError
from hopperlm.parallel.parallelize import Parallel, parallelize
from hopperlm.parallel.runtime import Runtime, current
from hopperlm.plan import Plan
from hopperlm.schedule import MuonSchedule
from hopperlm.speed import apply_speedups
from hopperlm.speed.compile import uses_cuda_graphs
from hopperlm.train.muon import Muon
from hopperlm.train.optim import OptimizerPair, build_optimizer, set_lr, set_muon_schedule


def honours_found_inf(optimizer) -> bool:
    """True for the optimizers that read `found_inf` and drop the update on the device: torch's fused
    Adam/AdamW, hopperlm's Muon (train/muon.py), and a Muon + AdamW pair whose AdamW is fused. torch's Muon,
    torchao's and bitsandbytes' 8-bit AdamW and unfused AdamW ignore it and would apply a non-finite update."""
    if isinstance(optimizer, OptimizerPair):
        return all(honours_found_inf(opt) for opt in optimizer.optimizers)
    if isinstance(optimizer, Muon):
        return True
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and bool(
        optimizer.defaults.get("fused")
    )


def skip_on_device(optimizer, device: torch.device) -> bool:
    """Skip a bad update on the device (no host sync) only where the optimizer honours it; elsewhere the
    finite flag is read on the host (free on a CPU, one sync per step on a GPU)."""
    return device.type == "cuda" and honours_found_inf(optimizer)


@dataclass(frozen=True)
class StepParts:
    """What one optimizer step touches, built once per run (or per bench row, or per finder trial)."""

    parallel: Parallel  # .module runs the forward (DDP wrapper, FSDP-sharded or plain model)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None  # fp16's loss scaler
    params: list[nn.Parameter]  # what is clipped: the trainable parameters
    clip: float  # max gradient norm (inf: measured, not clipped)
    skip_on_device: bool  # skip_on_device(optimizer, device)
    plan: Plan  # autocast around each forward, the SDPA kernels around each forward and backward
    mark_step: Callable[[], None] | None = None  # CUDA graphs: outputs of the previous step may be reused

    @property
    def device(self) -> torch.device:
        return self.params[0].device


@dataclass
class StepResult:
    loss: (
        torch.Tensor
    )  # this rank's part of the step's mean loss (the mean over ranks is the step's), on the device
    grad_norm: torch.Tensor  # before clipping, global over ranks
    finite: torch.Tensor  # bool: the update was applied


@dataclass
class StepDropped:
    """A step given up at a micro-batch boundary (a preemption signal): nothing was applied."""

    at_micro: int  # micro-batches already run (their gradients discarded)
    grad_accum: int


def make_step_parts(
    model: nn.Module,
    parallel: Parallel,
    optimizer,
    *,
    plan: Plan,
    grad_clip: float,
    scaler: torch.amp.GradScaler | None = None,
) -> StepParts:
    """The step's parts for a model that went through apply_speedups and parallelize."""

    return StepParts(
        parallel=parallel,
        optimizer=optimizer,
        scaler=scaler,
        params=[p for p in model.parameters() if p.requires_grad],
        clip=grad_clip if grad_clip > 0 else float("inf"),
        skip_on_device=skip_on_device(optimizer, plan.device),
        plan=plan,
        mark_step=(
            torch.compiler.cudagraph_mark_step_begin
            if plan.compile and uses_cuda_graphs(plan.compile_mode)
            else None
        ),
    )


def build_step(
    model: nn.Module,
    plan: Plan,
    optim: OptimConfig,
    *,
    log: Callable[[str], None],
    rt: Runtime | None = None,
    muon: MuonConfig | None = None,
) -> tuple[StepParts, str]:
    """The speed-ups, the data-parallel wrapper, the optimizer and the loss scaler, in torchtitan's order
    (fp8 -> fused loss -> activation checkpointing -> compile -> DDP/FSDP2), for a model on plan.device.
    `muon`: the muon section, when plan.optimizer is Muon (default: its defaults).
    Returns the step's parts and the float8 backend in effect ("off" if the plan's failed at start-up)."""
    fp8 = apply_speedups(model, plan, log)  # in place
    parallel = parallelize(
        model, plan, rt or current(), log, fp8_all_gather=plan.fp8_all_gather and fp8 != "off"
    )
    optimizer = build_optimizer(
        model, optim, plan.fused_adamw, plan.optimizer, muon, ns_precision=plan.muon_ns
    )
    parts = make_step_parts(
        model,
        parallel,
        optimizer,
        plan=plan,
        grad_clip=optim.grad_clip,
        scaler=parallel.grad_scaler(plan.loss_scaling),
    )
    return parts, fp8


def loss_weight(batch: Batch, grad_accum: int, world_size: int) -> float:
    """What a micro-batch's mean loss counts for in its rank's step loss: 1/grad_accum when every micro-batch
    holds as many learned tokens; else its share of the step's tokens times the ranks (DDP and FSDP average
    the ranks' gradients), so the step's gradient is the mean over all its learned tokens, as in one process
    with one micro-batch (transformers#37766 is that bug)."""
    if batch.loss_share is None:
        return 1.0 / grad_accum
    return batch.loss_share * world_size


def train_step(
    parts: StepParts,
    next_batch: Callable[[int], Batch],
    *,
    grad_accum: int,
    lr: float,
    muon: MuonSchedule | None = None,
    interrupted: Callable[[], bool] | None = None,
) -> StepResult | StepDropped:
    """One optimizer step at learning rate `lr` (and Muon's momentum and weight-decay factor `muon`, where the
    schedule sets them): `grad_accum` micro-batches (`next_batch(i)` gives the i-th, on any device),
    clipping, and the update unless the loss or gradient is not finite. Returns device tensors. When
    `interrupted()` turns true before a micro-batch, the partial step is dropped: gradients cleared, no update,
    StepDropped returned (the weights and optimizer state are those of the last complete step)."""
    optimizer, scaler, parallel = parts.optimizer, parts.scaler, parts.parallel
    device = parts.device
    if parts.mark_step is not None and grad_accum > 1:
        # a second micro-batch would accumulate into .grad tensors the first one's CUDA graph owns and
        # overwrites on replay (pytorch/pytorch#169545, #96693): an error, never silently wrong gradients
        raise ConfigError(
            f"CUDA graphs (compile mode reduce-overhead) with {grad_accum} accumulation steps are unsafe "
            "(pytorch/pytorch#169545); use --train.compile_mode default or a micro-batch that needs none"
        )
    set_lr(optimizer, lr)
    if muon is not None:
        set_muon_schedule(optimizer, muon)
    step_loss = torch.zeros((), device=device)
    for micro in range(grad_accum):
        if interrupted is not None and interrupted():  # (a flag set by a signal handler: no device sync)
            optimizer.zero_grad(set_to_none=True)
            return StepDropped(micro, grad_accum)
        batch = next_batch(micro).to(device)  # non-blocking from pinned memory when planned
        if parts.mark_step is not None:  # CUDA graphs: the previous step's outputs may be overwritten now
            parts.mark_step()
        # DDP: all-reduce on the last only. A forced attention kernel holds through the backward as well:
        # activation checkpointing recomputes the forward there, and another kernel would save other tensors
        with parallel.grad_sync(last=micro == grad_accum - 1), parts.plan.sdpa_backends():
            with parts.plan.autocast():
                loss = parallel.module(batch.x, batch.y, **batch.model_kwargs) * loss_weight(
                    batch, grad_accum, parallel.world_size
                )
            (scaler.scale(loss) if scaler else loss).backward()
        step_loss += loss.detach()
    if scaler:
        scaler.unscale_(optimizer)
    grad_norm = parallel.clip_grad_norm_(parts.params, parts.clip)  # global: gradients synced or sharded
    if scaler:  # fp16: an inf/NaN scaled gradient is the scaler's (it skips and lowers the scale)
        finite = torch.isfinite(step_loss)
        scaler.step(optimizer)
        scaler.update()
    else:
        finite = torch.isfinite(step_loss) & torch.isfinite(grad_norm)
        if parts.skip_on_device:  # fused AdamW and Muon drop the update on the device when found_inf is 1
            optimizer.found_inf = (~finite).float()
            optimizer.step()
        elif finite.item():  # any other optimizer would apply it: decide on the host
            optimizer.step()
    parallel.after_optimizer_step()  # FSDP float8: precompute the weights' scales
    optimizer.zero_grad(set_to_none=True)
    return StepResult(step_loss, grad_norm, finite)
