"""The model section: the transformer's shape, and where its weights may start from.

A section with model.init_from takes its shape from that checkpoint; reading the config does not open it:
until `hopperlm.interop.init_from.resolve_init_from` fills the shape in, the section `awaits_init_from`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from hopperlm.errors import ConfigError

# the two kinds of RoPE scaling a model section may name (model/rope.py computes them)
LINEAR_KEYS = {"factor"}
LLAMA3_KEYS = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}


def check_rope_scaling(scaling: dict[str, float], where: str) -> None:
    """ConfigError unless `scaling` holds exactly the keys of one supported kind, with sane values."""
    keys = set(scaling)
    if keys not in (LINEAR_KEYS, LLAMA3_KEYS):
        raise ConfigError(
            f"{where} has keys {sorted(keys)}; expected {{factor}} (linear) or {sorted(LLAMA3_KEYS)} (llama3)"
        )
    if scaling["factor"] <= 0:
        raise ConfigError(f"{where}.factor={scaling['factor']} must be positive")
    if keys == LLAMA3_KEYS and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ConfigError(f"{where}: high_freq_factor must exceed low_freq_factor")


@dataclass
class ModelConfig:
    preset: str | None = None
    """Name of the preset this model section started from (see `hopperlm presets`)."""
    dim: int = 256
    """Width of the residual stream."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads; head_dim = dim / n_heads."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; null = n_heads (multi-head attention)."""
    ffn_dim: int | None = None
    """The MLP's hidden width; null = 8/3 * dim (SwiGLU) or 4 * dim (ReLU²) rounded up to multiple_of. At
    equal parameters a ReLU² MLP is 1.5x as wide as a SwiGLU one (two matrices instead of three)."""
    mlp: Literal["swiglu", "relu2"] = "swiglu"
    """The blocks' MLP: swiglu (Llama's gated SiLU: gate, up and down projections) or relu2 (not gated: up, ReLU
    squared, down; Primer, modded-nanogpt, nanochat). relu2 exports as Arcee (transformers' ArceeForCausalLM,
    llama.cpp's arcee); not beside model.qkv_bias, which Arcee's biases do not match (export refuses it)."""
    multiple_of: int = 64
    """Rounding for the default ffn_dim (and for vocab_size taken from data)."""
    vocab_size: int | None = None
    """Embedding rows; null = the data's vocabulary rounded up to a multiple of 64."""
    max_seq_len: int = 1024
    """Longest context the model supports (RoPE table size)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the input embedding with the LM head."""
    dropout: float = 0.0
    """Dropout on attention weights and residual branches (0 for pretraining at scale)."""
    init_std: float = 0.02
    """Std of the normal initialisation; output projections are further scaled by 1/sqrt(2*n_layers)."""
    parametrization: Literal["standard", "mup"] = "standard"
    """standard: every matrix starts at init_std and trains at optim.lr. mup: μP (Yang et al. 2022) relative
    to model.base_dim, so the best optim.lr of a narrow proxy (`hopperlm sweep`) is the best of the wide model:
    the blocks' matrices start at init_std / sqrt(m) and train at optim.lr / m with weight decay x m (m: the
    fan-in's width over its width at base_dim; Microsoft's MuAdamW), the LM head's output is multiplied by
    base_dim / dim; embeddings, norms and the head keep init_std and optim.lr (model/mup.py). Needs an untied
    head. Hugging Face checkpoints keep standard; exports fold the output multiplier into the head."""
    base_dim: int | None = None
    """mup: the width at which mup equals standard, usually the proxy's width the LR was tuned at (a multiple
    of the head size: width grows by heads)."""
    depth_parametrization: Literal["standard", "completep"] = "standard"
    """standard: the blocks' outputs join the residual stream as they are, so the best optim.lr moves with depth.
    completep: CompleteP (Dey et al. 2025) relative to model.base_depth, so the best optim.lr of a shallow proxy
    (`hopperlm sweep --depth`) is the best of the deep model: each block's attention and MLP outputs are
    multiplied by base_depth / n_layers, the output projections start at init_std / sqrt(2 * base_depth) at any
    depth, and AdamW's epsilon for the blocks' parameters is optim.eps x base_depth / n_layers; learning rates
    and weight decay stay μP's (model/completep.py). Needs parametrization mup. Exports fold the multiplier into
    o_proj and down_proj."""
    base_depth: int | None = None
    """completep: the number of blocks at which completep equals standard, usually the depth of the proxy the LR
    was tuned at."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over each head's queries and keys before RoPE (OLMo 2, Qwen3, modded-nanogpt): attention logits
    stay bounded at high learning rates. Exports as Qwen3 (transformers' Qwen3ForCausalLM, llama.cpp's qwen3); not
    beside model.mlp relu2 or model.qkv_bias, which no format carries together (export refuses them)."""
    logit_softcap: float | None = None
    """Cap the LM head's logits smoothly at +-this (cap * tanh(logits / cap); Gemma 2, modded-nanogpt, nanochat
    use 15-30); null = off. No Llama-family format carries it, so `export` to HF or GGUF refuses such a model."""
    zero_init_output: bool = False
    """Initialise the residual output projections (o_proj, down_proj) to zero (modded-nanogpt): every block
    starts as the identity. Only the initialisation changes: the model and its checkpoints are the same."""
    rope_scaling: dict[str, float] | None = None
    """RoPE frequency scaling of long-context checkpoints, as in their config.json: {factor} = linear;
    {factor, low_freq_factor, high_freq_factor, original_max_position_embeddings} = Llama-3.1's llama3."""
    sliding_window: int | None = None
    """Attention window of Mistral-style checkpoints. hopperlm attends to the whole causal context, which is
    the same attention while model.max_seq_len <= sliding_window (checked), so contexts stop there."""
    init_from: str | None = None
    """A Hugging Face model folder (config.json + safetensors), or a hopperlm run/checkpoint/export, to start
    from: its config gives the shape (keys here may only lower max_seq_len, grow vocab_size or set dropout),
    its weights the values. A larger vocabulary (an extended tokenizer) gets new rows (train/resize.py)."""

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "max_seq_len", "multiple_of"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be positive")
        if self.dim % self.n_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} does not divide model.dim={self.dim}; "
                f"pick n_heads among {[h for h in range(1, 129) if self.dim % h == 0][-6:]}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim = model.dim/model.n_heads = {self.head_dim} must be even for RoPE")
        kv = self.kv_heads
        if kv <= 0 or self.n_heads % kv:
            raise ConfigError(
                f"model.n_kv_heads={kv} must divide model.n_heads={self.n_heads} (grouped-query attention)"
            )
        if self.ffn_dim is not None and self.ffn_dim <= 0:
            raise ConfigError(f"model.ffn_dim={self.ffn_dim} must be positive")
        if self.logit_softcap is not None and self.logit_softcap <= 0:
            raise ConfigError(f"model.logit_softcap={self.logit_softcap} must be positive (or null: off)")
        if self.vocab_size is not None and self.vocab_size <= 0:
            raise ConfigError(f"model.vocab_size={self.vocab_size} must be positive")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")
        if self.sliding_window is not None and self.max_seq_len > self.sliding_window:
            raise ConfigError(
                f"model.max_seq_len={self.max_seq_len} exceeds model.sliding_window={self.sliding_window}; "
                "hopperlm has no sliding-window attention: set model.max_seq_len <= the window (attention is "
                "then identical)"
            )
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling, "model.rope_scaling")
        if self.parametrization == "mup":
            if not self.base_dim or self.base_dim <= 0:
                raise ConfigError(
                    "model.parametrization mup needs model.base_dim (the proxy's width), e.g. 256"
                )
            if self.tie_embeddings:
                raise ConfigError(
                    "model.parametrization mup needs an untied head (model.tie_embeddings false): its output "
                    "multiplier would also scale the input embedding"
                )

        if self.base_depth is not None and self.base_depth <= 0:
            raise ConfigError(f"model.base_depth={self.base_depth} must be positive (a number of blocks)")
        if self.depth_parametrization == "completep":
            if self.parametrization != "mup":
                raise ConfigError(
                    "model.depth_parametrization completep needs model.parametrization mup (its depth rules "
                    "extend μP's width rules); set model.parametrization mup and model.base_dim"
                )
            if self.base_depth is None:
                raise ConfigError(
                    "model.depth_parametrization completep needs model.base_depth (the proxy's depth), e.g. 4"
                )

    @property
    def awaits_init_from(self) -> bool:
        """True for a model section read beside model.init_from whose shape has not been filled in from the
        checkpoint yet (interop/init_from.py's resolve_init_from does that): until then its fields are
        defaults, and `recipe_keys` holds what the recipe set."""
        return self.recipe_keys is not None

    @property
    def recipe_keys(self) -> dict[str, Any] | None:
        """The keys the recipe set beside model.init_from (checked types, not yet checked against the
        checkpoint), while the shape awaits it; None once resolved, or for a section built in Python."""
        return self.__dict__.get("_recipe_keys")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        hidden = 4 * self.dim if self.mlp == "relu2" else int(8 * self.dim / 3)
        return self.multiple_of * -(-hidden // self.multiple_of)


def awaiting_init_from(values: dict[str, Any]) -> ModelConfig:
    """The model section of a recipe that sets model.init_from, before the checkpoint is read: defaults and
    init_from, with the recipe's keys kept aside for resolve_init_from, which lays them over the checkpoint's
    values and checks them there (config loading reads no checkpoint)."""
    cfg = ModelConfig(init_from=values["init_from"])
    cfg.__dict__["_recipe_keys"] = dict(values)
    return cfg
