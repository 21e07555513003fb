"""Typed run configuration: dataclasses with one docstring per field, YAML loading and strict CLI overrides.

A config file has up to ten sections (model, data, optim, train, guard, log, parallel, run, lora, sft).
`model.preset` starts the model section from a preset in presets.py; keys beside it override the preset;
`model.init_from` starts it from a Hugging Face or hopperlm checkpoint instead. Every key is checked against the
dataclass: an unknown key, a wrong type or an impossible shape raises ConfigError naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from hopperlm.errors import ConfigError


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
    """SwiGLU hidden width; null = 8/3 * dim rounded up to multiple_of."""
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
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2)."""
    rope_scaling: dict[str, float] | None = None
    """RoPE frequency scaling of long-context checkpoints, as in their config.json: {factor} = linear;
    {factor, low_freq_factor, high_freq_factor, original_max_position_embeddings} = Llama-3.1's llama3."""
    sliding_window: int | None = None
    """Attention window of Mistral-style checkpoints. hopperlm attends to the whole causal context, which is
    the same attention while model.max_seq_len <= sliding_window (checked), so contexts stop there."""
    init_from: str | None = None
    """A Hugging Face model folder (config.json + safetensors), or a hopperlm run/checkpoint/export, to start
    from: its config gives the shape (keys here may only lower max_seq_len, grow vocab_size or set dropout),
    its weights the values. A larger vocabulary (an extended tokenizer) gets new rows (model/resize.py)."""

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
            from hopperlm.model.rope import check_rope_scaling

            check_rope_scaling(self.rope_scaling, "model.rope_scaling")

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
        hidden = int(8 * self.dim / 3)
        return self.multiple_of * -(-hidden // self.multiple_of)


@dataclass
class DataConfig:
    path: str = ""
    """Prepared data directory (the output of `hopperlm prepare`, holding manifest.json)."""
    tokenizer: str | None = None
    """Optional tokenizer ('byte', a tokenizer.json/.model path or dir); must match the data manifest."""
    verify: bool = False
    """Check every shard's sha256 against the manifest at start-up (slow for big corpora)."""
    sampling: Literal["random", "sequential"] = "random"
    """random: nanoGPT windows, the batch of a step a pure function of (seed, step); sequential: every window
    once per epoch, its position saved in checkpoints (resume continues with exactly the next sample)."""
    shuffle: bool = True
    """sequential: shuffle the windows of each epoch by (seed, epoch); false = file order."""
    packing: bool = False
    """Attention never crosses a document boundary inside a window and RoPE positions restart per document."""
    mixture: dict[str, float] | None = None
    """Several prepared datasets with weights, e.g. {data/tir: 0.7, data/eng: 0.3}; each has its own val loss."""
    prefetch: int | None = None
    """Micro-batches a background thread prepares ahead; null = 2 on CUDA, 0 on CPU."""

    def __post_init__(self) -> None:
        if self.prefetch is not None and self.prefetch < 0:
            raise ConfigError(f"data.prefetch={self.prefetch} must be >= 0")
        if self.mixture is not None and not self.mixture:
            raise ConfigError("data.mixture is empty; give {path: weight, ...} or null")


@dataclass
class OptimConfig:
    lr: float = 3e-4
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr (cosine, linear and WSD decay to it)."""
    schedule: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    """Shape after warm-up, over the run's budget (steps, tokens or wall-clock hours)."""
    warmup_steps: int = 100
    """Linear LR warm-up, in optimizer steps."""
    decay_fraction: float = 0.2
    """WSD only: the last fraction of the budget spent decaying linearly to min_lr."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on matrices (never on norms, biases or embeddings)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    fused: bool | None = None
    """Fused AdamW kernel; null = on for CUDA, off elsewhere."""
    name: Literal["adamw", "adamw8bit", "muon", "paged_adamw8bit"] = "adamw"
    """adamw (torch); adamw8bit (torchao's 8-bit states: a quarter of AdamW's state memory); muon (torch's
    Muon on the blocks' weight matrices, the optimizer of the modded-nanogpt records, with AdamW for
    embeddings, head and norms; its LR is matched to AdamW's update size, so optim.lr keeps its meaning);
    paged_adamw8bit (bitsandbytes' 8-bit AdamW with states in paged memory: QLoRA's optimizer, CUDA)."""
    muon_momentum: float = 0.95
    """Muon's momentum (Nesterov)."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"optim.lr={self.lr} must be positive")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ConfigError(f"optim.decay_fraction={self.decay_fraction} must be in (0, 1]")
        if self.grad_clip < 0:
            raise ConfigError(f"optim.grad_clip={self.grad_clip} must be >= 0 (0 disables clipping)")


@dataclass
class TrainConfig:
    seq_len: int = 1024
    """Tokens per training sequence (must not exceed model.max_seq_len)."""
    micro_batch: int | None = None
    """Sequences per forward/backward pass; null = the largest that fits train.memory_target (see the plan)."""
    batch_tokens: int | None = None
    """Global batch in tokens per optimizer step, a multiple of seq_len; null = one micro-batch."""
    max_steps: int | None = None
    """Stop after this many optimizer steps."""
    max_tokens: int | None = None
    """Stop after this many training tokens."""
    max_hours: float | None = None
    """Stop at this wall-clock budget; the LR schedule is laid over it so the decay lands at the deadline."""
    target_loss: float | None = None
    """Stop as soon as a validation loss at or below this is measured."""
    eval_every: int = 250
    """Validation every this many steps (and at the end); 0 = only at the end."""
    eval_windows: int = 200
    """Most validation windows of seq_len tokens per evaluation (evenly spaced over the val split)."""
    log_every: int = 10
    """Print and record metrics every this many steps (the only steps that sync with the device)."""
    ckpt_every: int = 1000
    """Checkpoint every this many steps (and at the end); 0 = only at the end."""
    keep_last: int = 3
    """Checkpoints kept on disk; older ones are deleted after a newer one is complete."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this (milestones); 0 = none."""
    requeue_exit_code: int = 0
    """Exit code after a SIGTERM/SIGUSR1 checkpoint (set e.g. 124 to let a scheduler requeue the job)."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Compute precision; auto = bf16 on GPUs that have it, fp16 + loss scaling on older GPUs, fp32 on CPU."""
    tf32: bool | None = None
    """TF32 tensor cores for fp32 matmuls; null = on where the GPU has them (Ampere+)."""
    attention: Literal["auto", "flash", "cudnn", "efficient", "math"] = "auto"
    """SDPA kernel; auto = the fastest this GPU, dtype and head size support, with safe fallbacks."""
    compile: bool | None = None
    """torch.compile the model; null = on for CUDA, off on CPU."""
    compile_mode: Literal[
        "auto", "default", "max-autotune", "max-autotune-no-cudagraphs", "reduce-overhead"
    ] = "auto"
    """torch.compile mode; auto = max-autotune-no-cudagraphs for runs of an hour or more, else default."""
    compile_scope: Literal["auto", "block", "model"] = "auto"
    """What torch.compile compiles: each block (+ the loss) on its own, or the whole model; auto = block."""
    activation_checkpointing: Literal["auto", "none", "selective-op", "selective-block", "full"] = "auto"
    """Recompute activations in the backward: selective-op keeps matmul/attention outputs and recomputes the
    elementwise ops; selective-block recomputes every ac_every-th block; full recomputes every block;
    auto = none when the activations fit the memory target, else the lightest mode that does."""
    ac_every: int = 2
    """selective-block: recompute one block in this many."""
    fp8: Literal["auto", "off", "tensorwise", "rowwise", "native"] = "auto"
    """float8 matmuls for the large linear layers (Hopper/Ada): tensorwise/rowwise through torchao, native
    through torch._scaled_mm; auto = tensorwise (torchao, else native) when the GPU has fp8 tensor cores,
    compile is on and most of the linear FLOPs are in layers large enough to gain. Falls back to bf16."""
    fused_loss: bool | None = None
    """Chunked linear cross-entropy that never materialises the [tokens, vocab] logits; null = on for
    vocabularies of 8192 and more."""
    memory_target: float = 0.9
    """Fraction of free GPU memory (of RAM on CPU: half of it) the automatic micro-batch may fill."""
    pin_memory: bool | None = None
    """Page-locked host batches for asynchronous copies; null = on for CUDA."""
    device: str = "auto"
    """'auto', 'cpu', 'cuda' or 'cuda:N'."""
    seed: int = 1337
    """Seed for initialisation, data order and dropout."""
    embed_warmup_steps: int = 0
    """With model.init_from and a larger vocabulary: train only the new embedding and LM-head rows for this
    many steps first (the rest frozen, old rows unchanged), then everything; 0 = off."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "log_every", "keep_last", "eval_windows", "ac_every"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be positive")
        for name in ("max_steps", "max_tokens", "max_hours", "batch_tokens", "micro_batch"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"train.{name}={value} must be positive (or null)")
        for name in ("eval_every", "ckpt_every", "embed_warmup_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be >= 0")
        if self.max_steps is None and self.max_tokens is None and self.max_hours is None:
            raise ConfigError(
                "no stopping rule: set train.max_steps, train.max_tokens or train.max_hours "
                "(e.g. --train.max_steps 1000)"
            )
        if not 0.05 <= self.memory_target <= 1.0:
            raise ConfigError(f"train.memory_target={self.memory_target} must be in [0.05, 1.0]")
        if self.batch_tokens is not None:
            per_micro = (self.micro_batch or 1) * self.seq_len
            if self.batch_tokens % per_micro:
                raise ConfigError(
                    f"train.batch_tokens={self.batch_tokens} is not a multiple of micro_batch*seq_len="
                    f"{per_micro}; use e.g. {max(1, round(self.batch_tokens / per_micro)) * per_micro}"
                )

    @property
    def batch_seqs(self) -> int | None:
        """Sequences per optimizer step, when the global batch is fixed."""
        return None if self.batch_tokens is None else self.batch_tokens // self.seq_len


@dataclass
class GuardConfig:
    policy: Literal["skip", "rollback", "stop"] = "skip"
    """On a non-finite loss or gradient norm the update is always dropped (on the device); then: skip = count
    it and go on; rollback = reload the last good checkpoint and skip the data that caused it; stop = save and
    exit with a message."""
    bad_steps: int = 3
    """rollback: this many non-finite steps within `window` steps trigger a rollback."""
    window: int = 100
    """Steps of history for the bad-step count and for the loss-spike statistics."""
    spike_k: float = 8.0
    """A loss above median + spike_k * MAD of the recent window is a spike (rollback policy); 0 = off."""
    lr_factor: float = 1.0
    """rollback: multiply the learning rate by this after each rollback (e.g. 0.5)."""
    max_rollbacks: int = 5
    """rollback: stop with a message after this many rollbacks in one run."""

    def __post_init__(self) -> None:
        if self.bad_steps < 1 or self.window < 2 or self.max_rollbacks < 0:
            raise ConfigError("guard.bad_steps must be >= 1, guard.window >= 2, guard.max_rollbacks >= 0")
        if self.spike_k < 0 or not 0 < self.lr_factor <= 1:
            raise ConfigError("guard.spike_k must be >= 0 and guard.lr_factor in (0, 1]")


@dataclass
class LogConfig:
    progress: Literal["auto", "rich", "plain"] = "auto"
    """Console progress: auto = a live rich display when stdout is a terminal, plain lines otherwise (CI, SLURM);
    both show the ETA of whichever stopping rule ends the run first."""
    tensorboard: bool = True
    """Write TensorBoard event files to RUN_DIR/tensorboard (view with `tensorboard --logdir RUN_DIR`)."""
    wandb: bool = False
    """Also log to Weights & Biases (`pip install wandb`); the run id is kept in RUN_DIR so resumes continue it."""
    wandb_project: str = "hopperlm"
    """W&B project name."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """offline writes RUN_DIR/wandb/ for a later `wandb sync`; online needs `wandb login`."""
    csv: bool = False
    """Also write RUN_DIR/metrics.csv: the metrics.jsonl fields as columns, one row per log step."""
    gpu_monitor: bool = True
    """On CUDA, sample GPU utilisation, power, temperature and memory with NVML (`pip install nvidia-ml-py`)."""
    report: bool = True
    """At the end of training write RUN_DIR/report.md and report.html (summary, plan, events, plots)."""


@dataclass
class ParallelConfig:
    strategy: Literal["auto", "ddp", "fsdp", "hsdp", "none"] = "auto"
    """Data parallelism under torchrun: ddp (a replica per rank), fsdp (FSDP2: parameters, gradients and
    optimizer state sharded over all ranks), hsdp (sharded within groups of shard_size ranks, replicated
    across them); auto = none for one process, else ddp when the model and its AdamW state fit one GPU,
    fsdp otherwise."""
    shard_size: int | None = None
    """hsdp: ranks that share one copy of the model; null = the processes of one node (LOCAL_WORLD_SIZE)."""
    checkpoint: Literal["auto", "single", "sharded"] = "auto"
    """single: model.safetensors + optimizer.pt, written by rank 0; sharded: every rank writes its part through
    torch.distributed.checkpoint; auto = sharded for fsdp/hsdp (and async saves), single otherwise. Both load
    at any world size."""
    async_checkpoint: bool = False
    """Sharded checkpoints: copy the state to CPU memory and write the files in a background thread while
    training goes on; the checkpoint is completed (checksums, rename) at the next save or at the end."""
    timeout_s: float = 600.0
    """Seconds a collective waits for the other ranks before the run is aborted (no hung ranks)."""

    def __post_init__(self) -> None:
        if self.shard_size is not None and self.shard_size < 1:
            raise ConfigError(f"parallel.shard_size={self.shard_size} must be >= 1 (or null)")
        if self.timeout_s <= 0:
            raise ConfigError(f"parallel.timeout_s={self.timeout_s} must be positive")
        if self.async_checkpoint and self.checkpoint == "single":
            raise ConfigError(
                "parallel.async_checkpoint needs the sharded format; set parallel.checkpoint sharded or auto"
            )


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
        from hopperlm.model.lora import parse_targets

        parse_targets(self.targets)

    @property
    def enabled(self) -> bool:
        return self.rank > 0


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


@dataclass
class RunConfig:
    out_dir: str = "runs/default"
    """Run directory: config.yaml, metrics.jsonl, tokenizer and checkpoints/ go here."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(max_steps=1000))
    guard: GuardConfig = field(default_factory=GuardConfig)
    log: LogConfig = field(default_factory=LogConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)

    def __post_init__(self) -> None:
        if self.lora.enabled and self.train.embed_warmup_steps:
            raise ConfigError(
                "train.embed_warmup_steps trains new embedding rows, which LoRA keeps frozen; "
                "drop one of train.embed_warmup_steps and lora.rank"
            )
        if self.train.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}; "
                "lower train.seq_len or raise model.max_seq_len"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "guard": GuardConfig,
    "log": LogConfig,
    "parallel": ParallelConfig,
    "run": RunConfig,
    "lora": LoRAConfig,
    "sft": SFTConfig,
}


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, where)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}={value!r} must be a mapping, e.g. {{data/a: 0.7, data/b: 0.3}}")
        key_type, value_type = typing.get_args(tp)
        return {_coerce(k, key_type, where): _coerce(v, value_type, f"{where}.{k}") for k, v in value.items()}
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{where}={value!r} is not one of {', '.join(map(str, choices))}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}={value!r} must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)  # 1e6 in YAML is a float; accept it where it is a whole number
            raise ConfigError(f"{where}={value!r} must be an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML reads 1e-3 (no dot) as a string; users write it anyway
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}={value!r} must be a number")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where}={value!r} must be a string")
        return str(value)
    raise TypeError(f"unsupported config annotation {tp!r} for {where}")


def _unknown(key: str, known: list[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(known)}"
    return ConfigError(f"unknown config key '{where}{key}'; {hint}")


def _build_section(name: str, values: dict[str, Any]) -> Any:
    cls = SECTIONS[name]
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    if name == "model" and values.get("preset") is not None:
        from hopperlm.presets import get_preset

        values = {**dataclasses.asdict(get_preset(values["preset"])), **values}
    if name == "model" and values.get("init_from") is not None:  # the shape comes from the checkpoint
        from hopperlm.model.hf import init_from_values

        values = init_from_values(values)
    kwargs = {}
    for key, value in values.items():
        if key not in known:
            raise _unknown(key, known, f"{name}.")
        kwargs[key] = _coerce(value, hints[key], f"{name}.{key}")
    return cls(**kwargs)


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Build and validate a Config from nested plain data (as read from YAML)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a mapping of sections ({', '.join(SECTIONS)})")
    sections = {}
    for name, values in raw.items():
        if name not in SECTIONS:
            raise _unknown(str(name), list(SECTIONS), "")
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise ConfigError(f"config section '{name}' must be a mapping of keys, got {values!r}")
        sections[name] = _build_section(name, values)
    if "train" not in sections:
        sections["train"] = _build_section("train", {})  # raises "no stopping rule" with the fix
    return Config(**sections)


def parse_overrides(args: list[str]) -> dict[str, dict[str, Any]]:
    """`--section.key value` or `--section.key=value` pairs -> nested dict; values are parsed as YAML scalars."""
    out: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"unexpected argument '{arg}'; overrides look like --train.max_steps 100")
        if "=" in arg:
            key, text = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override '{arg}' has no value; write {arg} VALUE")
            key, text = arg[2:], args[i + 1]
            i += 2
        section, _, name = key.partition(".")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        out.setdefault(section, {})[name] = value
    return out


def merge(base: dict[str, Any], overrides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    merged = {k: dict(v or {}) for k, v in base.items()}
    for section, values in overrides.items():
        if section not in SECTIONS:
            raise _unknown(section, list(SECTIONS), "")
        if section == "model" and "preset" in values:
            # a new preset replaces the file's model section; other overrides still apply on top
            merged["model"] = {}
        merged.setdefault(section, {}).update(values)
    return merged


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found; pass a YAML recipe such as configs/debug.yaml")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        where = f" line {line + 1}" if line is not None else ""
        raise ConfigError(
            f"config file {path}{where} is not valid YAML: {getattr(e, 'problem', e)}"
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections ({', '.join(SECTIONS)})")
    return raw


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read a YAML recipe, apply `--section.key value` overrides, validate everything."""
    return config_from_dict(merge(read_yaml(path), parse_overrides(overrides or [])))


def save_config(config: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
