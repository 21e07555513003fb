"""Optimizer construction: parameter groups, AdamW (fused on CUDA), 8-bit AdamW, Muon with AdamW, and setting
the learning rate the schedule (hopperlm/schedule.py) gives each step."""

from __future__ import annotations

import torch
import torch.nn as nn

from hopperlm.config import OptimConfig
from hopperlm.model.completep import eps_scaled
from hopperlm.model.mup import named_params, scaled_groups
from hopperlm.model.qlora import require_bitsandbytes
from hopperlm.model.transformer import parameter_shapes
from hopperlm.schedule import MuonSchedule
from hopperlm.train.muon import POLAR_EXPRESS, Muon


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: norms, biases and embeddings get none (a tied head is the embedding)."""
    no_decay_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    seen = set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 and id(p) not in no_decay_ids else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, fused: bool, name: str = "adamw"
) -> torch.optim.Optimizer | OptimizerPair:
    """The optimizer the plan chose: AdamW (fused on CUDA when `fused`), torchao's 8-bit AdamW, bitsandbytes'
    paged 8-bit AdamW, or Muon on the blocks' matrices with AdamW for the rest. Each group carries the
    parametrization's factors: μP's learning rate and weight decay (model/mup.py), CompleteP's epsilon
    (model/completep.py); unchanged under standard."""
    betas = (cfg.beta1, cfg.beta2)
    groups = param_groups(model, cfg.weight_decay)
    muon_ids: frozenset[int] = frozenset()
    if name == "muon":
        # Muon orthogonalises 2-D updates: the blocks' weight matrices. Embeddings, the LM head and norms
        # keep AdamW (as in modded-nanogpt and Moonlight). match_rms_adamw scales Muon's step to AdamW's RMS,
        # so one optim.lr serves both; spectral is torch's original rule, scaled to agree at base width.
        hidden = [
            p
            for n, p in model.named_parameters()
            if p.requires_grad and p.ndim == 2 and n.startswith("layers.")
        ]
        muon_ids = frozenset(id(p) for p in hidden)
        decay = cfg.weight_decay if cfg.muon_weight_decay is None else cfg.muon_weight_decay
        muon_groups = width_scaled(model, [{"params": hidden, "weight_decay": decay}], cfg, muon_ids)
        groups = [{**g, "params": [p for p in g["params"] if id(p) not in muon_ids]} for g in groups]
    groups = role_scaled(model, eps_scaled(model, width_scaled(model, groups, cfg, muon_ids), cfg.eps), cfg)
    if name == "paged_adamw8bit":  # QLoRA's optimizer (Dettmers et al. 2023)
        bnb = require_bitsandbytes()
        return bnb.optim.PagedAdamW8bit(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    if name == "adamw8bit":
        from torchao.optim import AdamW8bit

        return AdamW8bit(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    kwargs = {"fused": True} if fused else {}
    adamw = torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, **kwargs)
    if name != "muon":
        return adamw
    adjust = "match_rms_adamw" if cfg.muon_lr_adjust == "match_rms_adamw" else "original"
    muon = Muon(
        muon_groups,
        lr=cfg.lr,
        momentum=cfg.muon_momentum_start if cfg.muon_momentum_warmup_steps else cfg.muon_momentum,
        adjust_lr_fn=adjust,
        ns_schedule=POLAR_EXPRESS if cfg.muon_ns == "polar_express" else None,
        normuon_beta2=cfg.normuon_beta2 if cfg.normuon else None,
        cautious=cfg.cautious_weight_decay,
    )
    return OptimizerPair(muon, adamw)


def role_scaled(model: nn.Module, groups: list[dict], cfg: OptimConfig) -> list[dict]:
    """The groups with the input embedding at optim.embed_lr and an untied LM head at optim.head_lr: each
    role's ratio to optim.lr multiplies its groups' `lr_scale` (on top of μP's factor), so set_lr gives it the
    schedule's shape at its own peak. Weight decay keeps its value, as a per-group LR in torch's AdamW: the
    decay per step is that LR x weight decay. Unchanged when neither is set or the model has no such parts."""
    ratios = {
        "embed.weight": (cfg.embed_lr or cfg.lr) / cfg.lr,
        "lm_head.weight": (cfg.head_lr or cfg.lr) / cfg.lr,
    }
    by_id = {id(p): ratios[name] for name, p in named_params(model) if name in ratios and ratios[name] != 1.0}
    if not by_id:
        return groups
    out = []
    for group in groups:
        split: dict[float, list] = {}
        for p in group["params"]:
            split.setdefault(by_id.get(id(p), 1.0), []).append(p)
        for ratio, params in split.items():
            out.append({**group, "params": params, "lr_scale": group.get("lr_scale", 1.0) * ratio})
    return out


def set_muon_schedule(optimizer, schedule: MuonSchedule) -> None:
    """Muon's momentum and weight-decay factor for this step (schedule.py's muon_schedule_at), on hopperlm's
    Muon alone or in its pair; other optimizers have neither."""
    members = optimizer.optimizers if isinstance(optimizer, OptimizerPair) else (optimizer,)
    for opt in members:
        if isinstance(opt, Muon):
            opt.decay_factor = schedule.decay_factor
            for group in opt.param_groups:
                group["momentum"] = schedule.momentum


def width_scaled(model: nn.Module, groups: list[dict], cfg: OptimConfig, muon_ids=frozenset()) -> list[dict]:
    """The groups split by learning-rate factor: under model.parametrization mup, and Muon's spectral adjustment
    of its matrices (`muon_ids`); unchanged otherwise, and for a model that is not hopperlm's Transformer."""
    return scaled_groups(
        model, groups, parameter_shapes, muon_lr_adjust=cfg.muon_lr_adjust, muon_ids=muon_ids
    )


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
    """Set the learning rate of every parameter group, times its μP factor (`lr_scale`, model/mup.py) where it
    has one (torchao's 8-bit AdamW keeps the LR as a tensor)."""
    for group in optimizer.param_groups:
        value = lr * group.get("lr_scale", 1.0)
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(value)
        else:
            group["lr"] = value
