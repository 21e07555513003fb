"""The attention kernel: cuDNN only where a probe on the real GPU times it faster than flash and agreeing with
it, flash otherwise, with the reason. The decision is checked on a CPU with made-up timings on a simulated
H100; the agreement check runs for real on two CPU kernels; the probe itself runs in the GPU stage."""

import dataclasses
import time

import pytest
import torch
from torch.nn.attention import SDPBackend

from hopperlm.config import config_from_dict
from hopperlm.hardware import detect, simulated
from hopperlm.plan import make_plan
from hopperlm.plan.attention_probe import (
    AGREE_TOLERANCE,
    CUDNN_FIRST,
    CUDNN_MARGIN,
    NO_PROBE_ENV,
    PROBE_TOKENS,
    AttentionShape,
    AttentionTiming,
    agreement,
    compare_backends,
    measure_attention,
    probe_shape,
)


def _cfg(preset="h100-350m", model=None, **train):
    raw = {
        "model": {"preset": preset, **(model or {})},
        "train": {"max_steps": 1000, "seq_len": 1024, **train},
    }
    cfg = config_from_dict(raw)
    model_cfg = cfg.model if cfg.model.vocab_size else dataclasses.replace(cfg.model, vocab_size=320)
    return cfg, model_cfg


class Probe:
    """A stand-in for measure_attention: returns `timing` (or raises `error`) and records what it was asked."""

    def __init__(self, timing=None, error=None):
        self.timing, self.error, self.shapes = timing, error, []

    def __call__(self, shape, device):
        self.shapes.append(shape)
        if self.error is not None:
            raise self.error
        return self.timing


def _plan(probe, gpu="H100 80GB", preset="h100-350m", model=None, **train):
    cfg, model_cfg = _cfg(preset, model, **train)
    return make_plan(cfg, model_cfg, simulated(gpu), attention_probe=probe)


@pytest.fixture(autouse=True)
def _probe_allowed(monkeypatch):
    monkeypatch.delenv(NO_PROBE_ENV, raising=False)


def test_faster_and_agreeing_cudnn_is_forced_with_the_ratio():
    probe = Probe(AttentionTiming(flash_ms=1.10, cudnn_ms=0.84, difference=2e-3))
    plan = _plan(probe)
    assert plan.attention == CUDNN_FIRST  # cuDNN first, flash behind it for a shape cuDNN refuses
    why = plan.reasons["attention"]
    assert why.startswith("SDPA cudnn first, flash behind it: 1.31x flash")
    assert "0.84 vs 1.10 ms" in why and "2e-03" in why
    # the layer's own shape: h100-350m has 16 heads of 64, no GQA; the micro-batch is unset, so PROBE_BATCH
    assert probe.shapes == [AttentionShape(4, 16, 16, 1024, 64, torch.bfloat16)]
    with plan.sdpa_backends():  # the forced kernel is what training holds around forward and backward
        pass


def test_slower_or_marginal_cudnn_keeps_flash():
    for cudnn_ms, ratio in ((1.13, "0.97x"), (1.10 / (CUDNN_MARGIN - 0.01), "1.02x")):
        plan = _plan(Probe(AttentionTiming(flash_ms=1.10, cudnn_ms=cudnn_ms, difference=1e-3)))
        assert plan.attention == "auto"
        assert plan.reasons["attention"].startswith(f"SDPA flash (cudnn {ratio} flash on this layer's shape")
        assert f"under the {CUDNN_MARGIN:g}x margin" in plan.reasons["attention"]


def test_disagreeing_cudnn_keeps_flash_however_fast():
    plan = _plan(Probe(AttentionTiming(flash_ms=1.0, cudnn_ms=0.5, difference=0.3)))
    assert plan.attention == "auto"
    assert "cudnn disagrees with flash" in plan.reasons["attention"]
    assert f"tolerance {AGREE_TOLERANCE:g}" in plan.reasons["attention"]


def test_failed_probe_keeps_flash_with_one_line():
    error = RuntimeError("No available kernel. Aborting execution.\n(a long CUDA trace)")
    plan = _plan(Probe(error=error))
    assert plan.attention == "auto"
    why = plan.reasons["attention"]
    assert why.startswith("SDPA flash (cudnn probe failed on 4x16x1024x64: RuntimeError: No available kernel")
    assert "\n" not in why
    failed = _plan(Probe(AttentionTiming(error="cudnn: RuntimeError: no kernel (GQA unsupported)")))
    assert failed.attention == "auto" and "GQA unsupported" in failed.reasons["attention"]


@pytest.mark.parametrize(
    ("gpu", "train", "model"),
    [
        ("H100 80GB", {"attention": "flash"}, None),  # forced: measured by nobody
        ("H100 80GB", {"attention": "cudnn"}, None),
        ("H100 80GB", {"precision": "fp32"}, None),  # flash and cuDNN need 16-bit inputs
        ("H100 80GB", {}, {"dropout": 0.1}),  # the probe compares without dropout
        ("A100 40GB", {}, None),  # no cuDNN attention before sm_90
        ("CPU", {}, None),
    ],
)
def test_no_probe_where_nothing_is_to_choose(gpu, train, model):
    probe = Probe(error=AssertionError("probed"))
    plan = _plan(probe, gpu, model=model, **train)
    assert probe.shapes == []
    assert plan.attention in ("auto", train.get("attention", "auto"))


def test_env_var_skips_the_probe(monkeypatch):
    monkeypatch.setenv(NO_PROBE_ENV, "1")
    probe = Probe(error=AssertionError("probed"))
    plan = _plan(probe)
    assert probe.shapes == [] and plan.attention == "auto"
    assert plan.reasons["attention"].endswith(f"cudnn not probed ({NO_PROBE_ENV} is set)")


def test_probe_shape_follows_the_config():
    probe = Probe(AttentionTiming(flash_ms=1.0, cudnn_ms=1.0))
    _plan(probe, preset="debug", micro_batch=3, seq_len=128, precision="fp16")
    assert probe.shapes[-1] == AttentionShape(3, 4, 2, 128, 16, torch.float16)  # GQA: 4 query, 2 kv heads
    long = dict(heads=16, kv_heads=16, head_dim=64, seq_len=4 * PROBE_TOKENS, dtype=torch.bfloat16)
    assert probe_shape(**long, micro_batch=8).batch == 1  # a long context probes one sequence


def _contribution(timing):
    """The tensor one rank hands to the all-reduce."""
    seen = []
    timing.worst_over_ranks(lambda x: seen.append(x) or x)
    return seen[0]


def test_every_rank_takes_the_case_least_kind_to_cudnn():
    ranks = [
        AttentionTiming(flash_ms=1.0, cudnn_ms=0.7, difference=1e-3),
        AttentionTiming(flash_ms=0.9, cudnn_ms=0.8, difference=4e-3),
    ]
    reduced = torch.stack([_contribution(t) for t in ranks]).amax(0)
    agreed = [t.worst_over_ranks(lambda _: reduced.clone()) for t in ranks]
    assert agreed[0] == agreed[1] == AttentionTiming(flash_ms=0.9, cudnn_ms=0.8, difference=4e-3)
    ranks[1] = AttentionTiming(error="cudnn: RuntimeError: no kernel")
    reduced = torch.stack([_contribution(t) for t in ranks]).amax(0)
    agreed = [t.worst_over_ranks(lambda _: reduced.clone()) for t in ranks]
    assert [t.error for t in agreed] == ["it failed on another rank", "cudnn: RuntimeError: no kernel"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_agreement_check_on_two_cpu_kernels(dtype):
    """The numerics check the GPU probe runs on flash and cuDNN, run here on SDPA's math kernel and its CPU
    default (a fused flash kernel), on a GQA shape: output and all three input gradients agree."""
    shape = AttentionShape(batch=2, heads=4, kv_heads=2, seq_len=64, head_dim=16, dtype=dtype)
    cpu = torch.device("cpu")
    timing = compare_backends(shape, cpu, baseline=SDPBackend.MATH, candidate=None, warmup=1, repeats=1)
    assert timing.error is None and timing.flash_ms > 0 and timing.cudnn_ms > 0
    assert timing.difference < (1e-5 if dtype == torch.float32 else AGREE_TOLERANCE)


def test_agreement_is_relative_to_each_tensors_scale():
    out, grad = torch.ones(8), torch.full((8,), 1e-4)
    assert agreement([out, grad], [out, grad]) == 0.0
    assert agreement([out, grad], [out, grad.clone().fill_(float("nan"))]) == float("inf")  # NaN never agrees
    assert agreement([out, grad], [out + 1e-3, grad]) == pytest.approx(1e-3, rel=1e-3)
    assert agreement([out, grad], [out, grad * 2]) == pytest.approx(1.0)  # a wrong small gradient still shows


def test_a_kernel_that_cannot_run_is_an_error_not_an_exception():
    shape = AttentionShape(batch=1, heads=2, kv_heads=2, seq_len=32, head_dim=16, dtype=torch.float32)
    timing = compare_backends(
        shape, torch.device("cpu"), baseline=SDPBackend.MATH, candidate=SDPBackend.CUDNN_ATTENTION
    )
    assert timing.error is not None and timing.error.startswith("cudnn: RuntimeError")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU to time the SDPA kernels")
def test_real_probe_on_cuda():
    """The probe on this GPU: a timing or a one-line failure, a choice of flash or cuDNN with its reason, in
    about a second (docs/speed-and-plan.md promises under ~2 s; 10 s leaves room for a busy CI GPU)."""
    hw = detect()
    shape = AttentionShape(batch=4, heads=16, kv_heads=4, seq_len=1024, head_dim=64, dtype=torch.bfloat16)
    start = time.perf_counter()
    timing = measure_attention(shape, hw.device)
    assert time.perf_counter() - start < 10
    assert timing.error is not None or (timing.flash_ms > 0 and timing.cudnn_ms > 0)
    cfg, model_cfg = _cfg(model={"n_kv_heads": 4})
    plan = make_plan(cfg, model_cfg, hw, attention_probe=measure_attention)
    assert plan.attention in ("auto", CUDNN_FIRST)
    why = plan.reasons["attention"]
    assert why.startswith("SDPA ") and "\n" not in why
    if hw.capability >= (9, 0) and "cudnn" in hw.attention:
        assert "flash on this layer's shape" in why or "cudnn probe failed" in why or "disagrees" in why
    print(why)


def test_one_process_measures_alone():
    from hopperlm.parallel.runtime import Runtime

    probe = Probe(AttentionTiming(flash_ms=1.0, cudnn_ms=0.5))
    assert Runtime().agreed_attention_probe(probe) is probe  # no collective without other ranks
    assert Runtime().agreed_attention_probe(None) is None


def test_a_resumed_run_keeps_its_kernel_without_probing():
    """Two kernels round differently: a resume keeps the checkpoint's kernel (state.json's "attention")."""
    probe = Probe(AttentionTiming(flash_ms=1.0, cudnn_ms=2.0, difference=1e-3))  # would say flash now
    cfg, model_cfg = _cfg()
    kept = make_plan(
        cfg, model_cfg, simulated("H100 80GB"), attention_probe=probe, kept_attention=CUDNN_FIRST
    )
    assert kept.attention == CUDNN_FIRST and probe.shapes == []
    assert "kept from the checkpoint" in kept.reasons["attention"]
    flash = make_plan(cfg, model_cfg, simulated("H100 80GB"), attention_probe=probe, kept_attention="auto")
    assert (
        flash.attention == "auto"
        and probe.shapes == []
        and "kept from the checkpoint" in flash.reasons["attention"]
    )


def test_a_rank_whose_probe_raises_still_meets_the_others():
    """Under torchrun a probe that raises on one rank (an out-of-memory error making its inputs) must still
    reach the all-reduce the other ranks wait in, or they hang until NCCL's time-out."""
    from hopperlm.parallel.runtime import Runtime
    from hopperlm.plan import World

    rt = Runtime(world=World(size=2, local_size=2))  # the collective below stands in for the process group
    reduced = []
    rt.all_reduce = lambda t, op: reduced.append(t) or t
    agreed = rt.agreed_attention_probe(Probe(error=torch.OutOfMemoryError("CUDA out of memory")))
    shape = AttentionShape(4, 16, 16, 1024, 64, torch.bfloat16)
    timing = agreed(shape, torch.device("cpu"))
    assert len(reduced) == 1 and timing.error == "OutOfMemoryError: CUDA out of memory"


def test_cudnn_first_keeps_flash_behind_it():
    """The probe's pick holds cuDNN first but lets SDPA fall back (a shape cuDNN refuses, e.g. the finder's)."""
    probe = Probe(AttentionTiming(flash_ms=1.10, cudnn_ms=0.84, difference=2e-3))
    plan = _plan(probe)
    q = torch.randn(1, 2, 16, 8)
    with plan.sdpa_backends():  # on a CPU neither CUDA kernel runs: the order reaches math, which does
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert torch.isfinite(out).all()
