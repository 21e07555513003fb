"""Tiny random `transformers` models of each family, saved to a folder like a Hub checkpoint (CPU, fp32)."""

import shutil
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

TINYLLAMA_TOKENIZER = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# family -> (config class name, keyword arguments beyond the shared tiny shape)
FAMILIES = {
    "llama2": ("LlamaConfig", {"num_key_value_heads": 4}),  # multi-head attention, theta 10000
    "tinyllama": ("LlamaConfig", {"num_key_value_heads": 2, "rms_norm_eps": 1e-5}),  # grouped-query
    "llama3": ("LlamaConfig", {"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE}),
    "mistral": ("MistralConfig", {"sliding_window": 64}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True, "rms_norm_eps": 1e-6}),
    "qwen3": ("Qwen3Config", {"head_dim": 16, "rms_norm_eps": 1e-6}),  # QK-norm (head_dim: hidden/heads)
    "arcee": ("ArceeConfig", {"hidden_act": "relu2"}),  # the non-gated ReLU² MLP
}


def tiny_hf_model(family: str = "tinyllama", vocab_size: int = 256, seed: int = 0, **overrides):
    """A random fp32 model of `family` with every weight (norms and biases included) non-trivial."""
    import transformers

    cls_name, extra = FAMILIES[family]
    shape = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = getattr(transformers, cls_name)(**{**shape, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model


def save_hf(model, out: Path, max_shard_size: str | None = None, tokenizer_from: Path | None = None) -> Path:
    """save_pretrained (sharded when max_shard_size is small), with a tokenizer's files copied beside it."""
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    if tokenizer_from is not None:
        for name in TINYLLAMA_TOKENIZER:
            shutil.copy(tokenizer_from / name, out / name)
    return out


def finetune_config(init_from: Path, data_dir: Path, run_dir: Path, *extra: str):
    """The debug recipe turned into a short fine-tune of `init_from` on the Alpaca-GPT4 demo; `extra`
    overrides come last and win."""
    from hopperlm.config import load_config
    from hopperlm.interop.init_from import resolve_init_from

    cfg = load_config(
        REPO / "configs" / "debug.yaml",
        [
            "--model.preset", "null",
            "--model.init_from", str(init_from),
            "--sft.path", str(data_dir / "alpaca_gpt4_demo" / "alpaca_en_demo.json"),
            "--train.seq_len", "128",
            "--train.micro_batch", "4",
            "--train.eval_windows", "4",
            "--run.out_dir", str(run_dir),
            *extra,
        ],
    )  # fmt: skip
    return resolve_init_from(cfg)
