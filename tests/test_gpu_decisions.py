"""GPU decisions checked on a CPU: CUDA graphs only where they are safe (one GPU, no accumulation, never
doubled by an out-of-memory back-off), the micro-batch finder measuring in one process (no DDP inside its
trials, so ranks cannot fall out of step), the compile mode, the micro-batch split and float8's automatic
choice.
Hardware is simulated (hopperlm.hardware.simulated); what only a real GPU can show is in the GPU stage."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from hopperlm.config import config_from_dict
from hopperlm.data.loader import Batch
from hopperlm.errors import ConfigError
from hopperlm.hardware import detect_for, simulated
from hopperlm.model.transformer import build_model
from hopperlm.parallel import runtime
from hopperlm.parallel.parallelize import Parallel
from hopperlm.parallel.runtime import Runtime
from hopperlm.plan import World, make_plan
from hopperlm.plan.make import fewest_accumulation_steps
from hopperlm.train import batch_finder
from hopperlm.train.optim import build_optimizer
from hopperlm.train.out_of_memory import OutOfMemory, back_off
from hopperlm.train.state import TrainState
from hopperlm.train.step import make_step_parts, train_step

SEQ = 64


def _cfg(preset="debug", **train):
    raw = {"model": {"preset": preset}, "train": {"max_steps": 1000, "seq_len": SEQ, **train}}
    cfg = config_from_dict(raw)
    model_cfg = cfg.model if cfg.model.vocab_size else dataclasses.replace(cfg.model, vocab_size=320)
    return cfg, model_cfg


def _plan(gpu, *, fit=None, preset="debug", **train):
    """The plan on simulated hardware; `fit`: what a GPU finder would have measured."""
    cfg, model_cfg = _cfg(preset, **train)
    finder = None if fit is None else (lambda m, plan, cap: (min(fit, cap), "measured (test)"))
    return make_plan(cfg, model_cfg, simulated(gpu), finder)


# ---- b: CUDA graphs -----------------------------------------------------------------------------------
def test_cuda_graphs_only_without_accumulation():
    """A launch-bound micro-batch gets CUDA graphs on one GPU; the same one with accumulation does not."""
    accumulating = _plan("H100 80GB", fit=8, batch_tokens=64 * SEQ)
    assert accumulating.grad_accum == 8 and accumulating.compile_mode == "default"
    assert "no CUDA graphs" in accumulating.reasons["compile"]
    assert "pytorch/pytorch#169545" in accumulating.reasons["compile"]
    alone = _plan("H100 80GB", fit=64, batch_tokens=64 * SEQ)
    assert (alone.grad_accum, alone.compile_mode) == (1, "reduce-overhead")
    assert "out-of-memory error stops the run" in alone.reasons["compile"]


def test_explicit_reduce_overhead_with_accumulation_falls_back_to_default():
    plan = _plan("H100 80GB", fit=8, batch_tokens=64 * SEQ, compile_mode="reduce-overhead")
    assert plan.grad_accum == 8 and plan.compile_mode == "default"
    reason = plan.reasons["compile"]
    assert "mode default" in reason and "reduce-overhead asked for it" in reason and "#169545" in reason
    kept = _plan("H100 80GB", fit=64, batch_tokens=64 * SEQ, compile_mode="reduce-overhead")
    assert kept.compile_mode == "reduce-overhead" and "set by train.compile_mode" in kept.reasons["compile"]


@pytest.mark.parametrize("mode", ["auto", "reduce-overhead"])
def test_no_cuda_graphs_on_a_cpu(mode):
    cfg, model_cfg = _cfg(compile=True, compile_mode=mode)
    for hw in (simulated("CPU"), detect_for("cpu")):
        plan = make_plan(cfg, model_cfg, hw)
        assert plan.compile and plan.compile_mode == "default", plan.reasons["compile"]
        assert "reduce-overhead (CUDA graphs" not in plan.reasons["compile"]


def _graphs_parts(grad_accum=1):
    """Real step parts of a plan that runs CUDA graphs (on a CPU: the model itself is not compiled here)."""
    cfg, model_cfg = _cfg()
    plan = make_plan(cfg, model_cfg, detect_for("cpu")).replace(compile=True, compile_mode="reduce-overhead")
    model = build_model(model_cfg, seed=0)
    optimizer = build_optimizer(model, cfg.optim, fused=False, name="adamw")
    parts = make_step_parts(model, Parallel("none", model), optimizer, plan=plan, grad_clip=1.0)
    assert parts.mark_step is not None
    return plan, parts


def test_back_off_under_cuda_graphs_stops_instead_of_doubling_accumulation():
    plan, parts = _graphs_parts()
    moved, lines = [], []
    run = SimpleNamespace(
        state=TrainState(micro_batch=8, grad_accum=1, fp8="off"),
        rt=Runtime(),
        plan=plan,
        parts=parts,
        batches=SimpleNamespace(set_micro_batch=lambda *a: moved.append(a)),
        log=lines.append,
    )
    with pytest.raises(OutOfMemory, match="under CUDA graphs") as err:
        back_off(run)
    assert "--train.compile_mode default" in str(err.value) and "--train.micro_batch 4" in str(err.value)
    assert (run.state.micro_batch, run.state.grad_accum) == (8, 1) and not moved


def test_train_step_refuses_accumulation_under_cuda_graphs():
    _, parts = _graphs_parts()
    x = torch.randint(0, 320, (2, SEQ))
    with pytest.raises(ConfigError, match="169545"):
        train_step(parts, lambda micro: Batch(x, x), grad_accum=2, lr=1e-3)


# ---- c: the micro-batch finder under torchrun ------------------------------------------------------------
@pytest.fixture
def fake_cuda(monkeypatch):
    """What the finder asks torch.cuda, answered on a CPU (every trial fits the budget)."""
    for name in ("reset_peak_memory_stats", "synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "simulated GPU")
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda *a, **k: None)


def _ddp_plan():
    """A CPU plan dressed as rank 0 of a two-rank DDP run (what the finder gets under torchrun)."""
    cfg, model_cfg = _cfg()
    plan = make_plan(cfg, model_cfg, detect_for("cpu"))
    return model_cfg, plan.replace(strategy="ddp", world_size=2, compile=True, compile_mode="default")


def test_finder_trials_run_in_one_process_without_ddp(fake_cuda, monkeypatch, tmp_path):
    monkeypatch.setattr(runtime, "_current", Runtime(rank=0, world=World(2, 2)))  # as under torchrun
    seen = []
    real_build_step = batch_finder.build_step

    def recording_build_step(model, plan, optim, *, log, rt=None):
        seen.append((plan, rt or runtime.current()))
        return real_build_step(model, plan, optim, log=log, rt=rt)

    monkeypatch.setattr(batch_finder, "build_step", recording_build_step)
    model_cfg, plan = _ddp_plan()
    finder = batch_finder.make_gpu_finder(tmp_path, 1e9, lambda line: None)
    micro, reason = finder(model_cfg, plan, 4)
    [(trial, rt)] = seen
    assert (trial.strategy, trial.world_size, trial.compile) == ("none", 1, False)
    assert rt.world_size == 1 and not rt.active  # no collective can run inside a trial
    assert micro == 4 and "measured" in reason


def test_a_failure_after_an_out_of_memory_error_is_a_failed_trial(fake_cuda, monkeypatch, tmp_path):
    """After an OOM inside a backward the next trial may fail with another RuntimeError (under DDP:
    'Expected to have finished reduction'); it counts as not fitting instead of ending the search."""
    tried = []

    def flaky_step(parts, next_batch, *, grad_accum, lr):
        n = next_batch(0).x.shape[0]
        tried.append(n)
        if n >= 8:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        if n == 6:
            raise RuntimeError("Expected to have finished reduction in the prior iteration (simulated)")

    monkeypatch.setattr(batch_finder, "train_step", flaky_step)
    model_cfg, plan = _ddp_plan()
    lines = []
    finder = batch_finder.make_gpu_finder(tmp_path, 1e9, lines.append)
    micro, _ = finder(model_cfg, plan.replace(strategy="none", world_size=1), 64)
    assert micro == 5 and 6 in tried and "6x (Expected to have finished reduction" in lines[-1]

    def broken_step(parts, next_batch, *, grad_accum, lr):  # no OOM first: a real error is not hidden
        raise RuntimeError("a bug")

    monkeypatch.setattr(batch_finder, "train_step", broken_step)
    with pytest.raises(RuntimeError, match="a bug"):
        batch_finder.make_gpu_finder(tmp_path / "again", 1e9, lines.append)(model_cfg, plan, 64)


def test_the_finder_leaves_the_peak_memory_reading_to_the_run(fake_cuda, monkeypatch, tmp_path):
    """The run's `mem` reads the allocator's peak: a finder that tried 89 sequences must not leave its peak
    behind for a run of 64 (an H100 read 75.9 GB measured against 55.9 estimated, 2026-11-26)."""
    events = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: events.append("reset"))
    monkeypatch.setattr(batch_finder, "train_step", lambda *a, **k: events.append("step"))
    model_cfg, plan = _ddp_plan()
    finder = batch_finder.make_gpu_finder(tmp_path, 1e9, lambda line: None)
    finder(model_cfg, plan.replace(strategy="none", world_size=1), 8)
    assert "step" in events and events[-1] == "reset", events


# ---- f: compile mode --------------------------------------------------------------------------------------
def test_no_run_autotunes_unless_asked():
    long = _plan("H200", preset="h100-350m", max_hours=1.5, seq_len=1024, batch_tokens=1024 * 512)
    assert long.compile_mode == "default"
    assert "measured slower to compile and not faster" in long.reasons["compile"]
    assert "bench/results/2026-11-22-h200" in long.reasons["compile"]
    asked = _plan("H200", preset="h100-350m", max_hours=1.5, seq_len=1024, compile_mode="max-autotune")
    assert asked.compile_mode == "max-autotune" and "set by train.compile_mode" in asked.reasons["compile"]


# ---- g: the micro-batch split and float8's automatic choice ---------------------------------------------
def test_micro_batch_uses_the_fewest_equal_accumulation_steps():
    plan = _plan("H100 80GB", fit=78, batch_tokens=256 * SEQ)
    assert (plan.micro_batch, plan.grad_accum) == (64, 4)
    assert "78 fit, 64 = 256 / 4" in plan.reasons["micro_batch"]  # the plan says what it rounded, and why
    assert _plan("H100 80GB", fit=100, batch_tokens=96 * SEQ).micro_batch == 96  # fits whole: no accumulation
    assert fewest_accumulation_steps(100, 30) == 25  # ceil(100 / 30) = 4 steps, and 4 divides 100
    for seqs in range(1, 130):  # the same as the largest divisor that fits: optimal among equal splits
        for fit in range(1, seqs + 1):
            micro = fewest_accumulation_steps(seqs, fit)
            assert seqs % micro == 0 and micro == max(d for d in range(1, fit + 1) if seqs % d == 0)


def test_float8_auto_without_torchao_stays_bf16(monkeypatch):
    from hopperlm.plan import choices

    monkeypatch.setattr(choices, "torchao_available", lambda: False)
    plan = _plan("H100 80GB", preset="tinyllama-1.1b", seq_len=1024)
    assert plan.fp8 == "off"
    assert "bf16: torchao not installed" in plan.reasons["fp8"]
    assert "train.fp8 native to try it" in plan.reasons["fp8"]
    native = _plan("H100 80GB", preset="tinyllama-1.1b", seq_len=1024, fp8="native")
    assert native.fp8 == "native" and "set by train.fp8" in native.reasons["fp8"]
