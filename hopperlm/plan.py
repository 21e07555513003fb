"""The plan: the concrete choices for one run on one machine, each with a one-line reason.

`make_plan(config, model_config, hardware, world=...)` turns every `auto` in the config into a choice (precision,
TF32, attention kernel, compile and its mode, activation checkpointing, fused AdamW, pinned memory, allocator
settings, data parallelism over the world's ranks, micro-batch per rank and accumulation). Explicit config values always win and are reported as such.
Hardware can be simulated, so the choices for an H100 or a T4 are tested on a CPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from hopperlm.config import Config, ModelConfig
from hopperlm.data.sft import describe as describe_sft
from hopperlm.data.train_data import describe as describe_data
from hopperlm.dist.parallelize import SHARDED, choose_strategy
from hopperlm.dist.runtime import World
from hopperlm.errors import ConfigError
from hopperlm.hardware import Hardware
from hopperlm.memory import MemoryEstimate, estimate_memory
from hopperlm.model.lora import count_trainable
from hopperlm.model.qlora import require_bitsandbytes
from hopperlm.model.transformer import flops_per_token
from hopperlm.speed.float8 import PAYOFF_SHARE, converted_share, torchao_available

FUSED_LOSS_SHARE = 0.01  # the chunked loss when one sequence's logits would fill 1% of the memory budget
LOGIT_BYTES = 10  # per logit on the standard path: 16-bit logits, their fp32 copy, the fp32 log-softmax
CPU_MICRO_BATCH_CAP = 16  # on a CPU, throughput stops improving well before memory runs out
GPU_MICRO_BATCH_CAP_TOKENS = 1 << 19  # without a global batch, do not grow one micro-batch past 512K tokens
LONG_RUN_HOURS = 1.0
LONG_RUN_STEPS = 20_000
# below this many FLOPs per micro-batch (about 5 ms at a Hopper's measured matmul rate) a step is launch-bound:
# measured on an H200, shakespeare-char-gpu (1.2 TFLOP per micro-batch) ran 16 ms/step eager-launched, 8 with
# CUDA graphs (bench/results/2026-11-22-h200/speedrun.txt)
CUDA_GRAPH_FLOPS = 4e12

# micro_batch_finder(model_cfg, plan, cap) -> (micro_batch, reason): measures on the real GPU (batch_finder.py)
Finder = Callable[[ModelConfig, "Plan", int], tuple[int, str]]


class Reasons(dict):
    """The plan's reasons, key -> one line; read-only once the plan is made (a frozen plan's reasons too)."""

    def _frozen(self, *args, **kwargs):
        raise TypeError("a Plan is immutable: what changes during a run belongs to the run's state")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _frozen

    def __reduce__(self):
        return Reasons, (dict(self),)


@dataclass(frozen=True)
class Plan:
    """Every choice for one run on one machine, each with a one-line reason. Immutable once made: what changes
    while a run goes (the micro-batch after an out-of-memory error, a float8 backend that fails at start-up)
    is the run's state, logged when it changes (train/run.py)."""

    device: torch.device
    precision: str  # "fp32" | "bf16" | "fp16"
    autocast_dtype: torch.dtype | None
    loss_scaling: bool
    tf32: bool
    attention: str  # "auto" (SDPA's own dispatch) or the backend forced first
    compile: bool
    compile_mode: str | None
    activation_checkpointing: str  # "none" | "selective-op" | "selective-block" | "full"
    fused_adamw: bool
    pin_memory: bool
    expandable_segments: bool
    seq_len: int
    compile_scope: str = "block"
    ac_every: int = 2
    fp8: str = "off"  # "off" | "tensorwise" | "rowwise" | "native"
    fused_loss: bool = False
    optimizer: str = "adamw"  # "adamw" | "adamw8bit" | "muon" | "paged_adamw8bit"
    lora: str = "none"  # "none", or what is adapted and how the base is stored
    micro_batch: int = 0  # per rank
    grad_accum: int = 1
    memory: MemoryEstimate | None = None
    strategy: str = "none"  # "none" | "ddp" | "fsdp" | "hsdp" (dist/parallelize.py)
    world_size: int = 1
    dp_shard: int = 1  # ranks one copy of the weights/grads/optimizer state is sharded over
    fp8_all_gather: bool = False  # FSDP all-gathers float8 weights (tensorwise fp8 only)
    reasons: Mapping[str, str] = field(default_factory=Reasons)

    def __post_init__(self) -> None:
        if not isinstance(self.reasons, Reasons):
            object.__setattr__(self, "reasons", Reasons(self.reasons))

    def replace(self, **changes) -> Plan:
        """A new plan with `changes` (and reasons updated from changes["reasons"], if given)."""
        reasons = {**self.reasons, **changes.pop("reasons", {})}
        return dataclasses.replace(self, reasons=Reasons(reasons), **changes)

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step, all ranks together."""
        return self.micro_batch * self.seq_len * self.grad_accum * self.world_size

    def lines(self) -> list[str]:
        return [f"{key}: {reason}" for key, reason in self.reasons.items()]

    def autocast(self) -> AbstractContextManager:
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def sdpa_backends(self) -> AbstractContextManager:
        """The attention kernels SDPA may use: the chosen one first, safe fallbacks after (auto), or
        exactly the one the config forced."""
        if self.attention == "auto" or self.device.type != "cuda":
            return nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        names = {
            "flash": SDPBackend.FLASH_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH,
        }
        return sdpa_kernel([names[self.attention]])

    def apply_runtime_settings(self, log: Callable[[str], None]) -> None:
        """Process-wide switches the plan owns (TF32, allocator)."""
        if self.device.type != "cuda":
            return
        torch.backends.cuda.matmul.allow_tf32 = self.tf32
        torch.backends.cudnn.allow_tf32 = self.tf32
        if self.expandable_segments:
            # private APIs (the env var only works before CUDA starts); newer torch renamed the setter
            setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
            setter = setter or torch.cuda.memory._set_allocator_settings
            try:
                setter("expandable_segments:True")
            except (AttributeError, RuntimeError):
                log("allocator: default (this torch cannot switch on expandable segments at run time)")


def _precision(
    cfg: Config, model_cfg: ModelConfig, hw: Hardware, why: dict
) -> tuple[str, torch.dtype | None]:
    want = cfg.train.precision
    if hw.device_type != "cuda":
        if want in ("bf16", "fp16"):
            raise ConfigError(f"train.precision={want} needs a CUDA GPU; on CPU use --train.precision fp32")
        why["precision"] = "fp32 (CPU: 16-bit autocast buys nothing here)"
        return "fp32", None
    if want == "bf16" and not hw.bf16:
        raise ConfigError(f"train.precision=bf16 but {hw.name} ({hw.sm}) has no bf16; use fp16 or auto")
    if want != "auto":
        why["precision"] = f"{want} (set by train.precision)"
        return want, {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[want]
    if not hw.bf16:
        why["precision"] = f"fp16 + dynamic loss scaling ({hw.sm} has no bf16 tensor cores)"
        return "fp16", torch.float16
    why["precision"] = f"bf16 autocast, fp32 master weights ({hw.sm} has bf16 tensor cores)"
    return "bf16", torch.bfloat16


def _fp8(cfg: Config, model_cfg: ModelConfig, hw: Hardware, precision: str, compiled: bool, why: dict) -> str:
    """float8 for the large linear layers, or "off" with the reason. Never an error: an explicit request that
    cannot run here (a GPU without fp8 tensor cores, torchao missing) falls back to bf16 with one line."""

    want = cfg.train.fp8
    if want == "off":
        why["fp8"] = "off (set by train.fp8)"
        return "off"
    if cfg.lora.enabled:
        why["fp8"] = "off: LoRA's large matrices are frozen (float8 training is for weights that learn)"
        return "off"
    asked = "" if want == "auto" else f" (train.fp8={want} asked for it)"
    if hw.device_type != "cuda" or not hw.fp8:
        where = "CPU" if hw.device_type != "cuda" else f"{hw.sm} ({hw.name})"
        why["fp8"] = f"off: {where} has no fp8 tensor cores{asked}"
        return "off"
    if precision != "bf16":
        why["fp8"] = f"off: float8 training runs beside bf16 autocast, this run is {precision}{asked}"
        return "off"
    recipe = "rowwise" if want == "rowwise" else "tensorwise"
    share = converted_share(model_cfg, recipe)
    if want == "auto":
        if not compiled:
            why["fp8"] = "off: without torch.compile float8's casts cost more than its matmuls save"
            return "off"
        if share < PAYOFF_SHARE:
            why["fp8"] = (
                f"off: only {share:.0%} of the linear FLOPs are in layers large enough to gain from float8 "
                f"at d={model_cfg.dim} (it pays from about d=2048)"
            )
            return "off"
        want = "tensorwise" if torchao_available() else "native"
        source = "torchao" if want == "tensorwise" else "hopperlm's _scaled_mm path (torchao not installed)"
        why["fp8"] = f"{want} via {source}: {share:.0%} of the linear FLOPs convert"
        return want
    if want in ("tensorwise", "rowwise") and not torchao_available():
        why["fp8"] = f"off: train.fp8={want} needs torchao (pip install torchao); or use train.fp8 native"
        return "off"
    note = "" if compiled else "; warning: without torch.compile it is slower than bf16"
    why["fp8"] = f"{want} (set by train.fp8): {share:.0%} of the linear FLOPs convert{note}"
    return want


def _fused_loss(cfg: Config, model_cfg: ModelConfig, hw: Hardware, why: dict) -> bool:
    """The chunked loss saves the logits' memory and costs ~1% speed (measured on an H200, h100-350m at
    16 x 1024: 193.8K vs 195.8K tokens/s, bench/results/2026-11-22-h200): worth it only where the logits of
    one sequence are a noticeable share of the memory budget (a large vocabulary, a long context, a small
    device)."""
    want, vocab = cfg.train.fused_loss, model_cfg.vocab_size or 0
    if want is not None:
        why["loss"] = f"{'fused chunked' if want else 'standard'} cross-entropy (set by train.fused_loss)"
        return want
    budget = cfg.train.memory_target * (hw.free_memory if hw.device_type == "cuda" else hw.ram * 0.5)
    per_seq = LOGIT_BYTES * cfg.train.seq_len * vocab
    share = per_seq / budget if budget else 1.0
    if share >= FUSED_LOSS_SHARE:
        why["loss"] = (
            f"fused chunked cross-entropy (one sequence's logits would take {per_seq / 1e9:.2f} GB, "
            f"{share:.1%} of the memory budget; chunks never hold them whole)"
        )
        return True
    why["loss"] = (
        f"standard cross-entropy (one sequence's logits take {share:.2%} of the memory budget: the chunked "
        "loss would save little and cost ~1% speed)"
    )
    return False


def _optimizer(cfg: Config, cuda: bool, why: dict) -> tuple[str, bool]:
    oc = cfg.optim
    fused = oc.fused if oc.fused is not None else cuda and oc.name == "adamw"
    if oc.name == "paged_adamw8bit":
        if not cuda:
            raise ConfigError("optim.name=paged_adamw8bit needs a CUDA GPU (paged memory); on CPU use adamw")

        require_bitsandbytes()
        why["optimizer"] = (
            "bitsandbytes' paged 8-bit AdamW (set by optim.name): states page to host memory under pressure"
        )
    elif oc.name == "adamw8bit":
        import importlib.util

        if importlib.util.find_spec("torchao") is None:
            raise ConfigError(
                "optim.name=adamw8bit needs torchao (pip install torchao) or use optim.name adamw"
            )
        why["optimizer"] = "AdamW with torchao's 8-bit states (set by optim.name)"
    elif oc.name == "muon":
        why["optimizer"] = (
            "Muon on the block matrices + AdamW on embeddings, head and norms (set by optim.name)"
        )
    elif oc.fused is not None:
        why["optimizer"] = f"AdamW, {'fused' if fused else 'unfused'} (set by optim.fused)"
    else:
        why["optimizer"] = "AdamW, fused kernel" if cuda else "AdamW, unfused (the fused kernel is for CUDA)"
    return oc.name, fused


def _attention(cfg: Config, model_cfg: ModelConfig, hw: Hardware, precision: str, why: dict) -> str:
    want = cfg.train.attention
    if hw.device_type != "cuda":
        if want not in ("auto", "math"):
            raise ConfigError(f"train.attention={want} needs a CUDA GPU; on CPU use auto")
        why["attention"] = "SDPA's CPU kernel (PyTorch picks it)"
        return "auto"
    if want != "auto":
        if want not in hw.attention:
            raise ConfigError(
                f"train.attention={want} is not available on {hw.name} ({hw.sm}); "
                f"available: {', '.join(hw.attention)}; or use auto"
            )
        why["attention"] = f"SDPA {want} only (set by train.attention)"
        return want
    hd = model_cfg.head_dim
    if "flash" in hw.attention and precision != "fp32" and hd <= 256:
        why["attention"] = f"SDPA flash ({hw.sm}, {precision}, head_dim {hd}); others as fallback"
    elif precision == "fp32":
        why["attention"] = "SDPA memory-efficient kernel (flash needs 16-bit inputs)"
    else:
        why["attention"] = f"SDPA memory-efficient kernel (no flash kernel for {hw.sm} / head_dim {hd})"
    return "auto"


def _compile(cfg: Config, hw: Hardware, why: dict) -> tuple[bool, str | None, str]:
    tc = cfg.train
    on = tc.compile if tc.compile is not None else hw.device_type == "cuda"
    if on and tc.compile is None and cfg.lora.quantize == "nf4":
        why["compile"] = (
            "off (QLoRA: bitsandbytes' 4-bit layers are not traced reliably; train.compile true to try)"
        )
        return False, None, "block"
    if not on:
        why["compile"] = (
            "off (set by train.compile)"
            if tc.compile is False
            else "off (CPU: inductor's start-up outweighs its gain on a short CPU run)"
        )
        return False, None, "block"
    long_run = (tc.max_hours or 0) >= LONG_RUN_HOURS or (tc.max_steps or 0) >= LONG_RUN_STEPS
    if tc.compile_mode != "auto":
        mode, reason = tc.compile_mode, "set by train.compile_mode"
    elif long_run:
        mode, reason = "max-autotune-no-cudagraphs", "a long run repays minutes of kernel autotuning"
    else:
        mode, reason = "default", "a short run: autotuning would cost more than it saves"
    scope = "block" if tc.compile_scope == "auto" else tc.compile_scope
    scope_note = (
        "each block and the loss compiled once and reused"
        if tc.compile_scope == "auto"
        else "set by train.compile_scope"
    )
    why["compile"] = f"on, mode {mode} ({reason}), scope {scope} ({scope_note})"
    return True, mode, scope


def _micro_batch(
    cfg: Config, plan: Plan, hw: Hardware, model_cfg: ModelConfig, finder: Finder | None
) -> tuple[int, int, str]:
    """(micro-batch per rank, accumulation steps, reason)."""
    tc = cfg.train
    seqs = _per_rank(cfg, plan.world_size)
    est = plan.memory
    if hw.device_type == "cuda":
        budget = tc.memory_target * hw.free_memory
        where = f"{tc.memory_target:.0%} of {hw.free_memory / 1024**3:.1f} GiB free"
    else:
        budget = tc.memory_target * hw.ram * 0.5
        where = f"{tc.memory_target:.0%} of half the RAM ({hw.ram / 1024**3:.0f} GiB)"
    if tc.micro_batch is not None:
        micro, reason = tc.micro_batch, "set by train.micro_batch"
        if est.total(micro) > budget:
            reason += f"; warning: estimated {est.total(micro) / 1e9:.1f} GB exceeds {where}"
    else:
        if hw.device_type == "cuda":
            cap = seqs or max(1, GPU_MICRO_BATCH_CAP_TOKENS // tc.seq_len)
        else:
            cap = seqs or CPU_MICRO_BATCH_CAP
        if finder is not None and plan.dp_shard == 1:  # the finder measures an unsharded replica
            micro, reason = finder(model_cfg, plan, cap)
        else:
            fit = est.largest_micro_batch(budget)
            micro, reason = min(fit, cap), f"largest that the estimate fits in {where}, at most {cap}"
        if micro < 1:
            if est.static > budget:  # no activation setting helps: the model's state alone is too big
                fix = "use optim.name adamw8bit, a smaller model, or shard it over GPUs (FSDP)"
            else:
                fix = "use train.activation_checkpointing full, a shorter train.seq_len or a smaller model"
            raise ConfigError(
                f"one sequence of {tc.seq_len} tokens does not fit {where} (estimate {est.describe(1)}); {fix}"
            )
        if seqs is not None:
            while seqs % micro:  # accumulation must reach the global batch exactly
                micro -= 1
    if seqs is not None and seqs % micro:
        raise ConfigError(
            f"train.micro_batch={micro} does not divide the {seqs} sequences each of the {plan.world_size} "
            f"ranks takes per step; use a divisor of {seqs}"
        )
    accum = 1 if seqs is None else seqs // micro
    global_note = "" if seqs is None else f" -> {accum} accumulation step(s) for {seqs} sequences"
    if plan.world_size > 1:
        global_note += f" per rank, x {plan.world_size} ranks"
    return micro, accum, f"{micro} ({reason}){global_note}"


def _per_rank(cfg: Config, world_size: int) -> int | None:
    """Sequences per step on each rank: the global batch split evenly (None: one micro-batch per rank)."""
    seqs = cfg.train.batch_seqs
    if seqs is None or world_size == 1:
        return seqs
    if seqs % world_size:
        raise ConfigError(
            f"train.batch_tokens={cfg.train.batch_tokens} is {seqs} sequences, which {world_size} ranks cannot "
            f"share equally; use a multiple of {world_size * cfg.train.seq_len} tokens"
        )
    return seqs // world_size


def _checkpointing(
    cfg: Config, plan: Plan, model_cfg: ModelConfig, hw: Hardware
) -> tuple[str, str, MemoryEstimate]:
    """(mode, reason, memory estimate): activation checkpointing none when one sequence's activations fit the
    memory target, else the lightest mode that makes them fit (selective-op, then full)."""
    tc = cfg.train
    budget = tc.memory_target * (hw.free_memory if hw.device_type == "cuda" else hw.ram * 0.5)

    def estimate(mode: str) -> MemoryEstimate:
        return estimate_memory(
            model_cfg,
            tc.seq_len,
            plan.precision,
            checkpointing=mode,
            fused_loss=plan.fused_loss,
            optimizer=plan.optimizer,
            every=tc.ac_every,
            shards=plan.dp_shard,
            lora=cfg.lora,
        )

    if tc.activation_checkpointing != "auto":
        mode = tc.activation_checkpointing
        reason = f"{mode} (set by train.activation_checkpointing)"
    elif estimate("none").largest_micro_batch(budget) >= 1:
        mode, reason = "none", "none (activations fit; recomputing would cost speed)"
    elif estimate("selective-op").largest_micro_batch(budget) >= 1:
        mode = "selective-op"
        reason = (
            "selective-op (without it one sequence does not fit the memory target; matmul outputs kept, "
            "elementwise ops recomputed)"
        )
    else:
        mode = "full"
        reason = "full (even with selective recomputation one sequence does not fit the memory target)"
    return mode, reason, estimate(mode)


def make_plan(
    cfg: Config,
    model_cfg: ModelConfig,
    hw: Hardware,
    finder: Finder | None = None,
    world: World | None = None,
) -> Plan:
    """Every choice for this run, with reasons. `finder` measures the micro-batch on a real GPU; without it
    (CPU, simulated hardware) the memory estimate decides. `world`: the ranks of a torchrun launch.
    train/setup.py's `plan_run` is the one caller that `train` and `diagnose` share."""
    tc = cfg.train
    world = world or World()
    why: dict[str, str] = {"device": hw.summary()[0].removeprefix("device: ")}
    precision, autocast_dtype = _precision(cfg, model_cfg, hw, why)
    cuda = hw.device_type == "cuda"
    lora = _lora(cfg, model_cfg, hw, precision, why)
    tf32 = tc.tf32 if tc.tf32 is not None else hw.tf32
    if cuda:
        why["tf32"] = ("on" if tf32 else "off") + (
            " (set by train.tf32)"
            if tc.tf32 is not None
            else f" ({hw.sm} {'has' if hw.tf32 else 'lacks'} TF32)"
        )
    attention = _attention(cfg, model_cfg, hw, precision, why)
    compile_on, compile_mode, compile_scope = _compile(cfg, hw, why)
    fp8 = _fp8(cfg, model_cfg, hw, precision, compile_on, why)
    fused_loss = _fused_loss(cfg, model_cfg, hw, why)
    optimizer, fused = _optimizer(cfg, cuda, why)
    pin = tc.pin_memory if tc.pin_memory is not None else cuda
    why["data"] = describe_data(cfg.data, hw.device, model_cfg.dropout) + (
        ", pinned host memory + non-blocking copies" if pin else ""
    )
    if cfg.sft.path:
        why["data"] = describe_sft(cfg.sft, hw.device, model_cfg.dropout)
    if cuda:
        why["allocator"] = "expandable segments (less fragmentation when batch shapes change)"
    budget = tc.memory_target * (hw.free_memory if cuda else hw.ram * 0.5)
    strategy, dp_shard, why["parallel"] = choose_strategy(
        cfg,
        model_cfg,
        hw,
        world,
        precision=precision,
        fused_loss=fused_loss,
        optimizer=optimizer,
        budget=budget,
    )
    fp8_all_gather = fp8 == "tensorwise" and strategy in SHARDED
    if fp8_all_gather:
        why["fp8"] += "; FSDP all-gathers the weights in float8 (half of bf16's bytes)"
    plan = Plan(
        device=hw.device,
        precision=precision,
        autocast_dtype=autocast_dtype,
        loss_scaling=precision == "fp16",
        tf32=tf32,
        attention=attention,
        compile=compile_on,
        compile_mode=compile_mode,
        activation_checkpointing="none",
        fused_adamw=fused,
        pin_memory=pin,
        expandable_segments=cuda,
        seq_len=tc.seq_len,
        compile_scope=compile_scope,
        ac_every=tc.ac_every,
        fp8=fp8,
        fused_loss=fused_loss,
        optimizer=optimizer,
        lora=lora,
        strategy=strategy,
        world_size=world.size,
        dp_shard=dp_shard,
        fp8_all_gather=fp8_all_gather,
        reasons=why,
    )
    mode, ac_reason, memory = _checkpointing(cfg, plan, model_cfg, hw)
    plan = plan.replace(
        activation_checkpointing=mode, memory=memory, reasons={"activation_checkpointing": ac_reason}
    )
    micro, accum, mb_reason = _micro_batch(cfg, plan, hw, model_cfg, finder)
    plan = plan.replace(micro_batch=micro, grad_accum=accum, reasons={"micro_batch": mb_reason})
    plan = _cuda_graphs(cfg, plan, model_cfg)
    return plan.replace(reasons={"memory": f"estimated {plan.memory.describe(plan.micro_batch)}"})


def _lora(cfg: Config, model_cfg: ModelConfig, hw: Hardware, precision: str, why: dict) -> str:
    """LoRA/QLoRA: what is adapted and how the frozen base is kept; QLoRA refuses a CPU up front."""
    lc = cfg.lora
    if not lc.enabled:
        return "none"

    if lc.quantize == "nf4":
        if hw.device_type != "cuda":
            raise ConfigError(
                "lora.quantize=nf4 (QLoRA) needs a CUDA GPU (bitsandbytes' 4-bit training path); "
                "on this CPU use lora.quantize none (LoRA on the full-precision base)"
            )

        require_bitsandbytes()
        base = "NF4 + double quantisation (bitsandbytes), computed in bf16"
    else:
        base = "fp32" if precision == "fp32" else precision
    scale = "alpha/sqrt(r)" if lc.rslora else "alpha/r"
    desc = f"rank {lc.rank} on {lc.targets}, base frozen in {base}"
    why["lora"] = (
        f"{desc}; {count_trainable(model_cfg, lc):,} trainable parameters, scale {scale} = "
        f"{lc.alpha / (lc.rank**0.5 if lc.rslora else lc.rank):g}"
    )
    return desc


def _cuda_graphs(cfg: Config, plan: Plan, model_cfg: ModelConfig) -> Plan:
    """CUDA graphs (compile mode reduce-overhead) when a micro-batch is so small that launching its kernels
    takes longer than running them; shapes are static here (fixed windows), which graphs need."""
    if not plan.compile or cfg.train.compile_mode != "auto" or plan.fp8 != "off" or plan.world_size > 1:
        return plan  # (several ranks: graphs would capture the gradient collectives too; not attempted)
    step_flops = flops_per_token(model_cfg, plan.seq_len) * plan.seq_len * plan.micro_batch
    if step_flops >= CUDA_GRAPH_FLOPS:
        return plan
    reason = (
        f"on, mode reduce-overhead (CUDA graphs: one micro-batch is {step_flops / 1e12:.1f} TFLOP, too little "
        f"to hide the launch overhead of its kernels), scope {plan.compile_scope}"
    )
    return plan.replace(compile_mode="reduce-overhead", reasons={"compile": reason})
