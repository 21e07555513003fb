"""The recipes bench/race_matrix.py races on its matrix-heavy proxy, and the axes each is tuned on. Pre-registered
with race_matrix.py's PLAN: both files were committed before the race's first run (the results cite that commit).

A recipe is {"model", "optim", "muon", "schedule", "train"} sections, as in bench/race_recipes.py; a point of a
tuning search is {axis: log2 offset} from the recipe's start (0 everywhere: the start itself), and `recipe(point)`
gives the YAML sections at that point. Every recipe starts where its own rules put it for this run:
  nanogpt   bench/race_recipes.py's NANOGPT (llm.c's GPT-2 settings) with the old race's tuned LR, 4e-3
  nanochat  karpathy/nanochat at NANOCHAT_COMMIT, its rules applied to THIS run as its own small runs apply
            them (scripts/base_train.py, runs/runcpu.sh): the horizon D is its target, 12 x the trained model's
            scaling parameters (block matrices + head), not extrapolated from its d12 reference's run length
  hopperlm  configs/owt-350m-h100.yaml's optimizer and schedule (Muon on the blocks' matrices with the
            spectral LR rule, AdamW elsewhere, WSD decaying over the last 40% to 10%), untied, under μP with
            base_dim the proxy's width, at the old race's tuned Muon LR (1.6e-2)
"""

from __future__ import annotations

import math

from race_recipes import (
    BATCH_TOKENS,
    NANOGPT,
    REF_BATCH,
    REF_SCALING_PARAMS,
    group_row,
    relu2_width,
)
from race_recipes import (
    NANOCHAT_LEFT_OUT as OLD_LEFT_OUT,
)

NANOCHAT_TARGET_RATIO = 12  # --target-param-data-ratio: its horizon D = 12 x the scaling parameters
NANOCHAT_REF_TOKENS = NANOCHAT_TARGET_RATIO * REF_SCALING_PARAMS  # D_REF, d12's horizon
NANOCHAT_NS_SAFETY = 1.01  # nanochat/optim.py:144 at 92d63d4 divides by 1.01 x the norm (hopperlm: 1.02)
WARMUP_SHARE = 700 / 19_073  # nanoGPT's (llm.c's) warm-up share, which hopperlm's recipe keeps too


def nanochat_scaling_params(dim: int, n_layers: int, vocab: int) -> int:
    """What nanochat's get_scaling_params counts for this race's model: the block matrices (attention 4 d², its
    ReLU² MLP 2 x d x relu2_width) and the untied head."""
    return n_layers * (4 * dim * dim + 2 * dim * relu2_width(dim)) + vocab * dim


def nanochat_rules(dim: int, n_layers: int, vocab: int, batch: int = BATCH_TOKENS) -> dict:
    """nanochat's rule-based values for a model of this shape trained on `batch` tokens a step: its LRs (matrix
    0.02, embedding 0.3, unembedding 0.008; the AdamW groups x (d / 768)^-0.5, all x sqrt(B / B_ref)) and its
    Muon weight decay lambda = 0.28 sqrt(B / B_ref) D_ref / D, D its target horizon."""
    batch_scale = math.sqrt(batch / REF_BATCH)
    width_scale = (dim / 768) ** -0.5
    horizon = NANOCHAT_TARGET_RATIO * nanochat_scaling_params(dim, n_layers, vocab)
    return {
        "matrix_lr": 0.02 * batch_scale,
        "embedding_lr": 0.3 * width_scale * batch_scale,
        "unembedding_lr": 0.008 * width_scale * batch_scale,
        "muon_weight_decay": 0.28 * batch_scale * NANOCHAT_REF_TOKENS / horizon,
        "horizon_tokens": horizon,
    }


def nanochat(rules: dict, *, steps: int, dim: int, point: dict | None = None) -> dict:
    """nanochat's recipe at `point` of its four axes (log2 offsets from `rules`): matrix (Muon) LR, embedding LR,
    unembedding LR and Muon weight decay. Its embedding is initialised at std 0.8 and normalised (RMSNorm)
    before the blocks; hopperlm's at std 0.02, unnormalised: the embedding LR is an axis of its own so that the
    tuning compensates for that (no baseline-only option was added)."""
    p = {"matrix": 0.0, "embedding": 0.0, "unembedding": 0.0, "weight_decay": 0.0, **(point or {})}
    lr = rules["matrix_lr"] * 2 ** p["matrix"]
    embed = rules["embedding_lr"] * 2 ** p["embedding"]
    head = rules["unembedding_lr"] * 2 ** p["unembedding"]
    warmup = 40 / 2_520  # 40 of d12's 2,520 steps
    return {
        "model": {"mlp": "relu2", "ffn_dim": relu2_width(dim), "qk_norm": True, "tie_embeddings": False,
                  "logit_softcap": 15.0, "zero_init_output": True, "rope_theta": 100_000.0},
        # its per-group AdamW betas and decays (nanochat/gpt.py setup_optimizer) as optim.groups rows; the rest
        # (hopperlm's norm gains, which nanochat has not) at its scalars' betas, undecayed
        "optim": {"name": "muon", "lr": lr,
                  "groups": [{**group_row("embed.weight", embed, lr), "betas": [0.8, 0.995], "weight_decay": 0.001},
                             {**group_row("lm_head.weight", head, lr), "betas": [0.8, 0.96], "weight_decay": 0.01}],
                  "betas": [0.8, 0.95], "eps": 1e-10, "grad_clip": 0.0},
        "muon": {"lr_adjust": "original", "weight_decay": rules["muon_weight_decay"] * 2 ** p["weight_decay"],
                 "cautious_weight_decay": True, "weight_decay_schedule": "cosine", "normuon": True,
                 "normuon_beta2": 0.9, "ns": "polar_express", "ns_safety": NANOCHAT_NS_SAFETY,
                 "momentum": 0.97, "momentum_start": 0.85, "momentum_final": 0.90,
                 "momentum_warmup_steps": round(400 / 2_520 * steps)},
        "schedule": {"name": "wsd", "warmup_share": warmup, "decay_fraction": 0.65 / (1 - warmup),
                     "min_lr_ratio": 0.05},
        "train": {},
    }  # fmt: skip


NANOGPT_LR = 4e-3  # the old race's tuned LR (bench/results/2026-11-28-time-to-target-3tpp-cpu.json)


def nanogpt(point: dict | None = None) -> dict:
    """nanoGPT's recipe at `point` of its three axes: LR, weight decay and warm-up share."""
    p = {"lr": 0.0, "weight_decay": 0.0, "warmup": 0.0, **(point or {})}
    base = NANOGPT
    return {
        **{k: dict(v) for k, v in base.items()},
        "optim": {**base["optim"], "lr": NANOGPT_LR * 2 ** p["lr"],
                  "weight_decay": base["optim"]["weight_decay"] * 2 ** p["weight_decay"]},
        "schedule": {**base["schedule"], "warmup_share": min(0.5, base["schedule"]["warmup_share"] * 2 ** p["warmup"])},
    }  # fmt: skip


HOPPERLM_LR = 1.6e-2  # the old race's tuned Muon LR (its ladder's best at 4x its 4e-3)


def hopperlm(base_dim: int, point: dict | None = None) -> dict:
    """hopperlm's recipe (owt-350m-h100's) at `point` of its three axes: LR (every group with it), the
    embedding's LR as a multiple of it, and the weight decay; μP with base_dim `base_dim`, so that a wider model
    takes the proxy's point unchanged."""
    p = {"lr": 0.0, "embedding": 0.0, "weight_decay": 0.0, **(point or {})}
    groups = [] if p["embedding"] == 0 else [{"pattern": "embed.weight", "lr": 2 ** p["embedding"]}]
    return {
        "model": {"tie_embeddings": False, "parametrization": "mup", "base_dim": base_dim},
        "optim": {"name": "muon", "lr": HOPPERLM_LR * 2 ** p["lr"], "betas": [0.9, 0.95],
                  "weight_decay": 0.1 * 2 ** p["weight_decay"], **({"groups": groups} if groups else {})},
        "muon": {"lr_adjust": "spectral"},
        "schedule": {"name": "wsd", "decay_fraction": 0.4, "min_lr_ratio": 0.1, "warmup_share": WARMUP_SHARE},
        "train": {},
    }  # fmt: skip


# each recipe's tuning axes, in the order the coordinate search visits them
AXES = {
    "nanogpt": ("lr", "weight_decay", "warmup"),
    "nanochat": ("matrix", "embedding", "unembedding", "weight_decay"),
    "hopperlm": ("lr", "embedding", "weight_decay"),
}
# the one axis re-tuned at a wider width: every LR of the recipe together (the offsets moved as one; hopperlm's
# embedding LR is a multiple of its lr): a baseline's own transfer is its
# rules (nanochat) or none (nanoGPT); hopperlm's is μP, with no runs
LR_AXIS = {"nanogpt": ("lr",), "nanochat": ("matrix", "embedding", "unembedding"), "hopperlm": ("lr",)}

# What nanochat's recipe has that this race leaves out: race_recipes' list, less its per-group AdamW betas and
# decays (optim.groups rows carry them now, above)
NANOCHAT_LEFT_OUT = [
    *(item for item in OLD_LEFT_OUT if not item.startswith("per-group AdamW")),
    "the embedding's std 0.8 and RMSNorm: compensated by tuning the embedding's LR on an axis of its own",
]
