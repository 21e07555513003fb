"""The sections of a pretraining run: data, training loop and stability guard (the optimizer's: optim.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from hopperlm.errors import ConfigError

# the train fields that end a run; the LR schedule is laid over them (train/run.py schedule_budget)
BUDGET_KEYS = ("max_steps", "max_tokens", "max_hours")


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
    """Several prepared datasets with weights, e.g. {data/tir: 0.7, data/eng: 0.3}; each has its own val loss. A
    weight of 0 makes a dataset a validation set only: evaluated (e.g. to watch a language being forgotten), never
    trained on."""
    mixture_forecast: str | None = None
    """A prediction of this run's final validation loss on each dataset of data.mixture (the mixture.json that
    `hopperlm sweep --mixture` writes); the banner prints it and the run's end compares it with its own."""
    prefetch: int | None = None
    """Micro-batches a background thread prepares ahead; null = 2 on CUDA, 0 on CPU."""

    def __post_init__(self) -> None:
        if self.prefetch is not None and self.prefetch < 0:
            raise ConfigError(f"data.prefetch={self.prefetch} must be >= 0")
        if self.mixture is not None and not self.mixture:
            raise ConfigError("data.mixture is empty; give {path: weight, ...} or null")
        for path, weight in (self.mixture or {}).items():
            if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight >= 0:
                raise ConfigError(
                    f"data.mixture weight of {path} is {weight!r}; weights must be numbers >= 0 (0: a validation "
                    "set only, never trained on)"
                )
        if self.mixture and not any(w > 0 for w in self.mixture.values()):
            raise ConfigError(
                "data.mixture weights are all 0: nothing would be trained on; give at least one dataset a positive "
                "weight"
            )


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
    forecast_from: str | None = None
    """A forecast of this run's final validation loss from proxy runs at several widths (the forecast.json that
    `hopperlm sweep --widths` writes); the banner and `hopperlm diagnose` show it beside the budget."""
    eval_every: int = 250
    """Validation every this many steps (and at the end); 0 = only at the end."""
    eval_windows: int = 200
    """Most validation windows of seq_len tokens per evaluation (evenly spaced over the val split)."""
    log_every: int = 10
    """Print and record metrics every this many steps (the only steps that sync with the device). A run that
    would print fewer than 10 lines logs more often, at a divisor of this, and says so in one line
    (observe/log_cadence.py); a train.max_hours run decides after timing its first steps."""
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
    """torch.compile mode; auto = default (max-autotune was measured slower to compile and not faster), or
    reduce-overhead (CUDA graphs) on one GPU when a micro-batch is too small to hide its kernel launches and a
    step needs no accumulation. reduce-overhead is never combined with accumulation (falls back to default)."""
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
    through torch._scaled_mm (not measured on a GPU yet: only when asked); auto = tensorwise when torchao is
    installed, the GPU has fp8 tensor cores, compile is on and most of the linear FLOPs are in layers large
    enough to gain. Falls back to bf16."""
    fused_loss: bool | None = None
    """Chunked linear cross-entropy that never materialises the [tokens, vocab] logits; null = on for
    vocabularies of 8192 and more."""
    fused_projections: bool | None = None
    """q/k/v and gate/up each as one GEMM over their weights concatenated per step (parameters, checkpoints and
    exports unchanged; one input-gradient GEMM in the backward instead of three, or two, plus their adds);
    null = off until a GPU bench row measures it (it never applies under LoRA, float8 or train.kernels liger)."""
    kernels: Literal["auto", "compiler", "liger"] = "auto"
    """Who writes the elementwise kernels of RMSNorm, RoPE, SiLU-mul and the LM-head loss: compiler =
    torch.compile's fusion (eager PyTorch ops when compile is off); liger = Liger-Kernel's Triton kernels
    (pip install liger-kernel; CUDA only, else compiler with one line); auto = compiler, until a GPU
    measurement says otherwise."""
    memory_target: float = 0.9
    """Fraction of free GPU memory (of RAM on CPU: half of it) the automatic micro-batch may fill."""
    pin_memory: bool | None = None
    """Page-locked host batches for asynchronous copies; null = on for CUDA."""
    threads: int | None = None
    """CPU threads for torch's operations; null = torch's default (`OMP_NUM_THREADS`, else every core). Set it
    when other processes share the cores: two torch processes spinning on the same cores slow each other down
    many times over."""
    device: str = "auto"
    """'auto', 'cpu', 'cuda' or 'cuda:N'."""
    seed: int = 1337
    """Seed for initialisation, data order and dropout."""
    embed_warmup_steps: int = 0
    """With model.init_from and a larger vocabulary: train only the new embedding and LM-head rows for this
    many steps first (the rest frozen, old rows unchanged), then everything; 0 = off."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "log_every", "eval_windows", "ac_every"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be positive")
        for name in ("max_steps", "max_tokens", "max_hours", "batch_tokens", "micro_batch", "threads"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"train.{name}={value} must be positive (or null)")
        for name in ("eval_every", "embed_warmup_steps"):
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


def budget_before(saved: dict[str, Any] | None) -> dict[str, Any]:
    """The budget a checkpoint's LR schedule was laid over, from its state.json: `schedule_budget`, or the
    budget of the config it saved (older checkpoints); {} when there is none."""
    saved = saved or {}
    return saved.get("schedule_budget") or saved.get("config", {}).get("train", {})


def checkpoint_budget(saved: dict[str, Any] | None, tc: TrainConfig) -> TrainConfig | None:
    """The budget a checkpoint's LR schedule was laid over (budget_before), as `tc` with those keys; None when
    there is none or it is `tc`'s own."""
    return budget_as(budget_before(saved), tc)


def budget_as(before: dict[str, Any], tc: TrainConfig) -> TrainConfig | None:
    """`tc` with the budget keys of `before`; None when `before` is empty or equals `tc`'s own."""
    if not before or all(before.get(k) == getattr(tc, k) for k in BUDGET_KEYS):
        return None
    return dataclasses.replace(tc, **{k: before.get(k) for k in BUDGET_KEYS})


def last_step_known_ahead(budget: TrainConfig, tokens_per_step: int) -> int | None:
    """The run's last step where its budget says it before the run: train.max_steps, or train.max_tokens over a
    step's tokens (rounded up), whichever ends it first; None for a train.max_hours budget alone (where
    max_hours is set too, it may end the run sooner: an upper bound)."""
    ends = [budget.max_steps] if budget.max_steps is not None else []
    if budget.max_tokens is not None and tokens_per_step:
        ends.append(-(-budget.max_tokens // tokens_per_step))
    return min(ends, default=None)
