"""The float8 start-up probe: what it runs (one layer per shape, never the whole model), how little memory it
holds (no parameter ever gets a .grad), and the one line it prints when it fails."""

import dataclasses

import pytest
import torch

from hopperlm.config import config_from_dict
from hopperlm.config.presets import get_preset
from hopperlm.hardware import detect
from hopperlm.model.transformer import build_model
from hopperlm.plan import make_plan
from hopperlm.speed import apply_speedups
from hopperlm.speed.float8 import Float8NativeLinear, apply_fp8

DEBUG = dataclasses.replace(get_preset("debug"), vocab_size=256)


@pytest.fixture
def native_plan(monkeypatch):
    """A CPU plan with the native float8 backend forced (train.fp8 native, as a user may ask for it), and every block
    linear converted: the debug model's layers are too small for float8 to pay, so the threshold is lifted."""
    plan = make_plan(
        config_from_dict({"model": {"preset": "debug"}, "train": {"max_steps": 1, "seq_len": 64}}),
        DEBUG,
        detect(),
    )
    monkeypatch.setattr(
        "hopperlm.speed.apply_fp8", lambda model, backend, **kw: apply_fp8(model, backend, False, **kw)
    )
    return plan.replace(fp8="native")


def test_probe_runs_one_layer_per_shape_and_never_the_model(native_plan):
    model = build_model(DEBUG, seed=0)
    model_forwards = []
    real_forward = model.forward
    model.forward = lambda *a, **kw: model_forwards.append(1) or real_forward(*a, **kw)
    ran = {}  # module name -> input shape, for every float8 layer the probe ran

    def record(name, args):
        ran.setdefault(name, args[0].shape)  # returns None: a pre-hook that returned a value would replace x

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda m, args, name=name: record(name, args))
    had_grad = []  # every parameter that ever accumulated a .grad: the memory the old probe held
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: had_grad.append(name))
    lines = []
    assert apply_speedups(model, native_plan, lines.append) == "native"
    assert model_forwards == [] and had_grad == []
    converted = {n: m for n, m in model.named_modules() if isinstance(m, Float8NativeLinear)}
    assert len(converted) == 14 and set(ran) <= set(converted)
    shapes = {tuple(m.weight.shape) for m in converted.values()}
    assert sorted(tuple(converted[n].weight.shape) for n in ran) == sorted(shapes)  # each shape once
    assert all(shape[0] <= 64 for shape in ran.values())  # a few rows, not a batch of sequences
    assert len(lines) == 1 and lines[0].startswith("fp8: 14 linear layers in float8 (native)")


def test_probe_failure_prints_one_line_with_the_error(native_plan, monkeypatch):
    def broken(self, x):
        raise RuntimeError("no kernel image for _scaled_mm\n(a second line that stays out of the log)")

    monkeypatch.setattr(Float8NativeLinear, "forward", broken)
    model = build_model(DEBUG, seed=0)
    lines = []
    assert apply_speedups(model, native_plan, lines.append) == "off"
    assert lines == [
        "fp8: off (native failed at start-up: RuntimeError: no kernel image for _scaled_mm); "
        "training continues in bf16"
    ]
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_probe_out_of_memory_is_not_reported_as_float8_failing(native_plan, monkeypatch):
    """A probe that runs out of memory shows nothing about float8: it stays on (bf16 would need more memory,
    not less), and the line says that the check could not run and why."""

    def oom(self, x):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    monkeypatch.setattr(Float8NativeLinear, "forward", oom)
    model = build_model(DEBUG, seed=0)
    lines = []
    assert apply_speedups(model, native_plan, lines.append) == "native"
    assert len(lines) == 1 and "OutOfMemoryError: CUDA out of memory" in lines[0]
    assert "unverified" in lines[0] and "off" not in lines[0]
    assert sum(isinstance(m, Float8NativeLinear) for m in model.modules()) == 14
