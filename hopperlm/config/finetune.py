"""The fine-tuning sections: LoRA/QLoRA adapters (lora) and instruction/chat data (sft)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hopperlm.errors import ConfigError

# lora.targets' short names -> the module path inside a transformer block (model/transformer.py)
TARGETS = {
    "q": "attn.q_proj",
    "k": "attn.k_proj",
    "v": "attn.v_proj",
    "o": "attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


def parse_targets(text: str) -> list[str]:
    """'q,k,v' -> ['q', 'k', 'v']; 'all-linear' -> all seven. ConfigError naming unknown entries."""
    if text.strip() == "all-linear":
        return list(TARGETS)
    names = [t.strip() for t in text.split(",") if t.strip()]
    names = [n.removesuffix("_proj") for n in names]  # accept PEFT's q_proj spelling too
    unknown = [n for n in names if n not in TARGETS]
    if unknown or not names:
        raise ConfigError(
            f"lora.targets={text!r}: {'unknown ' + ', '.join(unknown) if unknown else 'empty'}; "
            f"use a comma-separated subset of {','.join(TARGETS)} or all-linear"
        )
    return list(dict.fromkeys(names))


@dataclass
class LoRAConfig:
    rank: int = 0
    """LoRA rank r of every adapter; 0 = no LoRA (all parameters train)."""
    alpha: float = 16.0
    """Adapter scale numerator: updates are (alpha / r) * B @ A, or alpha / sqrt(r) with rslora."""
    dropout: float = 0.0
    """Dropout on the adapters' input."""
    targets: str = "q,k,v,o,gate,up,down"
    """Comma-separated projections to adapt, from q,k,v,o,gate,up,down, or all-linear (the same seven; the
    LM head is never adapted)."""
    rslora: bool = False
    """Rank-stabilised LoRA: scale alpha / sqrt(r) instead of alpha / r (Kalajdzievski 2023)."""
    quantize: Literal["none", "nf4"] = "none"
    """nf4 = QLoRA: the frozen base weights in 4-bit NormalFloat with double quantisation (bitsandbytes),
    computed in bf16; needs a CUDA GPU and `pip install bitsandbytes`."""

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ConfigError(f"lora.rank={self.rank} must be >= 0 (0 = no LoRA)")
        if self.rank == 0 and self.quantize != "none":
            raise ConfigError(
                f"lora.quantize={self.quantize} needs adapters to train: set lora.rank, e.g. 16"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout={self.dropout} must be in [0, 1)")
        if self.alpha <= 0:
            raise ConfigError(f"lora.alpha={self.alpha} must be positive")
        parse_targets(self.targets)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def target_list(self) -> list[str]:
        """lora.targets as short names ('all-linear' spelled out), checked when the section was read."""
        return parse_targets(self.targets)


@dataclass
class SFTConfig:
    path: str = ""
    """Instruction/chat data for `hopperlm finetune`: a .json/.jsonl file or a folder of them; empty = train
    on the token shards of data.path instead."""
    format: Literal["auto", "alpaca", "sharegpt", "messages", "completion"] = "auto"
    """alpaca (instruction/input/output), sharegpt (conversations: from/value), messages (OpenAI role/content),
    completion (text, or prompt + completion); auto = from the keys of the first record."""
    template: Literal["auto", "tokenizer", "zephyr", "llama2", "chatml", "alpaca", "plain"] = "auto"
    """How examples become text: tokenizer = the tokenizer's own Jinja chat_template; a built-in name; auto =
    the tokenizer's template when it has one, else zephyr. Every assistant turn ends with EOS, where
    generation stops."""
    tokenizer: str | None = None
    """Tokenizer for the examples; null = the one of model.init_from."""
    val_fraction: float = 0.05
    """Share of examples held out for validation (chosen by a hash of each example: stable across runs)."""
    max_examples: int | None = None
    """Use at most this many examples (in file order), e.g. for a quick run."""
    packing: bool = True
    """Pack whole examples into each train.seq_len row (attention never crosses an example, RoPE positions
    restart per example); false = one example per row, padded."""
    train_on_prompt: bool = False
    """Also take the loss on prompt (user/system) tokens; by default only assistant tokens count."""
    system_prompt: str | None = None
    """A system message put before every conversation that has none."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"sft.val_fraction={self.val_fraction} must be in [0, 1)")
        if self.max_examples is not None and self.max_examples <= 0:
            raise ConfigError(f"sft.max_examples={self.max_examples} must be positive (or null)")
