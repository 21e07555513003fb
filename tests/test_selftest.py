"""diagnose's self-test: every check reports, none raises, numbers are positive and honest about peaks."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hopperlm.selftest import copy_check, format_selftest, matmul_check, run_selftest, sdpa_checks


def test_matmul_and_copy_on_cpu():
    r = matmul_check(torch.device("cpu"), n=256)
    assert r["ok"] and r["tflops"] > 0 and r["fraction_of_peak"] is None and r["dtype"] == "float32"
    with_peak = matmul_check(torch.device("cpu"), n=256, peak_flops=10e12)
    assert 0 < with_peak["fraction_of_peak"] < 1 and with_peak["peak_tflops"] == 10
    c = copy_check(torch.device("cpu"), 8 << 20)
    assert c["ok"] and c["gbps"] > 0


def test_sdpa_checks_on_cpu_report_every_kernel():
    results = {r["name"]: r for r in sdpa_checks(torch.device("cpu"), seq_len=64)}
    assert results["sdpa:math"]["ok"] and results["sdpa:math"]["ms"] > 0
    assert not results["flex_attention"]["ok"] and "CUDA" in results["flex_attention"]["error"]
    assert "flash_attn_3" in results


def test_forced_math_kernel_matches_softmax_reference():
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    with sdpa_kernel([SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(8)
    scores = scores.masked_fill(~torch.ones(16, 16, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(out, scores.softmax(-1) @ v)


def test_format_never_raises_on_failures():
    lines = format_selftest(
        [
            {
                "name": "matmul",
                "ok": True,
                "dtype": "bfloat16",
                "n": 8,
                "tflops": 1.0,
                "peak_tflops": 2.0,
                "fraction_of_peak": 0.5,
                "seconds": 1.0,
            },
            {"name": "sdpa:cudnn", "ok": False, "ms": None, "error": "RuntimeError: No available kernel"},
            {"name": "compile", "ok": False, "seconds": 1.0, "error": "no C++ compiler"},
        ]
    )
    assert len(lines) == 3 and "50% of 2 peak" in lines[0]
    assert "unavailable (RuntimeError: No available kernel)" in lines[1] and "no C++ compiler" in lines[2]


@pytest.mark.slow
def test_full_quick_selftest_on_cpu_including_compile():
    results = run_selftest(torch.device("cpu"), quick=True)
    names = [r["name"] for r in results]
    assert names[:2] == ["matmul", "copy"] and names[-1] == "compile"
    assert results[-1]["ok"], results[-1]  # gcc is on the machine: inductor must work
    assert len(format_selftest(results)) == len(results)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_matmul_reaches_a_sane_fraction_of_peak():
    from hopperlm.hardware import detect

    hw = detect()
    results = run_selftest(hw.device, hw.peak_16bit)
    matmul = results[0]
    if hw.peak_16bit:
        assert 0.3 < matmul["fraction_of_peak"] < 1.05
    assert any(r["name"] == "sdpa:flash" and r["ok"] for r in results) or hw.capability < (8, 0)
