"""Hugging Face interop: the `transformers` Llama config that describes the same network as a ModelConfig.

hopperlm's module names follow HF's Llama layout (q_proj ... down_proj) and its RoPE is HF's rotate-half, so a
ModelConfig maps one to one onto `LlamaConfig`. `transformers` is imported lazily: it is needed only for
interop and for the HF baseline of `hopperlm bench`.
"""

from __future__ import annotations

from hopperlm.config import ModelConfig
from hopperlm.errors import ConfigError


def require_transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError("this needs Hugging Face transformers: pip install transformers") from None
    return transformers


def llama_config(cfg: ModelConfig):
    """transformers.LlamaConfig with the same shapes, RoPE base, norm epsilon and tying as `cfg`."""
    transformers = require_transformers()
    if cfg.vocab_size is None:
        raise ConfigError("model.vocab_size must be set to build a Hugging Face config")
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.hidden_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=cfg.dropout,
        hidden_act="silu",
    )
