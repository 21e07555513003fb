"""The recipes bench/race_3tpp.py races, as the YAML sections a user would write: nanoGPT's, nanochat's as
published (karpathy/nanochat at NANOCHAT_COMMIT, with its scaling rules applied to this race's model, batch and
tokens), and the ladder of levers that builds hopperlm's recipe from nanoGPT's. Pre-registered: this file and
race_3tpp.py's PLAN were committed before the race's first run; the results files cite that commit.

A recipe is {"model": {...}, "optim": {...}, "muon": {...}, "schedule": {...}, "train": {...}}; run_config
(race_3tpp.py) adds the shape, the data, the budget and the seed. (Until hopperlm's optimizer config moved into
three sections, these were flat optim keys, as the race's results files and its PLAN's commit still show them:
embed_lr and head_lr, absolute, are now rows of optim.groups at their ratio to optim.lr, computed as the same
division, so every run is the same run.) A ladder rung is (name, change): a dict merged into the best recipe so far, or a function
of that recipe returning the dict (None: the rung does not apply to it, with the reason in SKIPS)."""

from __future__ import annotations

import math
from collections.abc import Callable

NANOCHAT_COMMIT = "92d63d4e8bb4df75c3b71618f31ddde2378b2bcd"  # karpathy/nanochat, 2026-07-03
SEQ_LEN = 256
BATCH_TOKENS = 16 * SEQ_LEN  # every recipe's tokens per optimizer step (nanoGPT's small batch, as before)

# nanoGPT / llm.c GPT-2 as bench/time_to_target.py races it: AdamW, beta2 0.95, weight decay 0.1, cosine to 10%,
# warm-up 700 of llm.c's 19,073 steps, tied embeddings; its LR is the race's sweep's
NANOGPT = {
    "model": {"tie_embeddings": True},
    "optim": {"name": "adamw", "lr": 6e-4, "betas": [0.9, 0.95], "weight_decay": 0.1},
    "muon": {},
    "schedule": {"name": "cosine", "min_lr_ratio": 0.1, "warmup_share": 700 / 19_073},
    "train": {},
}  # fmt: skip

# nanochat's reference run, d12 (scripts/base_train.py: depth 12, aspect 64, head 128, vocabulary 32,768): its
# "scaling parameters" (transformer.h, with 6 value-embedding gates of 12 x 6, plus lm_head) and the tokens,
# batch and steps its rules give it; every setting below that nanochat states in steps is a share of REF_STEPS
REF_SCALING_PARAMS = 12 * (4 * 768 * 768 + 2 * 768 * 3072) + 6 * 12 * 6 + 32_768 * 768
REF_TOKENS = 12 * REF_SCALING_PARAMS  # --target-param-data-ratio 12
REF_BATCH = 2**19
REF_STEPS = REF_TOKENS // REF_BATCH  # 2,520

# What nanochat's recipe has that this race leaves out (no Llama-family format carries them, or hopperlm's model
# has no seam for them): the results files and docs/benchmarks.md list these
NANOCHAT_LEFT_OUT = [
    "value embeddings (ResFormer: per-layer token embeddings mixed into the values through a gate)",
    "per-layer residual and x0 scalars (resid_lambdas, x0_lambdas), smear and backout",
    "sliding-window layers (window pattern SSSL); every layer attends to the whole 256-token context",
    "RMSNorm after the token embedding, and norms without learnable gains (hopperlm's RMSNorms have gains, "
    "trained by AdamW at optim.lr)",
    "QK-norm after RoPE times 1.2 (hopperlm's, as Qwen3's, normalises before RoPE with gains starting at 1; "
    "RoPE is a rotation, so only the 1.2 differs)",
    "its initialisation (uniform blocks at 1/sqrt(d) with c_fc x0.4, embedding std 0.8, head std 0.001); "
    "hopperlm's normal 0.02 with zero output projections is used",
    "MuonEq row equilibration and Muon+ renormalisation inside its Muon step",
    "per-group AdamW betas and decays: embedding (0.8, 0.995) and weight decay 0.001; here every AdamW group "
    "takes the head's (0.8, 0.96) and 0.01 (the embedding none)",
    "its batch-size rule (2^19 tokens at d12, grown as D^0.383): every recipe here steps 4,096 tokens; its "
    "sqrt(B/B_ref) LR and T_epoch weight-decay rules are applied for that batch",
    "the MLP width: 4.5 x d (288 at d=64) instead of 4 x d, so its ReLU² MLP has SwiGLU's parameters "
    "(the race is at equal parameters)",
]


def nanochat(*, dim: int, steps: int, mult: float = 1.0) -> dict:
    """nanochat's recipe for a model of width `dim` trained `steps` steps of BATCH_TOKENS, its group LRs (embedding
    0.3, unembedding 0.008, matrices 0.02) scaled by its rules and then together by `mult` (the race's sweep)."""
    batch_scale = math.sqrt(BATCH_TOKENS / REF_BATCH)  # η ∝ sqrt(B / B_ref), for AdamW and Muon alike
    width_scale = (dim / 768) ** -0.5  # the AdamW groups ∝ 1/sqrt(d_model)
    tokens = steps * BATCH_TOKENS
    warmup = 40 / REF_STEPS
    lr = 0.02 * batch_scale * mult
    return {
        "model": {"mlp": "relu2", "ffn_dim": relu2_width(dim), "qk_norm": True, "tie_embeddings": False,
                  "logit_softcap": 15.0, "zero_init_output": True, "rope_theta": 100_000.0},
        "optim": {
            "name": "muon", "lr": lr,
            # its embedding and unembedding LRs, as multiples of the matrices' (each its absolute LR / lr)
            "groups": [group_row("embed.weight", 0.3 * width_scale * batch_scale * mult, lr),
                       group_row("lm_head.weight", 0.008 * width_scale * batch_scale * mult, lr)],
            "betas": [0.8, 0.96], "eps": 1e-10, "weight_decay": 0.01, "grad_clip": 0.0,
        },
        "muon": {
            "lr_adjust": "original",  # its Muon LR is torch's original rule's
            # T_epoch = B / (η λ D) held at the reference's: λ = 0.28 sqrt(B / B_ref) D_ref / D
            "weight_decay": 0.28 * batch_scale * REF_TOKENS / tokens,
            "cautious_weight_decay": True, "weight_decay_schedule": "cosine",
            "normuon": True, "normuon_beta2": 0.9, "ns": "polar_express",
            "momentum": 0.97, "momentum_start": 0.85, "momentum_final": 0.90,
            "momentum_warmup_steps": round(400 / REF_STEPS * steps),
        },
        # linear warm-up over 40 reference steps, constant, then linear over the last 65% to 5%
        "schedule": {"name": "wsd", "warmup_share": warmup, "decay_fraction": 0.65 / (1 - warmup), "min_lr_ratio": 0.05},
        "train": {},
    }  # fmt: skip


def swiglu_width(dim: int) -> int:
    """hopperlm's default SwiGLU width at `dim` (8/3 d rounded up to 64)."""
    return 64 * -(-int(8 * dim / 3) // 64)


def relu2_width(dim: int) -> int:
    """A ReLU² width with SwiGLU's parameters: two matrices of 1.5x its width for its three."""
    return swiglu_width(dim) * 3 // 2


def group_row(pattern: str, absolute_lr: float, lr: float) -> dict:
    """A row of optim.groups for a group trained at `absolute_lr` where optim.lr is `lr`."""
    return {"pattern": pattern, "lr": absolute_lr / lr}


def with_group(recipe: dict, pattern: str, multiple: float) -> dict:
    """The change that trains `pattern` at `multiple` x optim.lr, the recipe's other rows kept."""
    rows = [g for g in recipe["optim"].get("groups", []) if g["pattern"] != pattern]
    return {"optim": {"groups": [*rows, {"pattern": pattern, "lr": multiple}]}}


def scaled_lrs(recipe: dict, factor: float) -> dict:
    """Every peak LR the recipe sets times `factor`, one multiplier: optim.lr, which optim.groups' rows are
    multiples of."""
    return {"optim": {"lr": recipe["optim"]["lr"] * factor}}


def muon_only(change: dict) -> Callable[[dict], dict | None]:
    return lambda r: change if r["optim"].get("name") == "muon" else None


def wsd_only(change: dict) -> Callable[[dict], dict | None]:
    return lambda r: change if r["schedule"].get("name") == "wsd" else None


def momentum_warmup(steps: int) -> Callable[[dict], dict | None]:
    """0.85 -> muon.momentum over 16% of the steps (nanochat's 400 of its reference's 2,520)."""
    return muon_only(
        {"muon": {"momentum_warmup_steps": round(400 / REF_STEPS * steps), "momentum_start": 0.85}}
    )


LR_SEARCH = "LRs x2 / x0.5"  # a rung kind: see race_3tpp.py's PLAN["lr_search"]


def ladder(*, dim: int, steps: int) -> list[tuple[str, dict | Callable[[dict], dict | None]]]:
    """The rungs, in their pre-registered order (PLAN in race_3tpp.py says why this order)."""
    return [
        ("+wsd (decay over 40%)", {"schedule": {"name": "wsd", "decay_fraction": 0.4}}),
        ("+decay to 0", {"schedule": {"min_lr_ratio": 0.0}}),
        ("+untied head", {"model": {"tie_embeddings": False}}),
        ("+muon", {"optim": {"name": "muon"}, "muon": {"lr_adjust": "spectral"}}),
        (LR_SEARCH, {}),
        # (the rung names keep the keys they were registered with: embed_lr / head_lr, now optim.groups rows)
        ("+embed_lr 8x", lambda r: with_group(r, "embed.weight", 8)),
        ("+embed_lr 32x", lambda r: with_group(r, "embed.weight", 32)),
        ("+head_lr 0.5x", untied_only(lambda r: with_group(r, "lm_head.weight", 0.5))),
        ("+momentum warm-up", momentum_warmup(steps)),
        ("+cautious weight decay", muon_only({"muon": {"cautious_weight_decay": True}})),
        ("+normuon", muon_only({"muon": {"normuon": True}})),
        ("+polar express", muon_only({"muon": {"ns": "polar_express"}})),
        ("+relu2", {"model": {"mlp": "relu2", "ffn_dim": relu2_width(dim)}}),
        ("+qk-norm", {"model": {"qk_norm": True}}),
        ("+zero-init output", {"model": {"zero_init_output": True}}),
        ("+decay over 65%", wsd_only({"schedule": {"decay_fraction": 0.65}})),
        ("+floor 5%", {"schedule": {"min_lr_ratio": 0.05}}),
        ("+beta1 0.8", lambda r: {"optim": {"betas": [0.8, r["optim"]["betas"][1]]}}),
        ("+softcap 15", {"model": {"logit_softcap": 15.0}}),
        (LR_SEARCH, {}),
    ]


def untied_only(change: Callable[[dict], dict]) -> Callable[[dict], dict | None]:
    """An LM-head rung: none for a tied head (it is the embedding)."""
    return lambda r: None if r["model"].get("tie_embeddings") else change(r)
