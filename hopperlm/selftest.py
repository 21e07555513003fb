"""The short self-test of `hopperlm diagnose`: what this device achieves, not what its datasheet says.

Each check returns a plain dict (JSON-able) and never raises: a kernel that cannot run is reported with the
first line of its error. Inputs are random (zeros run faster on GPUs and would flatter the numbers).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hopperlm.errors import first_line


def _default_dtype(device: torch.device) -> torch.dtype:
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def _time_per_call(fn: Callable[[], object], device: torch.device, min_seconds: float = 0.3) -> float:
    """Seconds per call: two warm-up calls, then enough calls to fill min_seconds."""
    for _ in range(2):
        fn()
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    sync()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        if calls % 4 == 0 or device.type != "cuda":
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                return elapsed / calls


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def matmul_check(
    device: torch.device,
    dtype: torch.dtype | None = None,
    n: int | None = None,
    peak_flops: float | None = None,
) -> dict:
    """Achieved FLOP/s of an n x n x n matmul at the device's training dtype."""
    dtype = dtype or _default_dtype(device)
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = _time_per_call(lambda: a @ b, device)
    a = b = None  # free before the next check
    _free(device)
    tflops = 2 * n**3 / seconds / 1e12
    peak = peak_flops / 1e12 if peak_flops else None
    return {
        "name": "matmul",
        "ok": True,
        "dtype": str(dtype).removeprefix("torch."),
        "n": n,
        "tflops": tflops,
        "peak_tflops": peak,
        "fraction_of_peak": tflops / peak if peak else None,
        "seconds": seconds,
    }


def copy_check(device: torch.device, nbytes: int | None = None) -> dict:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 256 << 20)
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = _time_per_call(lambda: dst.copy_(src), device)
    src = dst = None
    _free(device)
    return {"name": "copy", "ok": True, "bytes": nbytes, "gbps": 2 * nbytes / seconds / 1e9}


def sdpa_checks(
    device: torch.device, dtype: torch.dtype | None = None, seq_len: int | None = None
) -> list[dict]:
    """One causal SDPA call per kernel, each forced alone, plus FlexAttention and FlashAttention-3 presence."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = dtype or _default_dtype(device)
    T = seq_len or (1024 if device.type == "cuda" else 256)
    q, k, v = (torch.randn(2, 8, T, 64, device=device, dtype=dtype) for _ in range(3))
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}
    if device.type == "cuda":
        backends = {
            "flash": SDPBackend.FLASH_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH,
        }
    results = []
    for name, backend in backends.items():

        def call(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        try:
            ms = 1000 * _time_per_call(call, device, min_seconds=0.05)
            results.append({"name": f"sdpa:{name}", "ok": True, "ms": ms, "error": None})
        except RuntimeError as e:
            results.append({"name": f"sdpa:{name}", "ok": False, "ms": None, "error": first_line(e)})
    results.append(_flex_check(q, k, v, device))
    q = k = v = None
    _free(device)
    fa3 = importlib.util.find_spec("flash_attn_interface") is not None
    results.append({"name": "flash_attn_3", "ok": fa3, "error": None if fa3 else "not installed"})
    return results


def _flex_check(q, k, v, device: torch.device) -> dict:
    if device.type != "cuda":
        return {"name": "flex_attention", "ok": False, "ms": None, "error": "needs a CUDA GPU (Triton)"}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        T = q.shape[2]
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, T, T, device=device)
        compiled = torch.compile(flex_attention)
        ms = 1000 * _time_per_call(lambda: compiled(q, k, v, block_mask=mask), device, min_seconds=0.05)
        return {"name": "flex_attention", "ok": True, "ms": ms, "error": None}
    except Exception as e:  # any failure of an optional kernel is a report, not a crash
        return {"name": "flex_attention", "ok": False, "ms": None, "error": first_line(e)}


def compile_check(device: torch.device) -> dict:
    """torch.compile of a tiny function, checked against eager; inductor needs a C++ compiler on CPU."""
    torch._dynamo.reset()
    x = torch.randn(64, 64, device=device)
    w = torch.randn(64, 64, device=device)

    def fn(x, w):
        return F.gelu(x @ w) + 1

    start = time.perf_counter()
    try:
        out = torch.compile(fn)(x, w)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        ok = torch.allclose(out, fn(x, w), rtol=1e-3, atol=1e-3)
        error = None if ok else "compiled result differs from eager"
        return {"name": "compile", "ok": ok, "seconds": seconds, "error": error}
    except Exception as e:  # a missing compiler or a broken Triton is a finding, not a crash
        return {
            "name": "compile",
            "ok": False,
            "seconds": time.perf_counter() - start,
            "error": first_line(e),
        }
    finally:
        torch._dynamo.reset()


def run_selftest(device: torch.device, peak_flops: float | None = None, quick: bool = False) -> list[dict]:
    """matmul, copy, each attention kernel, compile; quick=True uses tiny sizes (for tests)."""
    results = [
        matmul_check(device, n=256 if quick else None, peak_flops=peak_flops),
        copy_check(device, 8 << 20 if quick else None),
    ]
    results += sdpa_checks(device, seq_len=64 if quick else None)
    results.append(compile_check(device))
    return results


def format_selftest(results: list[dict]) -> list[str]:
    """One human line per check."""
    lines = []
    for r in results:
        name = r["name"]
        if not r.get("ok"):
            lines.append(f"{name:<16} unavailable ({r.get('error') or 'failed'})")
        elif name == "matmul":
            peak = (
                f"{r['fraction_of_peak']:.0%} of {r['peak_tflops']:.0f} peak"
                if r.get("fraction_of_peak")
                else "peak unknown"
            )
            lines.append(f"{name:<16} {r['dtype']} {r['n']}^3: {r['tflops']:.2f} TFLOP/s ({peak})")
        elif name == "copy":
            lines.append(f"{name:<16} {r['bytes'] / 1e9:.2f} GB: {r['gbps']:.0f} GB/s (read + write)")
        elif name == "compile":
            lines.append(f"{name:<16} ok in {r['seconds']:.1f} s")
        elif r.get("ms") is not None:
            lines.append(f"{name:<16} ok, {r['ms']:.2f} ms")
        else:
            lines.append(f"{name:<16} ok")
    return lines
