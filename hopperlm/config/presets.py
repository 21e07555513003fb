"""Model presets as data. Each names the public config it mirrors; `hopperlm presets` prints exact sizes."""

from __future__ import annotations

import dataclasses

from hopperlm.config.model import ModelConfig
from hopperlm.errors import ConfigError

PRESETS: dict[str, ModelConfig] = {
    # Tiny, for tests and CI: 2 blocks, grouped-query attention, vocabulary taken from the data.
    "debug": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192, max_seq_len=256),
    # Character-level Tiny Shakespeare for the CPU demo: small and short-context so a 2-core CPU gets through
    # ~1.5M tokens in 90 s (nanoGPT's GPU recipe is 6L/6H/384 at ctx 256; bench/cpu_demo.py measures this one).
    "shakespeare-char": ModelConfig(dim=128, n_layers=4, n_heads=4, ffn_dim=384, max_seq_len=128),
    # GPT-2 small's shape (openai-community/gpt2 config.json: 12L, 768, 12 heads, ctx 1024) as a LLaMA-style
    # block; vocabulary 50257 padded to 50304 as in nanoGPT.
    "gpt2-124m": ModelConfig(
        dim=768,
        n_layers=12,
        n_heads=12,
        ffn_dim=2048,
        vocab_size=50304,
        max_seq_len=1024,
        tie_embeddings=True,
    ),
    # The "350M" model of the one-H100 pretraining recipe (owt-350m-h100): 24 blocks, d=1024, 16 heads x 64,
    # SwiGLU (8/3*d rounded to 256), RMSNorm, RoPE, 32K vocabulary (CS336 leaderboard setting).
    "h100-350m": ModelConfig(
        dim=1024,
        n_layers=24,
        n_heads=16,
        ffn_dim=2816,
        vocab_size=32000,
        max_seq_len=1024,
        rope_theta=10000.0,
    ),
    # TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T config.json.
    "tinyllama-1.1b": ModelConfig(
        dim=2048,
        n_layers=22,
        n_heads=32,
        n_kv_heads=4,
        ffn_dim=5632,
        vocab_size=32000,
        max_seq_len=2048,
        rope_theta=10000.0,
        norm_eps=1e-5,
    ),
    # meta-llama/Llama-2-7b-hf config.json (the QLoRA memory target's shape: bench/gpu/qlora.py).
    "llama2-7b": ModelConfig(
        dim=4096,
        n_layers=32,
        n_heads=32,
        ffn_dim=11008,
        vocab_size=32000,
        max_seq_len=4096,
        rope_theta=10000.0,
        norm_eps=1e-5,
    ),
    # meta-llama/Meta-Llama-3-8B config.json (for benchmarks; RoPE scaling of 3.1 not applied).
    "llama3-8b": ModelConfig(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=128256,
        max_seq_len=8192,
        rope_theta=500000.0,
        norm_eps=1e-5,
    ),
}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset '{name}'; choose one of: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], preset=name)
