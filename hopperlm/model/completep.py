"""CompleteP (Dey et al. 2025, "Don't be lazy: CompleteP enables compute-efficient deep transformers", arXiv
2505.01618; reference code EleutherAI/nanoGPT-mup, branch completep): the depth rules that make the best learning
rate of a shallow proxy the best of the deep model (model.depth_parametrization: completep), on top of μP's width
rules (model/mup.py).

With L = model.n_layers, L0 = model.base_depth, m_L = L / L0 and alpha = 1 (CompleteP; the paper's Table 1 is
written for alpha in [0.5, 1], 0.5 being Depth-μP), the table's depth column, and what hopperlm does for each row:
  residual branch multiplier  m_L^-alpha: each block's attention and MLP output is multiplied by L0 / L before it
                              joins the residual stream (Block in transformer.py), so the L blocks' sum, and each
                              step's change of it, stays the same size as the model deepens.
  hidden init variance        no depth factor (μP's width factor only): the output projections start at
                              init_std / sqrt(2 L0) at any depth, where standard's GPT-2 rule uses 2 L; the
                              multiplier, not the init, now keeps the stream from growing with depth.
  hidden LR (AdamW)           eta x m_L^(alpha - 1): 1 at alpha = 1, so μP's learning rates stand. The same for the
                              blocks' norm gains and biases (the table's LN/bias rows: m_L^(alpha - 1) = 1).
  AdamW weight decay          lambda as μP sets it: the decay per step, lr x weight decay, has the LR's depth
                              factor, 1 at alpha = 1.
  AdamW epsilon               eps x m_L^-alpha for every parameter inside the blocks: the multiplier scales their
                              gradients by L0 / L, and an epsilon that stayed put would grow against Adam's second
                              moment, turning the deep model's update towards plain SGD. The reference code
                              scales one global epsilon (by 1 / m_N too); here only the blocks' parameters, whose
                              gradients carry the multiplier (the embeddings' and the head's do not), and not by
                              width, which hopperlm's μP leaves as Microsoft's MuAdamW does.
Muon (optim.name muon, either muon.lr_adjust) on the blocks' matrices: its update is the orthogonalised
momentum, whose size does not depend on the gradient's scale, so the multiplier's L0 / L on the gradients changes
nothing and its LR takes the same depth factor as AdamW's, 1 at alpha = 1; the multiplier then makes each
block's update move the residual stream by L0 / L as much, L of them together a depth-independent amount, which
is the condition CompleteP's rules are derived from (the spectral view of Yang, Simon and Bernstein 2023 carried
to depth: a block's update of spectral norm ~ lr, scaled by 1/L). Muon has no Adam epsilon (its Newton-Schulz
clamp of 1e-7 on the momentum's norm is far below it at any depth), and its weight decay is decoupled as AdamW's.
The norms and biases Muon leaves to AdamW take AdamW's rules.

At L == L0 every factor is 1 and nothing is split: completep is standard exactly (tests/test_completep.py).
"""

from __future__ import annotations

import math

import torch.nn as nn

from hopperlm.config import ModelConfig
from hopperlm.model.mup import named_params

# CompleteP's exponent; another would also change the LR and weight-decay rows above (m_L^(alpha - 1))
ALPHA = 1.0


def completep(cfg: ModelConfig) -> bool:
    return cfg.depth_parametrization == "completep"


def depth_multiplier(cfg: ModelConfig) -> float:
    """m_L = n_layers / base_depth under completep; 1 under standard."""
    return cfg.n_layers / cfg.base_depth if completep(cfg) else 1.0


def residual_multiplier(cfg: ModelConfig) -> float:
    """What each block's attention and MLP outputs are multiplied by: (base_depth / n_layers)^alpha."""
    return depth_multiplier(cfg) ** -ALPHA


def residual_init_std(cfg: ModelConfig) -> float:
    """The output projections' (o_proj, down_proj) init std before μP's width factor: GPT-2's init_std / sqrt(2 L),
    with L = base_depth under completep (no depth dependence), n_layers under standard."""
    layers = cfg.base_depth if completep(cfg) else cfg.n_layers
    return cfg.init_std / math.sqrt(2 * layers)


def in_block(name: str) -> bool:
    """A parameter inside a transformer block (its gradient carries the residual multiplier)."""
    return name.startswith("layers.")


def eps_factors(model: nn.Module, cfg: ModelConfig) -> dict[int, float]:
    """id(parameter) -> what AdamW's epsilon is multiplied by, for the blocks' parameters under completep:
    (base_depth / n_layers)^alpha; empty at the base depth and under standard (model/parametrization.py splits
    the groups by it)."""
    factor = depth_multiplier(cfg) ** -ALPHA
    if factor == 1.0:
        return {}
    return {id(p): factor for name, p in named_params(model) if in_block(name)}


def describe(cfg: ModelConfig) -> str:
    """The banner's line: which depth parametrization is in effect, and what it does at this depth."""
    if not completep(cfg):
        return (
            f"depth: standard (residual branches unscaled, output projections at init_std / sqrt(2 x {cfg.n_layers})"
            "): the best LR moves with depth"
        )
    m = depth_multiplier(cfg)
    return (
        f"depth: completep (base_depth {cfg.base_depth}, depth x{m:g}): attention and MLP outputs x{m**-ALPHA:.3g} "
        f"before the residual add; output projections at init_std / sqrt(2 x {cfg.base_depth}); AdamW epsilon of "
        f"the blocks' parameters x{m**-ALPHA:.3g}; learning rates and weight decay as μP's"
    )
