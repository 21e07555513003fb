"""The plan on simulated hardware: the right choice and a reason for each, and explicit settings win."""

import dataclasses

import pytest

from hopperlm.config import config_from_dict
from hopperlm.config.presets import get_preset
from hopperlm.errors import ConfigError
from hopperlm.hardware import detect, simulated
from hopperlm.plan import make_plan
from hopperlm.train.batch_finder import search_largest


def plan_for(gpu, preset="h100-350m", train=None, model=None):
    raw = {"model": {"preset": preset, **(model or {})}, "train": {"max_steps": 1000, **(train or {})}}
    cfg = config_from_dict(raw)
    model_cfg = cfg.model if cfg.model.vocab_size else dataclasses.replace(cfg.model, vocab_size=320)
    return make_plan(cfg, model_cfg, simulated(gpu))


def test_h100_350m():
    plan = plan_for("H100 80GB", train={"seq_len": 1024, "batch_tokens": 524288, "max_hours": 1.5})
    assert (plan.precision, plan.tf32, plan.compile, plan.activation_checkpointing) == (
        "bf16",
        True,
        True,
        "none",
    )
    assert plan.compile_mode == "default"  # autotuning was measured slower to compile and not faster
    assert "bench/results/2026-11-22-h200" in plan.reasons["compile"]
    assert plan.fused_adamw and plan.pin_memory and plan.expandable_segments
    assert "flash" in plan.reasons["attention"] and "sm_90" in plan.reasons["precision"]
    assert plan.fp8 == "off" and "d=1024" in plan.reasons["fp8"]  # too few large matmuls to gain
    # global batch of 512 sequences reached exactly; the micro-batch fills most of 80 GB by the estimate
    assert plan.micro_batch * plan.grad_accum == 512 and 512 % plan.micro_batch == 0
    assert 8 <= plan.micro_batch <= 64
    assert plan.memory.total(plan.micro_batch) <= 0.9 * simulated("H100 80GB").free_memory
    assert plan.memory.total(2 * plan.micro_batch) > 0.9 * simulated("H100 80GB").free_memory or (
        512 % (2 * plan.micro_batch) != 0 or plan.micro_batch * 2 > 512
    )
    assert all(plan.reasons.values())


def test_h200_fits_more_than_h100():
    h100 = plan_for("H100 80GB", train={"seq_len": 1024, "batch_tokens": 1048576})
    h200 = plan_for("H200", train={"seq_len": 1024, "batch_tokens": 1048576})
    assert h200.micro_batch > h100.micro_batch
    assert h200.compile_mode == "default"  # 1000 steps: a short run


def test_a100_40gb_tinyllama():
    plan = plan_for("A100 40GB", preset="tinyllama-1.1b", train={"seq_len": 2048, "batch_tokens": 2048 * 64})
    assert plan.precision == "bf16" and plan.fp8 == "off" and "no fp8 tensor cores" in plan.reasons["fp8"]
    assert plan.activation_checkpointing == "none" and 1 <= plan.micro_batch <= 8


def test_a100_long_context_turns_on_activation_checkpointing():
    plan = plan_for(
        "A100 40GB", preset="tinyllama-1.1b", model={"max_seq_len": 32768}, train={"seq_len": 32768}
    )
    assert plan.activation_checkpointing == "full" and plan.micro_batch == 1
    assert "does not fit" in plan.reasons["activation_checkpointing"]


def test_rtx_4050_small_gpu():
    plan = plan_for("RTX 4050 6GB", preset="gpt2-124m", train={"seq_len": 1024, "batch_tokens": 1024 * 32})
    assert plan.precision == "bf16" and plan.fp8 == "off" and "d=768" in plan.reasons["fp8"]
    assert 1 <= plan.micro_batch <= 4 and plan.micro_batch * plan.grad_accum == 32
    with pytest.raises(ConfigError, match="does not fit"):
        plan_for("RTX 4050 6GB", preset="tinyllama-1.1b", train={"seq_len": 2048})


def test_t4_has_no_bf16():
    plan = plan_for("T4", preset="gpt2-124m", train={"seq_len": 1024})
    assert plan.precision == "fp16" and plan.loss_scaling and "no bf16" in plan.reasons["precision"]
    assert not plan.tf32 and "lacks TF32" in plan.reasons["tf32"]
    assert "memory-efficient" in plan.reasons["attention"]  # no flash kernel before sm_80
    with pytest.raises(ConfigError, match="has no bf16"):
        plan_for("T4", preset="gpt2-124m", train={"seq_len": 1024, "precision": "bf16"})


def test_cpu_plan():
    plan = plan_for("CPU", preset="debug", train={"seq_len": 64})
    assert (plan.precision, plan.compile, plan.fused_adamw, plan.pin_memory) == ("fp32", False, False, False)
    assert plan.micro_batch == 16 and "at most 16" in plan.reasons["micro_batch"]
    assert "CPU" in plan.reasons["compile"] and "tf32" not in plan.reasons
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        plan_for("CPU", preset="debug", train={"seq_len": 64, "precision": "bf16"})


def test_explicit_settings_win():
    plan = plan_for(
        "H100 80GB",
        train={
            "seq_len": 1024,
            "precision": "fp32",
            "tf32": False,
            "attention": "efficient",
            "compile": False,
            "micro_batch": 4,
            "batch_tokens": 1024 * 16,
            "activation_checkpointing": "full",
        },
    )
    assert (plan.precision, plan.tf32, plan.attention, plan.compile) == ("fp32", False, "efficient", False)
    assert (plan.micro_batch, plan.grad_accum, plan.activation_checkpointing) == (4, 4, "full")
    for key in ("precision", "tf32", "attention", "compile", "micro_batch", "activation_checkpointing"):
        assert "set by train." in plan.reasons[key], key
    with pytest.raises(ConfigError, match="not available on"):
        plan_for("T4", preset="gpt2-124m", train={"seq_len": 1024, "attention": "flash"})


def test_real_machine_plan_runs():
    hw = detect()
    cfg = config_from_dict({"model": {"preset": "debug"}, "train": {"max_steps": 1, "seq_len": 64}})
    plan = make_plan(cfg, dataclasses.replace(get_preset("debug"), vocab_size=320), hw)
    assert plan.micro_batch >= 1 and plan.lines()


def test_search_largest_is_exact_and_logarithmic():
    calls = []

    def fits(n):
        calls.append(n)
        return n <= 37

    assert search_largest(fits, 512) == 37 and len(calls) <= 12
    assert search_largest(lambda n: n <= 37, 20) == 20
    assert search_largest(lambda n: n <= 64, 64) == 64
    assert search_largest(lambda n: False, 64) == 0
