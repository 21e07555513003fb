"""`make_plan(config, model_config, hardware, world=...)` turns every `auto` in the config into a choice
(precision, TF32, attention kernel, compile and its mode, activation checkpointing, fused AdamW, pinned memory,
allocator settings, data parallelism over the world's ranks, micro-batch per rank and accumulation), each with
a one-line reason. Explicit config values always win and are reported as such. Hardware can be simulated, so
the choices for an H100 or a T4 are tested on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable

from hopperlm.config import Config, LoRAConfig, ModelConfig, TrainConfig
from hopperlm.data.sft import describe as describe_sft
from hopperlm.data.train_data import describe as describe_data
from hopperlm.errors import ConfigError
from hopperlm.hardware import Hardware
from hopperlm.memory import MemoryEstimate, estimate_memory
from hopperlm.model.transformer import flops_per_token
from hopperlm.plan.attention_probe import AttentionProbe
from hopperlm.plan.choices import (
    choose_attention,
    choose_compile,
    choose_cpu_allocator,
    choose_fp8,
    choose_fused_loss,
    choose_fused_projections,
    choose_kernels,
    choose_lora,
    choose_muon_ns,
    choose_optimizer,
    choose_precision,
    choose_threads,
)
from hopperlm.plan.record import Plan
from hopperlm.plan.strategy import SHARDED, World, choose_strategy, describe_limits, lora_parallel_note

CPU_MICRO_BATCH_CAP = 16  # on a CPU, throughput stops improving well before memory runs out
GPU_MICRO_BATCH_CAP_TOKENS = 1 << 19  # without a global batch, do not grow one micro-batch past 512K tokens
# below this many FLOPs per micro-batch (about 5 ms at a Hopper's measured matmul rate) a step is launch-bound:
# measured on an H200, shakespeare-char-gpu (1.2 TFLOP per micro-batch) ran 16 ms/step eager-launched, 8 with
# CUDA graphs (bench/results/2026-11-22-h200/speedrun.txt)
CUDA_GRAPH_FLOPS = 4e12
# why CUDA graphs never meet gradient accumulation (#96693 is the older report of the same silent overwrite)
GRAPHS_AND_ACCUMULATION = (
    "pytorch/pytorch#169545: a CUDA graph owns the gradients it writes, and a second micro-batch would "
    "accumulate into tensors the next replay overwrites"
)

# micro_batch_finder(model_cfg, plan, cap) -> (micro_batch, reason): measures on the real GPU (batch_finder.py)
Finder = Callable[[ModelConfig, Plan, int], tuple[int, str]]


def _micro_batch(
    tc: TrainConfig, plan: Plan, hw: Hardware, model_cfg: ModelConfig, finder: Finder | None
) -> tuple[int, int, str]:
    """(micro-batch per rank, accumulation steps, reason)."""
    seqs = _per_rank(tc, plan.world_size)
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
        if seqs is not None and seqs % micro:  # accumulation must reach the global batch exactly
            fit, micro = micro, fewest_accumulation_steps(seqs, micro)
            reason += (
                f"; {fit} fit, {micro} = {seqs} / {seqs // micro} is the largest equal micro-batch that "
                "reaches the global batch exactly"
            )
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


def fewest_accumulation_steps(seqs: int, fit: int) -> int:
    """The micro-batch that reaches `seqs` sequences in the fewest equal micro-batches of at most `fit`: the
    smallest accumulation a >= ceil(seqs / fit) that divides `seqs`, and micro = seqs / a. Micro-batch and
    accumulation pair up as divisors (micro x a = seqs), so this is also the largest divisor of `seqs` that
    fits: no equal split does better. E.g. 256 sequences with 78 fitting: 4 x 64 (3 x 86 would be 258).
    Unequal micro-batches would fill the memory better but change what a step's data is; not done."""
    accum = -(-seqs // fit)
    while seqs % accum:
        accum += 1
    return seqs // accum


def _per_rank(tc: TrainConfig, world_size: int) -> int | None:
    """Sequences per step on each rank: the global batch split evenly (None: one micro-batch per rank)."""
    seqs = tc.batch_seqs
    if seqs is None or world_size == 1:
        return seqs
    if seqs % world_size:
        raise ConfigError(
            f"train.batch_tokens={tc.batch_tokens} is {seqs} sequences, which {world_size} ranks cannot "
            f"share equally; use a multiple of {world_size * tc.seq_len} tokens"
        )
    return seqs // world_size


def _checkpointing(
    tc: TrainConfig, lc: LoRAConfig, plan: Plan, model_cfg: ModelConfig, hw: Hardware
) -> tuple[str, str, MemoryEstimate]:
    """(mode, reason, memory estimate): activation checkpointing none when one sequence's activations fit the
    memory target, else the lightest mode that makes them fit (selective-op, then full)."""
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
            lora=lc,
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
    *,
    attention_probe: AttentionProbe | None = None,
    kept_attention: str | None = None,
    kept_muon_ns: str | None = None,
) -> Plan:
    """Every choice for this run, with reasons. `finder` measures the micro-batch on a real GPU; without it
    (CPU, simulated hardware) the memory estimate decides. `attention_probe` times cuDNN against flash on a
    real Hopper GPU (plan/attention_probe.py); without it flash stays; `kept_attention` (a resumed run's, from its
    checkpoint) is kept without probing, as is `kept_muon_ns` (Muon's Newton–Schulz precision). `world`: the
    ranks of a torchrun launch.
    train/data_and_plan.py's `plan_run` is the one caller that `train` and `diagnose` share."""
    tc = cfg.train
    world = world or World()
    why: dict[str, str] = {"device": hw.summary()[0].removeprefix("device: ")}
    precision, autocast_dtype = choose_precision(tc, hw, why)
    cuda = hw.device_type == "cuda"
    lora = choose_lora(cfg.lora, model_cfg, hw, precision, why)
    tf32 = tc.tf32 if tc.tf32 is not None else hw.tf32
    if cuda:
        why["tf32"] = ("on" if tf32 else "off") + (
            " (set by train.tf32)"
            if tc.tf32 is not None
            else f" ({hw.sm} {'has' if hw.tf32 else 'lacks'} TF32)"
        )
    attention = choose_attention(
        tc, model_cfg, hw, precision, why, probe=attention_probe, kept=kept_attention
    )
    compile_on, compile_mode, compile_scope = choose_compile(tc, cfg.lora, hw, why)
    fp8 = choose_fp8(tc, cfg.lora, model_cfg, hw, precision=precision, compiled=compile_on, why=why)
    fused_loss = choose_fused_loss(tc, model_cfg, hw, why)
    kernels = choose_kernels(tc, hw, compiled=compile_on, why=why)
    fused_projections = choose_fused_projections(tc, cfg.lora, fp8=fp8, kernels=kernels, why=why)
    optimizer, fused = choose_optimizer(cfg.optim, cuda, why)
    muon_ns = choose_muon_ns(optimizer, cuda, why, kept=kept_muon_ns)
    threads = choose_threads(tc, hw, why)
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
    why["parallel"] += lora_parallel_note(cfg.lora, model_cfg, strategy, precision)
    if world.size > 1:
        why["timeouts"] = describe_limits(cfg.parallel.startup_timeout_s, cfg.parallel.step_timeout_s)
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
        fused_projections=fused_projections,
        kernels=kernels,
        optimizer=optimizer,
        muon_ns=muon_ns,
        lora=lora,
        strategy=strategy,
        world_size=world.size,
        dp_shard=dp_shard,
        fp8_all_gather=fp8_all_gather,
        threads=threads,
        reasons=why,
    )
    return _fitted(plan, tc, cfg.lora, model_cfg, hw, finder=finder, budget=budget)


def _fitted(
    plan: Plan,
    tc: TrainConfig,
    lora: LoRAConfig,
    model_cfg: ModelConfig,
    hw: Hardware,
    *,
    finder: Finder | None,
    budget: float,
) -> Plan:
    """The plan fitted to memory: activation checkpointing, the micro-batch, CUDA graphs, the memory estimate
    and, on a CPU, the C library's allocator (`budget`: the bytes the run may fill)."""
    mode, ac_reason, memory = _checkpointing(tc, lora, plan, model_cfg, hw)
    plan = plan.replace(
        activation_checkpointing=mode, memory=memory, reasons={"activation_checkpointing": ac_reason}
    )
    micro, accum, mb_reason = _micro_batch(tc, plan, hw, model_cfg, finder)
    plan = plan.replace(micro_batch=micro, grad_accum=accum, reasons={"micro_batch": mb_reason})
    plan = _cuda_graphs(tc, plan, model_cfg)
    plan = plan.replace(reasons={"memory": f"estimated {plan.memory.describe(plan.micro_batch)}"})
    keep_freed, allocator = choose_cpu_allocator(hw, plan.memory.total(plan.micro_batch), budget)
    if allocator:
        plan = plan.replace(keep_freed_memory=keep_freed, reasons={"allocator": allocator})
    return plan


def _cuda_graphs(tc: TrainConfig, plan: Plan, model_cfg: ModelConfig) -> Plan:
    """CUDA graphs (compile mode reduce-overhead) when a micro-batch is so small that launching its kernels
    takes longer than running them; shapes are static here (fixed windows), which graphs need. Only where they
    are safe: on CUDA, with one micro-batch per step. An explicit reduce-overhead that meets accumulation
    (or a CPU) falls back to mode default, with the reason. Under graphs an out-of-memory error stops the run
    instead of halving the micro-batch (train/loop.py back_off): doubling accumulation mid-run is exactly the
    unsafe case, and no plan can promise that a step never runs out of memory."""
    if not plan.compile:
        return plan
    scope = f"scope {plan.compile_scope}"
    if tc.compile_mode == "reduce-overhead":
        if plan.device.type != "cuda":
            why = "CUDA graphs need a CUDA device; this run is on the CPU"
        elif plan.grad_accum > 1:
            accum = f"{plan.grad_accum} accumulation steps"
            why = f"CUDA graphs are unsafe with {accum} ({GRAPHS_AND_ACCUMULATION})"
        else:
            reason = (
                "on, mode reduce-overhead (set by train.compile_mode; an out-of-memory error stops the run "
                f"rather than doubling accumulation under CUDA graphs), {scope}"
            )
            return plan.replace(reasons={"compile": reason})
        reason = f"on, mode default (train.compile_mode reduce-overhead asked for it, but {why}), {scope}"
        return plan.replace(compile_mode="default", reasons={"compile": reason})
    if tc.compile_mode != "auto" or plan.device.type != "cuda" or plan.fp8 != "off":
        return plan
    if plan.world_size > 1:
        return plan  # (several ranks: graphs would capture the gradient collectives too; not attempted)
    step_flops = flops_per_token(model_cfg, plan.seq_len) * plan.seq_len * plan.micro_batch
    if step_flops >= CUDA_GRAPH_FLOPS:
        return plan
    small = f"one micro-batch is {step_flops / 1e12:.1f} TFLOP, too little to hide its kernels' launches"
    if plan.grad_accum > 1:
        note = f"; no CUDA graphs although {small}: {plan.grad_accum} accumulation steps"
        note += f" ({GRAPHS_AND_ACCUMULATION})"
        return plan.replace(reasons={"compile": plan.reasons["compile"] + note})
    reason = (
        f"on, mode reduce-overhead (CUDA graphs: {small}; an out-of-memory error stops the run rather than "
        f"doubling accumulation under graphs), {scope}"
    )
    return plan.replace(compile_mode="reduce-overhead", reasons={"compile": reason})
