"""The sections of a pretraining run: data, optimizer, training loop and stability guard."""

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
    warmup_share: float | None = None
    """Linear LR warm-up as a share of the run's budget (steps, tokens or wall-clock hours), laid like the decay:
    under train.max_hours it ends at that share of the deadline whatever the machine's speed. Replaces
    optim.warmup_steps when set; the shape after it (cosine, linear, WSD) spans the rest of the budget."""
    decay_fraction: float = 0.2
    """WSD only: the last fraction of the budget spent decaying linearly to min_lr."""
    resume_horizon: Literal["extend", "keep"] = "extend"
    """When a resumed run's budget (train.max_steps/max_tokens/max_hours) differs from its checkpoint's:
    `extend` lays the schedule over the new budget (cosine and linear re-lay their decay, so the LR can jump;
    WSD lengthens its stable phase), `keep` holds the original schedule (the decay ends at the original budget
    and the LR stays at its minimum after it). Either way the run says how the LR changes."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on matrices (never on norms, biases or embeddings); Muon's too unless
    optim.muon_weight_decay is set."""
    embed_lr: float | None = None
    """Peak learning rate of the input embedding (AdamW), on the same schedule as optim.lr; null = optim.lr.
    nanochat trains it at 0.3 (x its width and batch rules) where the blocks' matrices take 0.02: an embedding
    row sees a gradient only when its token occurs. Under μP it keeps μP's rule for embeddings (no width factor)."""
    head_lr: float | None = None
    """Peak learning rate of an untied LM head (AdamW), on the same schedule as optim.lr; null = optim.lr.
    Under μP it keeps μP's rule for the head (no width factor: its output multiplier scales with width)."""
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
    """adamw (torch); adamw8bit (torchao's 8-bit states: a quarter of AdamW's state memory); muon (Muon,
    torch's update batched by shape (train/muon.py), on the blocks' weight matrices, the optimizer of the
    modded-nanogpt records, with AdamW for embeddings, head and norms; its LR is matched to AdamW's update
    size, so optim.lr keeps its meaning);
    paged_adamw8bit (bitsandbytes' 8-bit AdamW with states in paged memory: QLoRA's optimizer, CUDA)."""
    muon_momentum: float = 0.95
    """Muon's momentum (Nesterov); the value after optim.muon_momentum_warmup_steps."""
    muon_momentum_warmup_steps: int = 0
    """Muon's momentum rises linearly from optim.muon_momentum_start to optim.muon_momentum over this many
    optimizer steps (modded-nanogpt, nanochat: 0.85 -> 0.95 or 0.97); 0 = constant from the first step."""
    muon_momentum_start: float = 0.85
    """Muon's momentum at step 0 when optim.muon_momentum_warmup_steps > 0."""
    muon_momentum_final: float | None = None
    """Muon's momentum at the end of the LR decay (WSD's decay, or the whole shape for cosine and linear),
    reached linearly from optim.muon_momentum (nanochat: 0.97 -> 0.90); null = optim.muon_momentum throughout."""
    muon_lr_adjust: Literal["match_rms_adamw", "spectral", "original"] = "match_rms_adamw"
    """How Muon's step follows a matrix's shape. match_rms_adamw (torch's; Moonlight): each update has AdamW's
    RMS at optim.lr, so under model.parametrization mup it takes AdamW's 1/m. spectral: torch's "original"
    adjustment, scaled to equal match_rms_adamw at model.base_dim (at the model's own width under standard): the
    update's spectral norm stays the same as the model widens (Yang, Simon and Bernstein 2023), no 1/m.
    original: torch's "original" adjustment as it is (lr x sqrt(max(1, rows/cols))), so optim.lr is Muon's own
    LR as modded-nanogpt and nanochat state it (their 0.02-0.05); spectral too, so no 1/m under mup."""
    muon_weight_decay: float | None = None
    """Weight decay of Muon's matrices; null = optim.weight_decay (nanochat decays them at 0.28, its head at
    0.01)."""
    cautious_weight_decay: bool = False
    """Muon's matrices: decay only the coordinates whose update has the weight's sign (the update already pulls
    them towards zero: Chen et al. 2025's cautious weight decay, nanochat). The decay per step stays lr x weight
    decay, so it follows the LR schedule."""
    weight_decay_schedule: Literal["constant", "cosine"] = "constant"
    """Muon's weight decay over the budget: constant (the decay per step, lr x weight decay, follows the LR
    schedule) or cosine (the weight decay itself falls to zero along a cosine over the budget, as nanochat's,
    still times the LR)."""
    normuon: bool = False
    """NorMuon (Li et al. 2025, modded-nanogpt, nanochat): after orthogonalisation each neuron's update is divided
    by the root of its own running mean square (optim.normuon_beta2), then the matrix's update is scaled back to
    its norm before, so Muon's step size is unchanged and its neurons are evened out."""
    normuon_beta2: float = 0.95
    """NorMuon: the decay of each neuron's running mean square (the paper's 0.95; nanochat uses 0.9)."""
    muon_ns: Literal["keller", "polar_express"] = "keller"
    """Muon's orthogonalisation: keller (Keller Jordan's quintic Newton-Schulz, 5 steps of one polynomial, as
    torch's) or polar_express (Amsel et al. 2025: a different polynomial at each of the 5 steps, closer to the
    polar factor; modded-nanogpt, nanochat)."""

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
        if self.warmup_share is not None and not 0.0 < self.warmup_share < 1.0:
            raise ConfigError(f"optim.warmup_share={self.warmup_share} must be in (0, 1) (or null)")
        for name in ("embed_lr", "head_lr"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"optim.{name}={value} must be positive (or null: optim.lr)")
        for name in ("muon_momentum", "muon_momentum_start", "muon_momentum_final", "normuon_beta2"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise ConfigError(f"optim.{name}={value} must be in [0, 1)")
        if self.muon_momentum_warmup_steps < 0:
            raise ConfigError(
                f"optim.muon_momentum_warmup_steps={self.muon_momentum_warmup_steps} must be >= 0"
            )
        if self.muon_weight_decay is not None and self.muon_weight_decay < 0:
            raise ConfigError(f"optim.muon_weight_decay={self.muon_weight_decay} must be >= 0 (or null)")
        changed = {k for k in MUON_ONLY if getattr(self, k) != OptimConfig.__dataclass_fields__[k].default}
        if self.name != "muon" and changed:
            first = next(k for k in MUON_ONLY if k in changed)
            raise ConfigError(
                f"optim.{first} is a setting of Muon's; set optim.name muon, or drop it (optim.name is {self.name})"
            )
        # a key read only beside another is refused without it, rather than silently ignored
        if "muon_momentum_start" in changed and not self.muon_momentum_warmup_steps:
            raise ConfigError(
                "optim.muon_momentum_start is read only during a momentum warm-up; set "
                "optim.muon_momentum_warmup_steps, or drop it"
            )
        if "normuon_beta2" in changed and not self.normuon:
            raise ConfigError(
                "optim.normuon_beta2 is read only by NorMuon; set optim.normuon true, or drop it"
            )


# the keys only Muon reads (an AdamW recipe that sets one is told so)
MUON_ONLY = (
    "muon_momentum_warmup_steps",
    "muon_momentum_start",
    "muon_momentum_final",
    "muon_weight_decay",
    "cautious_weight_decay",
    "weight_decay_schedule",
    "normuon",
    "normuon_beta2",
    "muon_ns",
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
