"""Keys that moved: a recipe or an override that still uses one is refused in one line that names its new place
and the value to write there; a config saved by an earlier hopperlm in a run folder (RUN/config.yaml, which
`--resume` reads) is moved to the new places instead, once, as it is read (loading.py).

Two rounds moved keys: every checkpoint setting into the checkpoint section, then the flat optim section of
27 keys into three (config/optim.py): optim (with its table of parameter groups), muon and schedule.
"""

from __future__ import annotations

from typing import Any

import yaml

from hopperlm.errors import ConfigError

# (section, key) -> its new "section.key"
MOVED = {
    ("train", "ckpt_every"): "checkpoint.every",
    ("train", "keep_last"): "checkpoint.keep_last",
    ("train", "keep_every"): "checkpoint.keep_every",
    ("train", "on_disk_full"): "checkpoint.on_disk_full",
    ("train", "disk_full_retry_s"): "checkpoint.disk_full_retry_s",
    ("train", "disk_full_wait_s"): "checkpoint.disk_full_wait_s",
    ("parallel", "checkpoint"): "checkpoint.format",
    ("parallel", "async_checkpoint"): "checkpoint.async_save",
    ("optim", "schedule"): "schedule.name",
    ("optim", "min_lr_ratio"): "schedule.min_lr_ratio",
    ("optim", "warmup_steps"): "schedule.warmup_steps",
    ("optim", "warmup_share"): "schedule.warmup_share",
    ("optim", "decay_fraction"): "schedule.decay_fraction",
    ("optim", "resume_horizon"): "schedule.resume_horizon",
    ("optim", "muon_momentum"): "muon.momentum",
    ("optim", "muon_momentum_warmup_steps"): "muon.momentum_warmup_steps",
    ("optim", "muon_momentum_start"): "muon.momentum_start",
    ("optim", "muon_momentum_final"): "muon.momentum_final",
    ("optim", "muon_lr_adjust"): "muon.lr_adjust",
    ("optim", "muon_weight_decay"): "muon.weight_decay",
    ("optim", "cautious_weight_decay"): "muon.cautious_weight_decay",
    ("optim", "weight_decay_schedule"): "muon.weight_decay_schedule",
    ("optim", "normuon"): "muon.normuon",
    ("optim", "normuon_beta2"): "muon.normuon_beta2",
    ("optim", "muon_ns"): "muon.ns",
}
WHY = {
    "checkpoint": "every checkpoint setting lives in the checkpoint section",
    "schedule": "the LR schedule has its own section",
    "muon": "Muon's settings have their own section",
}
# optim keys that became part of another: AdamW's betas in one pair, the group LRs rows of optim.groups
BETAS = {"beta1": 0, "beta2": 1}
GROUP_PATTERNS = {"embed_lr": "embed.weight", "head_lr": "lm_head.weight"}
DEFAULT_LR, DEFAULT_BETAS = 3e-4, (0.9, 0.95)  # OptimConfig's (an old key's value is read against them)


def is_moved(section: str, key: str) -> bool:
    return (section, key) in MOVED or (section == "optim" and (key in BETAS or key in GROUP_PATTERNS))


def yaml_text(value: Any) -> str:
    """A value as YAML writes it in flow style: true, not True; [0.8, 0.95]; {pattern: embed.weight, lr: 8}."""
    return (
        yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10_000)
        .removesuffix("\n...\n")
        .strip()
    )


def refusal(section: str, key: str, value: Any, siblings: dict[str, Any]) -> ConfigError:
    """The one line for a moved key: where it lives now and what to write there (`siblings`: the other keys
    given in its section, for the values that moved together: the other beta, the LR a group is a multiple of)."""
    where = f"config key '{section}.{key}'"
    if (section, key) in MOVED:
        new = MOVED[(section, key)]
        new_section, new_key = new.split(".")
        text = yaml_text(value)
        return ConfigError(
            f"{where} is now '{new}' ({WHY[new_section]}): write '{new_key}: {text}' under '{new_section}:' in "
            f"the YAML, or pass --{new} {text}"
        )
    if key in BETAS:
        betas = betas_from(siblings)
        return ConfigError(
            f"{where} is now the {('first', 'second')[BETAS[key]]} of 'optim.betas' (AdamW's pair in one key): "
            f"write 'betas: {yaml_text(betas)}' under 'optim:' in the YAML, or pass --optim.betas "
            f"{yaml_text(betas).replace(' ', '')}"
        )
    row = group_row(key, value, siblings.get("lr", DEFAULT_LR))
    return ConfigError(
        f"{where} is now a row of 'optim.groups' (each group's lr is a multiple of optim.lr): write "
        f"'groups: [{yaml_text(row)}]' under 'optim:' in the YAML, or pass --optim.groups '[{yaml_text(row)}]'"
    )


def betas_from(optim: dict[str, Any]) -> list[float]:
    return [optim.get("beta1", DEFAULT_BETAS[0]), optim.get("beta2", DEFAULT_BETAS[1])]


def group_row(key: str, value: float, lr: float) -> dict[str, Any]:
    """optim.embed_lr / head_lr (an absolute LR) as a row of optim.groups (a multiple of optim.lr)."""
    ratio = float(value) / float(lr)
    return {"pattern": GROUP_PATTERNS[key], "lr": int(ratio) if ratio.is_integer() else ratio}


def migrate_saved(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A saved run config with every moved key in its new place, and the moves in words (none: `raw` itself).
    Keys at null or their old default move as they are; a group LR that was null (optim.lr) adds no row."""
    moves = [
        (s, k) for s, values in raw.items() if isinstance(values, dict) for k in values if is_moved(s, k)
    ]
    if not moves:
        return raw, []
    out = {s: dict(v) if isinstance(v, dict) else v for s, v in raw.items()}
    said = []
    for section, key in moves:
        value = out[section].pop(key)
        if (section, key) in MOVED:
            new_section, new_key = MOVED[(section, key)].split(".")
            out.setdefault(new_section, {})
            out[new_section] = {**(out[new_section] or {}), new_key: value}
            said.append(f"{section}.{key} -> {new_section}.{new_key}")
        elif key in BETAS:
            out["optim"]["betas"] = betas_from(raw["optim"])
            said.append(f"optim.{key} -> optim.betas")
        elif value is not None:
            out["optim"].setdefault("groups", []).append(
                group_row(key, value, raw["optim"].get("lr", DEFAULT_LR))
            )
            said.append(f"optim.{key} -> optim.groups")
    if out.get("optim", {}).get("name", "adamw") != "muon" and not raw.get("muon") and out.pop("muon", None):
        # Muon's keys of a run that was not Muon's: never read then, and refused now
        said = [line for line in said if "-> muon." not in line] + ["Muon's keys dropped (not a Muon run)"]
    return out, said
