"""Optimizer construction: AdamW (fused on CUDA), 8-bit AdamW, Muon with AdamW, over the parameter groups of
train/param_groups.py; and setting the learning rate the schedule (hopperlm/schedule.py) gives each step."""

from __future__ import annotations

import torch
import torch.nn as nn

from hopperlm.config import MuonConfig, OptimConfig
from hopperlm.model.qlora import require_bitsandbytes
from hopperlm.plan.choices import muon_ns_for
from hopperlm.schedule import MuonSchedule
from hopperlm.train.muon import POLAR_EXPRESS, Muon
from hopperlm.train.param_groups import optimizer_groups


def build_optimizer(
    model: nn.Module,
    cfg: OptimConfig,
    fused: bool,
    name: str = "adamw",
    muon: MuonConfig | None = None,
    ns_precision: str | None = None,
) -> torch.optim.Optimizer | OptimizerPair:
    """The optimizer the plan chose (`name`): AdamW (fused on CUDA when `fused`), torchao's 8-bit AdamW,
    bitsandbytes' paged 8-bit AdamW, or Muon on the blocks' matrices (with `muon`, its section; default
    MuonConfig()) and AdamW for the rest. Its groups come from train/param_groups.py: the parametrization's
    factors and the recipe's optim.groups. `ns_precision`: Muon's Newton–Schulz precision, the plan's
    (plan.muon_ns); None: the one the model's device runs fast (plan/choices.py's muon_ns_for)."""
    betas = tuple(cfg.betas)
    muon = (muon or MuonConfig()) if name == "muon" else None
    groups = optimizer_groups(model, cfg, muon)
    if name == "paged_adamw8bit":  # QLoRA's optimizer (Dettmers et al. 2023)
        bnb = require_bitsandbytes()
        return bnb.optim.PagedAdamW8bit(groups.adamw, lr=cfg.lr, betas=betas, eps=cfg.eps)
    if name == "adamw8bit":
        from torchao.optim import AdamW8bit

        return AdamW8bit(groups.adamw, lr=cfg.lr, betas=betas, eps=cfg.eps)
    kwargs = {"fused": True} if fused else {}
    adamw = torch.optim.AdamW(groups.adamw, lr=cfg.lr, betas=betas, eps=cfg.eps, **kwargs)
    if muon is None:
        return adamw
    adjust = "match_rms_adamw" if muon.lr_adjust == "match_rms_adamw" else "original"
    built = Muon(
        groups.muon,
        lr=cfg.lr,
        momentum=muon.momentum_start if muon.momentum_warmup_steps else muon.momentum,
        adjust_lr_fn=adjust,
        ns_schedule=POLAR_EXPRESS if muon.ns == "polar_express" else None,
        normuon_beta2=muon.normuon_beta2 if muon.normuon else None,
        cautious=muon.cautious_weight_decay,
        ns_safety=muon.ns_safety,
        ns_precision=ns_precision or muon_ns_for(next(model.parameters()).device.type),
    )
    return OptimizerPair(built, adamw)


def set_muon_schedule(optimizer, schedule: MuonSchedule) -> None:
    """Muon's momentum and weight-decay factor for this step (schedule.py's muon_schedule_at), on hopperlm's
    Muon alone or in its pair; other optimizers have neither."""
    members = optimizer.optimizers if isinstance(optimizer, OptimizerPair) else (optimizer,)
    for opt in members:
        if isinstance(opt, Muon):
            opt.decay_factor = schedule.decay_factor
            for group in opt.param_groups:
                group["momentum"] = schedule.momentum


class OptimizerPair:
    """Two optimizers over disjoint parameters, driven as one: the loop sets `lr` on every param group and
    `found_inf` on both, steps, zeroes and checkpoints them together."""

    def __init__(self, first: torch.optim.Optimizer, second: torch.optim.Optimizer) -> None:
        self.optimizers = (first, second)

    @property
    def found_inf(self) -> torch.Tensor | None:
        return getattr(self.optimizers[0], "found_inf", None)

    @found_inf.setter
    def found_inf(self, flag: torch.Tensor | None) -> None:
        # each member drops the step on the device if it honours the flag (train/step.py's honours_found_inf)
        for opt in self.optimizers:
            opt.found_inf = flag

    @property
    def param_groups(self) -> list[dict]:
        # read through every time: load_state_dict replaces each optimizer's group dicts
        return [group for opt in self.optimizers for group in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"pair": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        if "pair" not in state or len(state["pair"]) != len(self.optimizers):
            raise ValueError("the saved optimizer state is not a Muon + AdamW pair")
        for opt, sub in zip(self.optimizers, state["pair"], strict=True):
            opt.load_state_dict(sub)


def set_lr(optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group, times its factor where it has one
    (`lr_scale`: μP's and optim.groups', train/param_groups.py) (torchao's 8-bit AdamW keeps the LR as a tensor)."""
    for group in optimizer.param_groups:
        value = lr * group.get("lr_scale", 1.0)
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(value)
        else:
            group["lr"] = value
