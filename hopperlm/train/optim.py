"""Optimizer construction: parameter groups, AdamW (fused on CUDA), 8-bit AdamW, Muon with AdamW, and setting
the learning rate the schedule (hopperlm/schedule.py) gives each step."""

from __future__ import annotations

import torch
import torch.nn as nn

from hopperlm.config import OptimConfig
from hopperlm.model.qlora import require_bitsandbytes


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
    paged 8-bit AdamW, or Muon on the blocks' matrices with AdamW for the rest."""
    betas = (cfg.beta1, cfg.beta2)
    if name == "paged_adamw8bit":  # QLoRA's optimizer (Dettmers et al. 2023)
        bnb = require_bitsandbytes()
        groups = param_groups(model, cfg.weight_decay)
        return bnb.optim.PagedAdamW8bit(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    if name == "adamw8bit":
        from torchao.optim import AdamW8bit

        return AdamW8bit(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=betas, eps=cfg.eps)
    if name == "muon":
        # Muon orthogonalises 2-D updates: the blocks' weight matrices. Embeddings, the LM head and norms
        # keep AdamW (as in modded-nanogpt and Moonlight). match_rms_adamw scales Muon's step to AdamW's RMS,
        # so one optim.lr serves both.
        hidden = [
            p
            for n, p in model.named_parameters()
            if p.requires_grad and p.ndim == 2 and n.startswith("layers.")
        ]
        hidden_ids = {id(p) for p in hidden}
        muon = torch.optim.Muon(
            hidden,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            momentum=cfg.muon_momentum,
            adjust_lr_fn="match_rms_adamw",
        )
        rest = [
            {**g, "params": [p for p in g["params"] if id(p) not in hidden_ids]}
            for g in param_groups(model, cfg.weight_decay)
        ]
        adamw = torch.optim.AdamW(
            rest, lr=cfg.lr, betas=betas, eps=cfg.eps, **({"fused": True} if fused else {})
        )
        return OptimizerPair(muon, adamw)
    kwargs = {"fused": True} if fused else {}
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=betas, eps=cfg.eps, **kwargs
    )


class OptimizerPair:
    """Two optimizers over disjoint parameters, driven as one: the loop sets `lr` on every param group,
    steps, zeroes and checkpoints them together."""

    def __init__(self, first: torch.optim.Optimizer, second: torch.optim.Optimizer) -> None:
        self.optimizers = (first, second)

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
    """Set the learning rate of every parameter group (torchao's 8-bit AdamW keeps it as a tensor)."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
