"""The optimizer's three sections: `optim` (the optimizer and its table of parameter groups), `muon` (Muon's own
settings) and `schedule` (the learning rate over the run's budget).

    optim:
      name: muon
      lr: 0.004                  # the peak LR; every group's lr is a multiple of it
      betas: [0.9, 0.95]
      groups:                    # a parameter claimed by two patterns is refused, as is a pattern matching none
        - {pattern: embed.weight, lr: 8}            # the input embedding at 8 x optim.lr
        - {pattern: lm_head.weight, lr: 0.5, weight_decay: 0.01, betas: [0.8, 0.95]}
    muon: {momentum: 0.95, ns: polar_express}
    schedule: {name: wsd, warmup_steps: 100, decay_fraction: 0.4}

Patterns are shell globs (fnmatch) over hopperlm's parameter names (`hopperlm.model.transformer`:
`embed.weight`, `layers.3.attn.q_proj.weight`, `norm.weight`, `lm_head.weight`). A group's lr is a multiple of
optim.lr rather than an absolute LR, so a sweep of optim.lr (`hopperlm sweep`) and μP's width transfer move the
whole table together, and a group keeps the parametrization's own factor on top (model/parametrization.py).
Like torchtitan's ParamGroupConfig a pattern that matches nothing is an error (train/param_groups.py), as is a
parameter two patterns claim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hopperlm.config.moved_keys import yaml_text
from hopperlm.errors import ConfigError


@dataclass
class ParamGroupConfig:
    pattern: str = ""
    """Shell glob over parameter names (fnmatch: `embed.weight`, `layers.*.mlp.*`); must match at least one
    trainable parameter, and no parameter may match two groups."""
    lr: float = 1.0
    """The group's peak learning rate as a multiple of optim.lr (it follows the same schedule); under μP the
    parametrization's factor for each parameter multiplies it."""
    betas: list[float] | None = None
    """AdamW's (beta1, beta2) for this group; null = optim.betas. Not for Muon's matrices (momentum: muon)."""
    weight_decay: float | None = None
    """Decoupled weight decay of this group's parameters (also norms and embeddings, if the pattern names them);
    null = optim.weight_decay on matrices and none elsewhere (muon.weight_decay for Muon's matrices)."""

    def __post_init__(self) -> None:
        if not self.pattern:
            raise ConfigError(
                "optim.groups: every group needs a pattern, e.g. {pattern: embed.weight, lr: 8}"
            )
        where = f"optim.groups '{self.pattern}'"
        if self.lr <= 0:
            raise ConfigError(f"{where}: lr={self.lr} must be positive (a multiple of optim.lr)")
        check_betas(self.betas, where)
        if self.weight_decay is not None and self.weight_decay < 0:
            raise ConfigError(f"{where}: weight_decay={self.weight_decay} must be >= 0 (or null)")


def check_betas(betas: list[float] | None, where: str) -> None:
    if betas is None:
        return
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ConfigError(f"{where}: betas={betas} must be two numbers in [0, 1), e.g. [0.9, 0.95]")


@dataclass
class OptimConfig:
    name: Literal["adamw", "adamw8bit", "muon", "paged_adamw8bit"] = "adamw"
    """adamw (torch); adamw8bit (torchao's 8-bit states: a quarter of AdamW's state memory); muon (Muon,
    torch's update batched by shape (train/muon.py), on the blocks' weight matrices, the optimizer of the
    modded-nanogpt records, with AdamW for embeddings, head and norms; its LR is matched to AdamW's update
    size, so optim.lr keeps its meaning; its own settings: the muon section);
    paged_adamw8bit (bitsandbytes' 8-bit AdamW with states in paged memory: QLoRA's optimizer, CUDA)."""
    lr: float = 3e-4
    """Peak learning rate (the schedule section shapes it over the budget; optim.groups scale it per group)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on matrices (never on norms, biases or embeddings unless a group says so);
    Muon's too unless muon.weight_decay is set."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW's (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    fused: bool | None = None
    """Fused AdamW kernel; null = on for CUDA, off elsewhere."""
    groups: list[ParamGroupConfig] = field(default_factory=list)
    """Parameter groups with their own LR (a multiple of optim.lr), betas and weight decay, each chosen by a
    name pattern: e.g. [{pattern: embed.weight, lr: 8}] trains the input embedding at 8 x optim.lr (nanochat
    trains its embedding at 15 x its matrices' LR: a row sees a gradient only when its token occurs).
    Parameters no group claims train at optim.lr with optim.betas."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"optim.lr={self.lr} must be positive")
        if self.grad_clip < 0:
            raise ConfigError(f"optim.grad_clip={self.grad_clip} must be >= 0 (0 disables clipping)")
        if self.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay={self.weight_decay} must be >= 0")
        check_betas(self.betas, "optim")
        patterns = [g.pattern for g in self.groups]
        twice = sorted({p for p in patterns if patterns.count(p) > 1})
        if twice:
            raise ConfigError(f"optim.groups: pattern '{twice[0]}' is listed twice; merge the two groups")


@dataclass
class MuonConfig:
    """Read only when optim.name is muon: a recipe with another optimizer that sets any of these is refused."""

    momentum: float = 0.95
    """Muon's momentum (Nesterov); the value after muon.momentum_warmup_steps."""
    momentum_warmup_steps: int = 0
    """Muon's momentum rises linearly from muon.momentum_start to muon.momentum over this many optimizer steps
    (modded-nanogpt, nanochat: 0.85 -> 0.95 or 0.97); 0 = constant from the first step."""
    momentum_start: float = 0.85
    """Muon's momentum at step 0 when muon.momentum_warmup_steps > 0."""
    momentum_final: float | None = None
    """Muon's momentum at the end of the LR decay (WSD's decay, or the whole shape for cosine and linear),
    reached linearly from muon.momentum (nanochat: 0.97 -> 0.90); null = muon.momentum throughout."""
    lr_adjust: Literal["match_rms_adamw", "spectral", "original"] = "match_rms_adamw"
    """How Muon's step follows a matrix's shape. match_rms_adamw (torch's; Moonlight): each update has AdamW's
    RMS at optim.lr, so under model.parametrization mup it takes AdamW's 1/m. spectral: torch's "original"
    adjustment, scaled to equal match_rms_adamw at model.base_dim (at the model's own width under standard): the
    update's spectral norm stays the same as the model widens (Yang, Simon and Bernstein 2023), no 1/m.
    original: torch's "original" adjustment as it is (lr x sqrt(max(1, rows/cols))), so optim.lr is Muon's own
    LR as modded-nanogpt and nanochat state it (their 0.02-0.05); spectral too, so no 1/m under mup."""
    weight_decay: float | None = None
    """Weight decay of Muon's matrices; null = optim.weight_decay (nanochat decays them at 0.28, its head at
    0.01)."""
    cautious_weight_decay: bool = False
    """Decay only the coordinates whose update has the weight's sign (the update already pulls them towards
    zero: Chen et al. 2025's cautious weight decay, nanochat). The decay per step stays lr x weight decay, so it
    follows the LR schedule."""
    weight_decay_schedule: Literal["constant", "cosine"] = "constant"
    """Muon's weight decay over the budget: constant (the decay per step, lr x weight decay, follows the LR
    schedule) or cosine (the weight decay itself falls to zero along a cosine over the budget, as nanochat's,
    still times the LR)."""
    normuon: bool = False
    """NorMuon (Li et al. 2025, modded-nanogpt, nanochat): after orthogonalisation each neuron's update is divided
    by the root of its own running mean square (muon.normuon_beta2), then the matrix's update is scaled back to
    its norm before, so Muon's step size is unchanged and its neurons are evened out."""
    normuon_beta2: float = 0.95
    """NorMuon: the decay of each neuron's running mean square (the paper's 0.95; nanochat uses 0.9)."""
    ns: Literal["keller", "polar_express"] = "keller"
    """Muon's orthogonalisation: keller (Keller Jordan's quintic Newton-Schulz, 5 steps of one polynomial, as
    torch's) or polar_express (Amsel et al. 2025: a different polynomial at each of the 5 steps, closer to the
    polar factor; modded-nanogpt, nanochat)."""
    ns_safety: float = 1.02
    """Polar Express only: its input is divided by this times its Frobenius norm before the first polynomial, so
    that bf16 rounding cannot leave a singular value above 1 (modded-nanogpt's 1.02; nanochat divides by 1.01)."""

    def __post_init__(self) -> None:
        for name in ("momentum", "momentum_start", "momentum_final", "normuon_beta2"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise ConfigError(f"muon.{name}={value} must be in [0, 1)")
        if self.momentum_warmup_steps < 0:
            raise ConfigError(f"muon.momentum_warmup_steps={self.momentum_warmup_steps} must be >= 0")
        if self.weight_decay is not None and self.weight_decay < 0:
            raise ConfigError(f"muon.weight_decay={self.weight_decay} must be >= 0 (or null)")
        changed = self.changed()
        # a key read only beside another is refused without it, rather than silently ignored
        if "momentum_start" in changed and not self.momentum_warmup_steps:
            raise ConfigError(
                "muon.momentum_start is read only during a momentum warm-up; set muon.momentum_warmup_steps, "
                "or drop it"
            )
        if not 1.0 <= self.ns_safety <= 1.5:
            raise ConfigError(
                f"muon.ns_safety={self.ns_safety} must be in [1, 1.5] (1.02 or nanochat's 1.01)"
            )
        if "ns_safety" in changed and self.ns != "polar_express":
            raise ConfigError(
                "muon.ns_safety is read only by Polar Express; set muon.ns polar_express, or drop it"
            )
        if "normuon_beta2" in changed and not self.normuon:
            raise ConfigError("muon.normuon_beta2 is read only by NorMuon; set muon.normuon true, or drop it")

    def changed(self) -> list[str]:
        """The keys set to other than their defaults, in the section's order."""
        return [k for k in MUON_KEYS if getattr(self, k) != MUON_DEFAULTS[k]]


@dataclass
class ScheduleConfig:
    name: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    """Shape after warm-up, over the run's budget (steps, tokens or wall-clock hours)."""
    warmup_steps: int = 100
    """Linear LR warm-up, in optimizer steps."""
    warmup_share: float | None = None
    """Linear LR warm-up as a share of the run's budget (steps, tokens or wall-clock hours), laid like the decay:
    under train.max_hours it ends at that share of the deadline whatever the machine's speed. Replaces
    schedule.warmup_steps when set; the shape after it (cosine, linear, WSD) spans the rest of the budget."""
    decay_fraction: float = 0.2
    """WSD only: the last fraction of the budget spent decaying linearly to min_lr."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (cosine, linear and WSD decay to it)."""
    resume_horizon: Literal["extend", "keep"] = "extend"
    """When a resumed run's budget (train.max_steps/max_tokens/max_hours) differs from its checkpoint's:
    `extend` lays the schedule over the new budget (cosine and linear re-lay their decay, so the LR can jump;
    WSD lengthens its stable phase), `keep` holds the original schedule (the decay ends at the original budget
    and the LR stays at its minimum after it). Either way the run says how the LR changes."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"schedule.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.warmup_steps < 0:
            raise ConfigError(f"schedule.warmup_steps={self.warmup_steps} must be >= 0")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ConfigError(f"schedule.decay_fraction={self.decay_fraction} must be in (0, 1]")
        if self.warmup_share is not None and not 0.0 < self.warmup_share < 1.0:
            raise ConfigError(f"schedule.warmup_share={self.warmup_share} must be in (0, 1) (or null)")


MUON_DEFAULTS = {f: MuonConfig.__dataclass_fields__[f].default for f in MuonConfig.__dataclass_fields__}
MUON_KEYS = tuple(MUON_DEFAULTS)


def muon_refusal(optim: OptimConfig, muon: MuonConfig) -> ConfigError | None:
    """A recipe whose optimizer is not Muon but sets a muon key: one line naming the key (None: nothing to
    refuse)."""
    changed = muon.changed()
    if optim.name == "muon" or not changed:
        return None
    default = yaml_text(MUON_DEFAULTS[changed[0]])
    return ConfigError(
        f"muon.{changed[0]} is a setting of Muon's; set optim.name muon, or drop it (optim.name is {optim.name}; "
        f"on the command line --muon.{changed[0]} {default} sets it back to its default)"
    )
