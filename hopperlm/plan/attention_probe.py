"""cuDNN or FlashAttention-2 for this run's causal attention, decided by timing both on the layer's own shape.

PyTorch's notes put cuDNN's SDPA up to 75% ahead of FlashAttention-2 on an H100, but SDPA's own dispatch takes
flash on sm_90, and which kernel wins depends on the head size, the sequence length and the GQA ratio. So on a
Hopper GPU with bf16/fp16, `choose_attention` (choices.py) times forward + backward of one
`scaled_dot_product_attention(is_causal=True)` under each kernel alone, checks that cuDNN's output and input
gradients agree with flash's, and forces cuDNN only when it agrees and wins by `CUDNN_MARGIN`. Everything that
can go wrong (no cuDNN kernel for this shape, GQA or head size unsupported, any exception) keeps flash, with the
reason. About a second on a GPU: two kernels x (1 + `WARMUP` + `REPEATS`) calls on at most `PROBE_TOKENS`
tokens; past a 32K context one sequence alone costs more (the work grows with T^2): a few seconds at 64K.

The measuring (`measure_attention`) is separate from the deciding (`decide_attention`), so the decision is
tested on a CPU with made-up timings, and `agreement` (the numerics check) runs there on two CPU kernels.
Packed documents take FlexAttention (model/attention.py), which this does not touch.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hopperlm.errors import first_line

NO_PROBE_ENV = (
    "HOPPERLM_NO_ATTENTION_PROBE"  # =1: keep flash without measuring (train.attention forces one too)
)
# bf16 keeps 8 significant bits: one unit in the last place is 2^-8 = 3.9e-3 of a value. Two correct kernels
# sum in different orders and round differently, so they differ by a few units at the largest entries of the
# output and of the gradients (which add up B x T terms); 2e-2 (about five units) admits that, while a wrong
# kernel (a mask off by one, a GQA head mapped to the wrong key head) is off by O(1).
AGREE_TOLERANCE = 2e-2
# cuDNN is forced only when it is at least 3% faster: below that the two are within run-to-run noise of a
# 5-call median, and flash is what SDPA picks unforced (fewer surprises in a profile or a bug report).
CUDNN_MARGIN = 1.03
CUDNN_FIRST = "cudnn-first"  # plan.attention when the probe picks cuDNN: SDPA tries cuDNN, then flash, ...
PROBE_BATCH = 4  # sequences when train.micro_batch is unset (the plan chooses it after attention)
PROBE_TOKENS = 16384  # at most this many tokens per call: the probe's cost grows with T^2, keep it ~1 s
WARMUP = 2  # calls before timing: cuDNN builds its execution plan on the first call
REPEATS = 5  # timed calls; the median is taken


@dataclass(frozen=True)
class AttentionShape:
    """One attention layer's call: q is (batch, heads, seq_len, head_dim), k and v have kv_heads."""

    batch: int
    heads: int
    kv_heads: int
    seq_len: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def gqa(self) -> bool:
        return self.kv_heads != self.heads

    def describe(self) -> str:
        kv = f", {self.kv_heads} kv heads" if self.gqa else ""
        return f"{self.batch}x{self.heads}x{self.seq_len}x{self.head_dim}{kv}"


@dataclass(frozen=True)
class AttentionTiming:
    """What the probe measured: median forward + backward per kernel, how far cuDNN's results are from flash's
    (largest |difference| relative to each tensor's largest |value|), or why cuDNN could not be measured."""

    flash_ms: float = 0.0
    cudnn_ms: float = 0.0
    difference: float = 0.0
    error: str | None = None

    def worst_over_ranks(self, all_reduce_max: Callable[[torch.Tensor], torch.Tensor]) -> AttentionTiming:
        """The same timing on every rank, so every rank forces the same kernel: any rank's failure, the largest
        difference, the slowest cuDNN and the fastest flash (the case least kind to cuDNN)."""
        failed = self.error is not None
        mine = torch.tensor(
            [float(failed), self.difference, self.cudnn_ms, -self.flash_ms], dtype=torch.float64
        )
        worst_failed, difference, cudnn_ms, minus_flash = all_reduce_max(mine).tolist()
        if worst_failed:
            return AttentionTiming(error=self.error or "it failed on another rank")
        return AttentionTiming(flash_ms=-minus_flash, cudnn_ms=cudnn_ms, difference=difference)


# probe(shape, device) -> timing; plan_run passes `measure_attention` on a real GPU, tests pass a stand-in
AttentionProbe = Callable[[AttentionShape, torch.device], AttentionTiming]


def probe_shape(
    *, heads: int, kv_heads: int, head_dim: int, seq_len: int, micro_batch: int | None, dtype: torch.dtype
) -> AttentionShape:
    """The shape to probe: the run's micro-batch if the config sets one, else PROBE_BATCH (the plan picks the
    micro-batch after the kernel; which of two kernels is faster rarely turns on the batch), with at most
    PROBE_TOKENS tokens so that a long context keeps the probe short."""
    batch = max(1, min(micro_batch or PROBE_BATCH, PROBE_TOKENS // seq_len))
    return AttentionShape(batch, heads, kv_heads, seq_len, head_dim, dtype)


def decide_attention(timing: AttentionTiming, shape: AttentionShape) -> tuple[str, str]:
    """(plan.attention, reason): "cudnn" when it agrees with flash and is CUDNN_MARGIN faster, else "auto"
    (SDPA's own dispatch, which is flash here)."""
    where = shape.describe()
    if timing.error is not None:
        return "auto", f"SDPA flash (cudnn probe failed on {where}: {timing.error})"
    if timing.difference > AGREE_TOLERANCE:
        return "auto", (
            f"SDPA flash (cudnn disagrees with flash on {where}: differs by {timing.difference:.1e} of a "
            f"tensor's largest value, tolerance {AGREE_TOLERANCE:g})"
        )
    speedup = timing.flash_ms / timing.cudnn_ms
    detail = (
        f"fwd+bwd {timing.cudnn_ms:.2f} vs {timing.flash_ms:.2f} ms, {where}, "
        f"agrees within {timing.difference:.0e}"
    )
    if speedup >= CUDNN_MARGIN:
        return CUDNN_FIRST, (
            f"SDPA cudnn first, flash behind it: {speedup:.2f}x flash on this layer's shape ({detail})"
        )
    return "auto", (
        f"SDPA flash (cudnn {speedup:.2f}x flash on this layer's shape, under the {CUDNN_MARGIN:g}x margin; "
        f"{detail})"
    )


def sdpa_results(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad: torch.Tensor,
    backend: SDPBackend | None,
) -> tuple[torch.Tensor, ...]:
    """(output, dq, dk, dv) of one causal SDPA forward + backward under `backend` alone (None: SDPA's own
    choice). torch.autograd.grad returns fresh gradients, so a timed call adds no accumulation kernel."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([backend]) if backend is not None else nullcontext():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return (out.detach(), *torch.autograd.grad(out, (q, k, v), grad))


def agreement(expected: Sequence[torch.Tensor], got: Sequence[torch.Tensor]) -> float:
    """The largest |got - expected| over the tensors, each relative to its own largest |value| (so a small
    gradient is judged on its own scale, not the output's)."""
    worst = 0.0
    for e, g in zip(expected, got, strict=True):
        scale = e.float().abs().max().clamp_min(torch.finfo(torch.float32).tiny)
        difference = ((g.float() - e.float()).abs().max() / scale).item()
        if not math.isfinite(difference):  # a NaN or inf output or gradient: no agreement (max() skips NaN)
            return math.inf
        worst = max(worst, difference)
    return worst


def random_inputs(shape: AttentionShape, device: torch.device) -> tuple[torch.Tensor, ...]:
    """q, k, v and the upstream gradient, seeded: every rank and every run probes the same numbers. Laid out
    as training hands them to SDPA: (B, H, T, hd) views of (B, T, H, hd) tensors (Attention.forward transposes
    the projections' output), so the kernels are judged on the strides they will get."""
    gen = torch.Generator(device=device).manual_seed(0)
    return tuple(
        torch.randn(shape.batch, shape.seq_len, h, shape.head_dim, generator=gen, device=device)
        .to(shape.dtype)
        .transpose(1, 2)
        for h in (shape.heads, shape.kv_heads, shape.kv_heads, shape.heads)
    )  # q (B, nh, T, hd), k and v (B, nkv, T, hd), grad like q


def median_ms(
    call: Callable[[], object], device: torch.device, *, warmup: int = WARMUP, repeats: int = REPEATS
) -> float:
    """Median milliseconds of `call` after `warmup` untimed calls: CUDA events on a GPU (no host sync inside
    the timed span), the wall clock on a CPU."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            call()
            times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def compare_backends(
    shape: AttentionShape,
    device: torch.device,
    *,
    baseline: SDPBackend | None,
    candidate: SDPBackend | None,
    warmup: int = WARMUP,
    repeats: int = REPEATS,
) -> AttentionTiming:
    """Time `candidate` against `baseline` on `shape` and check that its results agree: flash_ms is the
    baseline's, cudnn_ms the candidate's (on a CPU the test compares the math kernel with SDPA's own). Never
    raises: a failure is the timing's `error`, one line with the warning SDPA gave for refusing the kernel."""
    failing = baseline
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # any exception (an out-of-memory error making the inputs included): a probe must never stop a plan,
        # and under torchrun every rank must reach the collective that agrees on the result
        # (parallel/runtime.py agreed_attention_probe)
        try:
            q, k, v, grad = random_inputs(shape, device)
            run = lambda backend: sdpa_results(q, k, v, grad, backend)  # noqa: E731
            expected = run(baseline)
            failing = candidate
            difference = agreement(expected, run(candidate))
            del expected
            failing = baseline
            base_ms = median_ms(lambda: run(baseline), device, warmup=warmup, repeats=repeats)
            failing = candidate
            cand_ms = median_ms(lambda: run(candidate), device, warmup=warmup, repeats=repeats)
        except Exception as e:
            name = failing.name.lower().removesuffix("_attention") if failing is not None else "default"
            return AttentionTiming(error=f"{name}: {first_line(e)}{_refusal(caught)}")
    return AttentionTiming(flash_ms=base_ms, cudnn_ms=cand_ms, difference=difference)


def _refusal(caught: list[warnings.WarningMessage]) -> str:
    """SDPA's own reason for refusing a kernel: it warns "<kernel> not used because:" and then the reason."""
    reasons = [str(w.message).strip() for w in caught if not str(w.message).strip().endswith("because:")]
    return f" ({reasons[-1].splitlines()[0]})" if reasons else ""


def measure_attention(shape: AttentionShape, device: torch.device) -> AttentionTiming:
    """The probe plan_run hands to the plan on a real GPU: cuDNN against FlashAttention-2 on this shape."""
    timing = compare_backends(
        shape, device, baseline=SDPBackend.FLASH_ATTENTION, candidate=SDPBackend.CUDNN_ATTENTION
    )
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the probe's tensors are gone; give their blocks back before the finder
    return timing
