"""The rules behind the plan's device-level choices, one function per choice, each recording its reason in
`why`: precision, float8, the loss kernel, the elementwise kernels (compiler or Liger), fused projections, the
optimizer, attention, compile, LoRA/QLoRA's base, CPU threads and the CPU's allocator."""

from __future__ import annotations

import os
from typing import Literal, NamedTuple

import torch

from hopperlm import cpu_allocator
from hopperlm.config import LoRAConfig, ModelConfig, OptimConfig, TrainConfig
from hopperlm.errors import ConfigError, first_line
from hopperlm.hardware import CPU_ATTENTION, Hardware
from hopperlm.model.lora import count_trainable
from hopperlm.model.qlora import require_bitsandbytes
from hopperlm.plan.attention_probe import (
    CUDNN_FIRST,
    NO_PROBE_ENV,
    AttentionProbe,
    AttentionTiming,
    decide_attention,
    probe_shape,
)
from hopperlm.plan.float8_payoff import PAYOFF_SHARE, converted_share, torchao_available
from hopperlm.plan.record import Precision

FUSED_LOSS_SHARE = 0.01  # the chunked loss when one sequence's logits would fill 1% of the memory budget
LOGIT_BYTES = 10  # per logit on the standard path: 16-bit logits, their fp32 copy, the fp32 log-softmax
# Why no run autotunes unasked: on an H200, h100-350m's max-autotune-no-cudagraphs compile ran past 150 s
# (charged to train.max_hours) and cuBLAS beat every Triton matmul it tried
# (bench-h100-350m-autotune-timed-out.log).
AUTOTUNE_NOT_WORTH = (
    "max-autotune was measured slower to compile and not faster: bench/results/2026-11-22-h200"
)


def choose_precision(tc: TrainConfig, hw: Hardware, why: dict) -> tuple[str, torch.dtype | None]:
    want = tc.precision
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


def choose_fp8(
    tc: TrainConfig,
    lc: LoRAConfig,
    model_cfg: ModelConfig,
    hw: Hardware,
    *,
    precision: Precision,
    compiled: bool,
    why: dict,
) -> str:
    """float8 for the large linear layers, or "off" with the reason. Never an error: an explicit request that
    cannot run here (a GPU without fp8 tensor cores, torchao missing) falls back to bf16 with one line."""

    want = tc.fp8
    if want == "off":
        why["fp8"] = "off (set by train.fp8)"
        return "off"
    if lc.enabled:
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
        if not torchao_available():  # never chosen unasked until a GPU run has measured it
            why["fp8"] = (
                "off, bf16: torchao not installed; hopperlm's native float8 path is not measured on a GPU "
                "yet (train.fp8 native to try it)"
            )
            return "off"
        why["fp8"] = f"tensorwise via torchao: {share:.0%} of the linear FLOPs convert"
        return "tensorwise"
    if want in ("tensorwise", "rowwise") and not torchao_available():
        why["fp8"] = f"off: train.fp8={want} needs torchao (pip install torchao); or use train.fp8 native"
        return "off"
    note = "" if compiled else "; warning: without torch.compile it is slower than bf16"
    why["fp8"] = f"{want} (set by train.fp8): {share:.0%} of the linear FLOPs convert{note}"
    return want


def choose_fused_loss(tc: TrainConfig, model_cfg: ModelConfig, hw: Hardware, why: dict) -> bool:
    """The chunked loss saves the logits' memory and costs ~1% speed (measured on an H200, h100-350m at
    16 x 1024: 193.8K vs 195.8K tokens/s, bench/results/2026-11-22-h200): worth it only where the logits of
    one sequence are a noticeable share of the memory budget (a large vocabulary, a long context, a small
    device)."""
    want, vocab = tc.fused_loss, model_cfg.vocab_size or 0
    if want is not None:
        why["loss"] = f"{'fused chunked' if want else 'standard'} cross-entropy (set by train.fused_loss)"
        return want
    budget = tc.memory_target * (hw.free_memory if hw.device_type == "cuda" else hw.ram * 0.5)
    per_seq = LOGIT_BYTES * tc.seq_len * vocab
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


def choose_kernels(tc: TrainConfig, hw: Hardware, *, compiled: bool, why: dict) -> str:
    """Who writes the elementwise kernels: torch.compile's fusion, or Liger-Kernel's Triton kernels
    (speed/liger.py) when asked for and they can run here; never chosen unasked until a GPU bench row has
    measured it. Never an error: a request that cannot run falls back to the compiler with one line."""
    ours = "compiler fusion" if compiled else "eager PyTorch ops (compile is off)"
    if tc.kernels != "liger":
        why["kernels"] = ours + (
            "; set by train.kernels"
            if tc.kernels == "compiler"
            else "; Liger-Kernel off: not measured faster on a GPU yet (train.kernels liger tries it)"
        )
        return "compiler"
    if hw.device_type != "cuda":
        why["kernels"] = (
            f"{ours} (train.kernels liger: Liger-Kernel's Triton kernels need CUDA, this is {hw.device_type})"
        )
        return "compiler"
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        why["kernels"] = f"{ours} (liger-kernel not installed: pip install liger-kernel)"
        return "compiler"
    why["kernels"] = (
        "Liger-Kernel: RMSNorm, RoPE, SiLU-mul and fused linear cross-entropy (set by train.kernels; the loss "
        "replaces train.fused_loss's)"
    )
    return "liger"


FUSED_PROJECTIONS_ON = (
    "q/k/v and gate/up as one GEMM each (weights concatenated per step; parameters, checkpoints and exports "
    "unchanged)"
)
FUSED_PROJECTIONS_AUTO = (
    "off: not measured faster on a GPU yet; train.fused_projections true turns it on (`hopperlm bench` compares "
    "the two)"
)


def choose_fused_projections(tc: TrainConfig, lc: LoRAConfig, *, fp8: str, kernels: str, why: dict) -> bool:
    """One GEMM for q/k/v and one for gate/up (speed/fused_projections.py), wherever the projections are plain
    linear layers: not under LoRA (an adapter per projection), float8 (its own matmul per layer) or Liger
    (its RoPE and SiLU-mul kernels copy the non-contiguous column slices a fused GEMM returns)."""
    want = tc.fused_projections
    asked = " (train.fused_projections true asked for it)" if want else ""
    if want is False:
        why["fused_projections"] = "off (set by train.fused_projections)"
        return False
    if lc.enabled:
        why["fused_projections"] = f"off: LoRA adapts q/k/v and gate/up separately, as peft does{asked}"
        return False
    if fp8 != "off":
        why["fused_projections"] = f"off: float8 ({fp8}) runs each projection's matmul itself{asked}"
        return False
    if kernels == "liger":
        why["fused_projections"] = (
            "off: Liger's RoPE and SiLU-mul kernels would copy the fused GEMM's column slices to contiguous "
            f"tensors{asked}"
        )
        return False
    # the plan follows measurements: inductor's CPU code has fewer forward kernels fused, but more backward
    # ones (a block in bf16: 8 + 7 -> 6 + 10), so only the GPU's step time can say
    if want is None:
        why["fused_projections"] = FUSED_PROJECTIONS_AUTO
        return False
    why["fused_projections"] = FUSED_PROJECTIONS_ON + " (set by train.fused_projections)"
    return True


def choose_optimizer(oc: OptimConfig, cuda: bool, why: dict) -> tuple[str, bool]:
    # muon: the pair's AdamW (embeddings, head, norms) is fused on CUDA too, so the pair drops a bad step itself
    fused = oc.fused if oc.fused is not None else cuda and oc.name in ("adamw", "muon")
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
            "Muon (batched Newton–Schulz) on the block matrices + AdamW "
            f"({'fused' if fused else 'unfused'}) on embeddings, head and norms (set by optim.name)"
        )
    elif oc.fused is not None:
        why["optimizer"] = f"AdamW, {'fused' if fused else 'unfused'} (set by optim.fused)"
    else:
        why["optimizer"] = "AdamW, fused kernel" if cuda else "AdamW, unfused (the fused kernel is for CUDA)"
    if cuda:  # train/step.py: fused AdamW and hopperlm's Muon (with a fused AdamW) drop a non-finite update
        device_skip = oc.name in ("adamw", "muon") and fused
        why["optimizer"] += (
            "; a non-finite step is dropped on the device (found_inf)"
            if device_skip
            else "; a non-finite step is caught on the host (one sync per step: this optimizer ignores found_inf)"
        )
    return oc.name, fused


def muon_ns_for(device_type: str) -> Literal["bf16", "fp32"]:
    """The Newton–Schulz precision a device runs fast: bf16 on CUDA, as torch.optim.Muon; fp32 on a CPU, where
    bf16 matrix products have no fast kernel (this project's 2-core EPYC: a (6, 128, 512) batch takes 136 ms an
    iteration in bf16 and 4.8 ms in fp32; (2, 512, 2048) 6.5 s against 72 ms), and fp32 only rounds less."""
    return "bf16" if device_type == "cuda" else "fp32"


def choose_muon_ns(optimizer: str, cuda: bool, why: dict, kept: str | None = None) -> Literal["bf16", "fp32"]:
    """Muon's Newton–Schulz precision (plan.muon_ns): bf16 on CUDA, fp32 on a CPU (muon_ns_for); `kept`, a
    resumed run's, from its checkpoint (older ones trained bf16 everywhere): the two round differently and a
    resume must be exact."""
    if kept is not None:
        if optimizer == "muon":
            why["optimizer"] += (
                f"; Newton–Schulz in {kept}, as the checkpoint trained (a resume keeps its rounding)"
            )
        return kept
    chosen = muon_ns_for("cuda" if cuda else "cpu")
    if optimizer == "muon" and chosen == "fp32":
        why["optimizer"] += (
            "; Newton–Schulz in fp32 (bf16 matrix products run 30-90x slower than fp32 on a CPU; "
            "CUDA runs them in bf16, as torch.optim.Muon)"
        )
    return chosen


def choose_attention(
    tc: TrainConfig,
    model_cfg: ModelConfig,
    hw: Hardware,
    precision: Precision,
    why: dict,
    *,
    probe: AttentionProbe | None = None,
    kept: str | None = None,
) -> str:
    """The SDPA kernel: train.attention when set; else flash where it runs, or cuDNN first (flash behind it)
    on a Hopper GPU where `probe` (a real GPU only: plan_run passes it, simulated hardware never gets one) times
    it faster and agreeing on this layer's shape (attention_probe.py). `kept`: a resumed run's kernel, from its
    checkpoint: kept without probing, since two kernels round differently and a resume must be exact."""
    want = tc.attention
    if hw.device_type != "cuda":
        if want not in ("auto", "math"):
            raise ConfigError(f"train.attention={want} needs a CUDA GPU; on CPU use auto or math")
        if want == "math":  # honoured on a CPU too (SDPA's CPU flash kernel is the other one)
            why["attention"] = "SDPA math only (set by train.attention)"
            return "math"
        why["attention"] = f"{CPU_ATTENTION[0]} (PyTorch picks it)"
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
        if kept in ("auto", CUDNN_FIRST):
            if kept == CUDNN_FIRST:
                why["attention"] = "SDPA cudnn first, flash behind it"
            why["attention"] += " (kept from the checkpoint: a resumed run keeps the kernel it started with)"
            return kept
        if probe is None or "cudnn" not in hw.attention or (hw.capability or (0, 0)) < (9, 0):
            return "auto"
        if os.environ.get(NO_PROBE_ENV, "").strip() not in ("", "0"):
            why["attention"] += f"; cudnn not probed ({NO_PROBE_ENV} is set)"
            return "auto"
        if model_cfg.dropout:  # the probe compares kernels without dropout; forcing one untested is a guess
            why["attention"] += "; cudnn not probed (attention dropout)"
            return "auto"
        shape = probe_shape(
            heads=model_cfg.n_heads,
            kv_heads=model_cfg.kv_heads,
            head_dim=hd,
            seq_len=tc.seq_len,
            micro_batch=tc.micro_batch,
            dtype=torch.bfloat16 if precision == "bf16" else torch.float16,
        )
        try:
            timing = probe(shape, hw.device)
        except Exception as e:  # measure_attention never raises; a stand-in may, and it must not stop a plan
            timing = AttentionTiming(error=first_line(e))
        attention, why["attention"] = decide_attention(timing, shape)
        return attention
    elif precision == "fp32":
        why["attention"] = "SDPA memory-efficient kernel (flash needs 16-bit inputs)"
    else:
        why["attention"] = f"SDPA memory-efficient kernel (no flash kernel for {hw.sm} / head_dim {hd})"
    return "auto"


def choose_compile(tc: TrainConfig, lc: LoRAConfig, hw: Hardware, why: dict) -> tuple[bool, str | None, str]:
    on = tc.compile if tc.compile is not None else hw.device_type == "cuda"
    if on and tc.compile is None and lc.quantize == "nf4":
        why["compile"] = (
            "off (QLoRA: compiled, a 7B step ran 2.7x faster but peaked at 11.3 GB instead of 6.8 on an "
            "H100, bench/results/2026-11-27-h100; train.compile true where the memory allows)"
        )
        return False, None, "block"
    if not on:
        why["compile"] = (
            "off (set by train.compile)"
            if tc.compile is False
            else "off (CPU: inductor's start-up outweighs its gain on a short CPU run)"
        )
        return False, None, "block"
    if tc.compile_mode != "auto":
        mode, reason = tc.compile_mode, "set by train.compile_mode"
    else:  # make.py may still switch a launch-bound step to CUDA graphs (reduce-overhead)
        mode, reason = "default", AUTOTUNE_NOT_WORTH
    scope = "block" if tc.compile_scope == "auto" else tc.compile_scope
    scope_note = (
        "each block and the loss compiled once and reused"
        if tc.compile_scope == "auto"
        else "set by train.compile_scope"
    )
    why["compile"] = f"on, mode {mode} ({reason}), scope {scope} ({scope_note})"
    return True, mode, scope


def choose_lora(lc: LoRAConfig, model_cfg: ModelConfig, hw: Hardware, precision: Precision, why: dict) -> str:
    """LoRA/QLoRA: what is adapted and how the frozen base is kept; QLoRA refuses a CPU up front."""
    if not lc.enabled:
        return "none"

    if lc.quantize == "nf4":
        # bitsandbytes 0.50's CPU backend trains NF4 layers only until the first eval: eval repacks the weight
        # for its CPU gemv kernel, which has no autograd, and from then on no gradient flows back through the
        # frozen layers (the input's grad is None): earlier blocks' adapters would learn from wrong gradients.
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


BUSY_LOAD = 0.5  # a 1-minute load average above this (before we start) means another process uses the cores


class ThreadChoice(NamedTuple):
    count: int  # torch's CPU threads in each process
    forced: bool  # the caller sets it: torch's own default (every core, or OMP_NUM_THREADS) would differ
    why: str  # one line, e.g. "1 of 2 cores: the load average is 1.2 before this run starts, ..."


def threads_beside_load(cores: int, *, jobs: int = 1, what: str = "this run") -> ThreadChoice:
    """The threads of each of `jobs` torch processes about to start side by side: OMP_NUM_THREADS where set
    (the user's choice), else every core, or, where the load average says other processes already use the
    cores, the cores they leave (at least one), shared among the jobs: two torch processes spinning on the same
    cores slow each other down many times over (a debug step measured 1.4 s with two threads beside another
    job, 0.025 s with one). `train`, `sweep` and `generate` all choose by this rule."""
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:  # torch already follows it: the user's choice, said as such
        return ThreadChoice(int(omp), jobs > 1, f"{int(omp)} (set by OMP_NUM_THREADS)")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    busy = 0 if load <= BUSY_LOAD else min(cores - 1, round(load))  # cores other processes use (one kept)
    each = max(1, (cores - busy) // jobs)
    side_by_side = jobs > 1  # several processes: each is told its share, torch's default would take all cores
    count = f"{each} each for {jobs} runs side by side" if side_by_side else f"{each}"
    if load <= BUSY_LOAD:
        return ThreadChoice(each, side_by_side, f"{count} (torch's default: every core)" if not side_by_side
                            else f"{count} (of {cores} cores, none busy)")  # fmt: skip
    if busy == 0:
        return ThreadChoice(each, side_by_side, f"{count} (every core; the load average is {load:.1f})")
    return ThreadChoice(
        each,
        True,
        f"{count} of {cores} cores: the load average is {load:.1f} before {what} starts, so other processes use "
        f"{busy} (two torch processes on the same cores slow each other down many times over)",
    )


def choose_threads(tc: TrainConfig, hw: Hardware, why: dict) -> int | None:
    """torch's CPU threads: train.threads, else the rule `sweep` and `generate` share (threads_beside_load).
    The thread count changes the order of float reductions, so a resumed run takes its checkpoint's
    (train/run.py keep_checkpoint_threads), not a new choice."""
    want = tc.threads
    if want is not None:
        why["threads"] = f"{want} (set by train.threads)"
        return want
    if hw.device_type == "cuda":
        return None
    choice = threads_beside_load(hw.cpu_cores)
    why["threads"] = choice.why
    if choice.forced:
        why["threads"] += f"; train.threads {hw.cpu_cores} to take every core anyway"
    return choice.count if choice.forced else None


def choose_cpu_allocator(hw: Hardware, estimate: float, budget: float) -> tuple[bool, str | None]:
    """On a CPU, whether glibc keeps freed blocks for the next step (cpu_allocator.py says why), and the
    reason: not where the environment already chose, nor where the heap it keeps could outgrow the memory
    budget. None on CUDA: there the large tensors live in torch's caching allocator."""
    if hw.device_type == "cuda":
        return False, None
    chosen = cpu_allocator.allocator_set_by_user()
    if chosen:
        return False, f"as {chosen} sets it (the environment's choice wins)"
    if cpu_allocator.glibc() is None:
        return False, (
            f"the platform's malloc ({cpu_allocator.platform_name()}: keeping freed blocks for reuse is a glibc "
            "switch); a preloaded jemalloc or tcmalloc (LD_PRELOAD) does it anywhere"
        )
    kept = cpu_allocator.HEAP_GROWTH * estimate
    if kept > budget:
        return False, (
            f"glibc's default: keeping freed blocks for reuse could grow the heap to {kept / 1e9:.1f} GB "
            f"({cpu_allocator.HEAP_GROWTH:g}x the {estimate / 1e9:.1f} GB estimated), past the "
            f"{budget / 1e9:.1f} GB memory budget"
        )
    return True, (
        f"glibc keeps freed blocks for reuse (mallopt): {cpu_allocator.WHY}; the heap can grow to "
        f"{cpu_allocator.HEAP_GROWTH:g}x the {estimate / 1e9:.2f} GB estimated; {cpu_allocator.TO_KEEP_DEFAULT}"
    )
