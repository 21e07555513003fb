"""An optimizer's parameter groups, read in one place: which parameters decay, which Muon takes, the model's
parametrization (model/parametrization.py, one call), and the recipe's table of groups (optim.groups: a name
pattern with its own LR multiple, betas and weight decay; config/optim.py).

    base split     matrices decay (optim.weight_decay), norms, biases and embeddings do not; Muon's matrices apart
    table: decay   a group's weight_decay replaces the base's, before μP divides it by the width factor
    parametrize    μP's LR and weight-decay factors, CompleteP's epsilon (scaled_groups)
    table: lr      a group's lr multiple (times μP's factor) and betas

A pattern that matches no trainable parameter, and a parameter two patterns claim, are refused in one line
(torchtitan's ParamGroupConfig refuses the first too).
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch.nn as nn

from hopperlm.config import MuonConfig, OptimConfig, ParamGroupConfig
from hopperlm.errors import ConfigError
from hopperlm.model.mup import named_params
from hopperlm.model.parametrization import lr_scaled, scaled_groups, split_groups


@dataclass
class OptimizerGroups:
    adamw: list[dict]  # AdamW's (or the 8-bit AdamW's) groups: everything Muon does not take
    muon: list[dict]  # Muon's matrices (optim.name muon), else empty


def muon_matrices(model: nn.Module) -> list[nn.Parameter]:
    """What Muon orthogonalises: the blocks' 2-D weight matrices. Embeddings, the LM head and norms keep AdamW
    (as in modded-nanogpt and Moonlight)."""
    return [p for n, p in named_params(model) if p.requires_grad and p.ndim == 2 and n.startswith("layers.")]


def base_groups(model: nn.Module, weight_decay: float, skip: frozenset[int] = frozenset()) -> list[dict]:
    """Decay matrices only: norms, biases and embeddings get none (a tied head is the embedding); `skip`: the
    parameters another optimizer takes."""
    no_decay_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    seen = set(skip)
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 and id(p) not in no_decay_ids else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def claimed(model: nn.Module, table: list[ParamGroupConfig]) -> dict[int, ParamGroupConfig]:
    """id(parameter) -> the row of optim.groups whose pattern names it; refuses a pattern that names no
    trainable parameter and a parameter two patterns name."""
    named = [(n, p) for n, p in named_params(model) if p.requires_grad]
    out: dict[int, ParamGroupConfig] = {}
    for row in table:
        hits = [(n, p) for n, p in named if fnmatchcase(n, row.pattern)]
        if not hits:
            sample = ", ".join(n for n, _ in named[:4])
            tied = (
                " (a tied model has no lm_head.weight: its head is embed.weight)"
                if "head" in row.pattern
                else ""
            )
            raise ConfigError(
                f"optim.groups pattern '{row.pattern}' matches no trainable parameter; parameter names look "
                f"like {sample}, ...{tied}"
            )
        for name, p in hits:
            if id(p) in out and out[id(p)] is not row:
                raise ConfigError(
                    f"parameter {name} is matched by optim.groups patterns '{out[id(p)].pattern}' and "
                    f"'{row.pattern}'; narrow one so each parameter belongs to one group"
                )
            out[id(p)] = row
    return out


def optimizer_groups(model: nn.Module, oc: OptimConfig, muon: MuonConfig | None) -> OptimizerGroups:
    """The groups of the optimizer optim.name builds (`muon`: Muon's section when it is Muon), each with the
    factors the parametrization and the table give it (`lr_scale`, weight decay, eps, betas)."""
    rows = claimed(model, oc.groups)
    muon_params = muon_matrices(model) if muon is not None else []
    muon_ids = frozenset(id(p) for p in muon_params)
    for p in muon_params:
        row = rows.get(id(p))
        if row is not None and row.betas is not None:
            raise ConfigError(
                f"optim.groups '{row.pattern}' sets betas on Muon's matrices, which have a momentum instead "
                "(muon.momentum); drop betas or narrow the pattern to AdamW's parameters"
            )
    adjust = muon.lr_adjust if muon is not None else "match_rms_adamw"
    adamw = table_scaled(
        scaled_groups(
            model,
            decay_set(base_groups(model, oc.weight_decay, skip=muon_ids), rows),
            eps=oc.eps,
            muon_lr_adjust=adjust,
            muon_ids=muon_ids,
        ),
        rows,
    )
    if muon is None:
        return OptimizerGroups(adamw, [])
    decay = oc.weight_decay if muon.weight_decay is None else muon.weight_decay
    # the rows that name Muon's matrices (none: Muon's groups exactly as before the table existed)
    muon_rows = {pid: row for pid, row in rows.items() if pid in muon_ids}
    muon_groups = scaled_groups(
        model,
        decay_set([{"params": muon_params, "weight_decay": decay}], muon_rows),
        eps=None,
        muon_lr_adjust=adjust,
        muon_ids=muon_ids,
    )
    return OptimizerGroups(adamw, table_scaled(muon_groups, muon_rows))


def decay_set(groups: list[dict], rows: dict[int, ParamGroupConfig]) -> list[dict]:
    """The table's weight decays in place of the base split's, before μP scales them."""
    decays = {pid: row.weight_decay for pid, row in rows.items() if row.weight_decay is not None}
    return split_groups(groups, decays, lambda g, wd: g if wd is None else {**g, "weight_decay": wd})


def table_scaled(groups: list[dict], rows: dict[int, ParamGroupConfig]) -> list[dict]:
    """The table's LR multiples (on top of μP's factor) and betas. Weight decay keeps its value, as a per-group
    LR in torch's AdamW: the decay per step is that LR x weight decay."""
    values = {
        pid: (row.lr, tuple(row.betas) if row.betas is not None else None)
        for pid, row in rows.items()
        if row.lr != 1.0 or row.betas is not None
    }

    def apply(group: dict, value: tuple[float, tuple[float, float] | None]) -> dict:
        ratio, betas = value
        group = lr_scaled(group, ratio)
        return group if betas is None else {**group, "betas": betas}

    return split_groups(groups, values, apply, default=(1.0, None))
