"""The optimizer's one call into the model's parametrization: `scaled_groups` gives an optimizer's parameter
groups each parameter's factors, μP's width rules (model/mup.py: learning rate and weight decay) and then
CompleteP's depth rule (model/completep.py: AdamW's epsilon inside the blocks). Under standard and at the base
shape nothing changes.

`split_groups` is the one loop that splits groups by a per-parameter value; the parametrizations and the
optimizer's own table of groups (train/param_groups.py) all split through it. The order of the groups it makes
is the order optimizer state is saved in, so it is kept as checkpoints were written: groups in their order, and
inside each the values in the order their first parameter appears (or the default's first, where asked).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch.nn as nn

from hopperlm.model.completep import eps_factors
from hopperlm.model.mup import optimizer_multipliers
from hopperlm.model.transformer import parameter_shapes


def split_groups(
    groups: list[dict],
    value_of: dict[int, Hashable],
    apply: Callable[[dict, Any], dict],
    *,
    default: Hashable = None,
    default_first: bool = False,
) -> list[dict]:
    """Each group split into one group per distinct value of its parameters (`value_of[id(p)]`, `default` for
    the parameters it does not hold), made by `apply(group, value)`; in order of first appearance, or the
    default's group first (`default_first`). Groups left empty are dropped. Unchanged when `value_of` is
    empty."""
    if not value_of:
        return groups
    out = []
    for group in groups:
        by_value: dict[Hashable, list] = {default: []} if default_first else {}
        for p in group["params"]:
            by_value.setdefault(value_of.get(id(p), default), []).append(p)
        out += [apply({**group, "params": params}, value) for value, params in by_value.items() if params]
    return out


def lr_scaled(group: dict, factor: float) -> dict:
    """A group whose learning rate is `factor` times what it was (set_lr multiplies the schedule's LR by
    `lr_scale`)."""
    return {**group, "lr_scale": group.get("lr_scale", 1.0) * factor}


def width_scaled(group: dict, factor: float) -> dict:
    """μP's factor on a group: its LR times it, its weight decay divided by it (the decay per step, lr x weight
    decay, stays what optim.lr and the weight decay say, as Microsoft's MuAdamW)."""
    return {**lr_scaled(group, factor), "weight_decay": group.get("weight_decay", 0.0) / factor}


def scaled_groups(
    model: nn.Module,
    groups: list[dict],
    *,
    eps: float | None,
    muon_lr_adjust: str = "match_rms_adamw",
    muon_ids: frozenset[int] = frozenset(),
) -> list[dict]:
    """The groups with the model's parametrization applied: μP's learning-rate factor and weight decay per
    parameter (and Muon's shape rule for `muon_ids`), then, for AdamW's groups (`eps` given), CompleteP's
    epsilon inside the blocks. Unchanged under standard, and for a model that is not hopperlm's Transformer."""
    cfg = getattr(model, "cfg", None)
    if cfg is None:
        return groups
    factors = optimizer_multipliers(
        model, cfg, parameter_shapes, muon_lr_adjust=muon_lr_adjust, muon_ids=muon_ids
    )
    groups = split_groups(groups, factors, width_scaled, default=1.0)
    if eps is None:  # Muon has no epsilon (completep.py)
        return groups
    inside = eps_factors(model, cfg)
    # (the blocks' parameters after the others: the order checkpoints were saved in)
    return split_groups(
        groups,
        inside,
        lambda g, f: g if f is None else {**g, "eps": eps * f},
        default=None,
        default_first=True,
    )
