"""The speed-ups keep the model's numbers: fused loss, activation checkpointing, float8, compile, optimizers,
the plan's choices for them, the fallbacks, and `hopperlm bench --quick`."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hopperlm.config import OptimConfig, config_from_dict
from hopperlm.config.presets import get_preset
from hopperlm.hardware import detect, simulated
from hopperlm.model.loss import linear_cross_entropy, standard_cross_entropy
from hopperlm.model.transformer import build_model
from hopperlm.plan import make_plan
from hopperlm.plan.float8_payoff import converted_share, torchao_available
from hopperlm.speed import apply_speedups
from hopperlm.speed.activation_checkpointing import MODES, apply_activation_checkpointing
from hopperlm.speed.compile import apply_compile
from hopperlm.speed.float8 import Float8NativeLinear, apply_fp8
from hopperlm.train.optim import build_optimizer

DEBUG = dataclasses.replace(get_preset("debug"), vocab_size=256)
REPO = Path(__file__).resolve().parents[1]
needs_torchao = pytest.mark.skipif(not torchao_available(), reason="torchao is not installed")


def real_batch(data, batch=8, seq=64, start=0):
    """Windows of Tiny Shakespeare (byte tokens) as (x, y)."""
    from hopperlm.data.loader import TokenShards

    shards = TokenShards(data, "train")
    rows = torch.stack([torch.from_numpy(shards.read(start + i * 997, seq + 1)) for i in range(batch)])
    return rows[:, :-1], rows[:, 1:]


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def loss_and_grads(model, x, y, autocast=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(x, y)
    loss.backward()
    return loss.item(), grads(model)


# ---- fused loss ------------------------------------------------------------------------------------------
def test_fused_loss_equals_standard_with_ignored_positions():
    torch.manual_seed(0)
    hidden = torch.randn(3, 37, 32, requires_grad=True)
    weight = torch.randn(300, 32, requires_grad=True)
    targets = torch.randint(0, 300, (3, 37))
    targets[0, :9] = -100  # e.g. a prompt masked out of the loss
    fused = linear_cross_entropy(hidden, weight, targets, chunk_tokens=16)  # 7 chunks, the last one short
    fused.backward()
    g_h, g_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    reference = standard_cross_entropy(hidden @ weight.t(), targets)
    reference.backward()
    torch.testing.assert_close(fused, reference)
    torch.testing.assert_close(g_h, hidden.grad)
    torch.testing.assert_close(g_w, weight.grad)
    with torch.no_grad():  # evaluation takes the same path without gradients
        torch.testing.assert_close(linear_cross_entropy(hidden, weight, targets, 16), reference)


def test_fused_loss_in_the_model_fp32_and_bf16(shakespeare_bytes):
    x, y = real_batch(shakespeare_bytes)
    for autocast, tol in ((False, 1e-5), (True, 2e-2)):
        plain = build_model(DEBUG, seed=0)
        fused = build_model(DEBUG, seed=0)
        fused.fused_loss = True
        a, ga = loss_and_grads(plain, x, y, autocast)
        b, gb = loss_and_grads(fused, x, y, autocast)
        assert b == pytest.approx(a, rel=tol)
        assert (ga - gb).norm() / ga.norm() < tol


# ---- activation checkpointing ----------------------------------------------------------------------------
def test_every_checkpointing_mode_gives_the_same_loss_and_gradients(shakespeare_bytes):
    x, y = real_batch(shakespeare_bytes)
    reference = loss_and_grads(build_model(DEBUG, seed=0), x, y)
    counts = {}
    for mode in MODES:
        model = (
            build_model(dataclasses.replace(DEBUG, n_layers=4), seed=0) if mode == "selective-block" else None
        )
        model = model or build_model(DEBUG, seed=0)
        counts[mode] = apply_activation_checkpointing(model, mode, every=2)
        if mode == "selective-block":
            continue  # a different depth; its counts are checked below
        loss, g = loss_and_grads(model, x, y)
        assert loss == reference[0]
        torch.testing.assert_close(g, reference[1], rtol=0, atol=0)
    assert counts == {"none": 0, "selective-op": 2, "selective-block": 2, "full": 2}


def test_selective_checkpointing_recomputes_elementwise_ops_but_no_matmul():
    """What the backward recomputes, counted op by op: selective-op repeats the cheap ops (SiLU) and none of
    the matmuls; full repeats both."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            self.ops[name] = self.ops.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    x = torch.randint(0, 256, (2, 64))
    backward_ops = {}
    for mode in ("none", "selective-op", "full"):
        model = build_model(DEBUG, seed=0)
        apply_activation_checkpointing(model, mode)
        loss = model(x, x)
        with Count() as counter:
            loss.backward()
        backward_ops[mode] = counter.ops
    matmuls = {mode: ops.get("mm", 0) for mode, ops in backward_ops.items()}
    silus = {mode: ops.get("silu", 0) for mode, ops in backward_ops.items()}
    assert matmuls["selective-op"] == matmuls["none"] < matmuls["full"]
    assert silus["none"] == 0 and silus["selective-op"] == silus["full"] == 2  # one per block, recomputed


# ---- float8 ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["native", pytest.param("tensorwise", marks=needs_torchao)])
def test_float8_stays_close_to_bf16_and_trains(shakespeare_bytes, backend):
    """On the CPU, torch._scaled_mm runs float8 matmuls too (slowly): the numbers are checked here, the speed
    on a GPU by `hopperlm bench`."""
    x, y = real_batch(shakespeare_bytes)
    bf16 = build_model(DEBUG, seed=0)
    fp8 = build_model(DEBUG, seed=0)
    n = apply_fp8(fp8, backend, only_if_pays=False)
    assert n == 14  # 7 linear layers in each of the 2 blocks; the LM head stays
    assert type(fp8.lm_head) is torch.nn.Linear
    a, ga = loss_and_grads(bf16, x, y, autocast=True)
    b, gb = loss_and_grads(fp8, x, y, autocast=True)
    assert b == pytest.approx(a, rel=0.02)
    assert (ga - gb).norm() / ga.norm() < 0.15  # e4m3/e5m2 rounding, not a different function
    losses = []
    opt = build_optimizer(fp8, OptimConfig(lr=3e-3, weight_decay=0.0), fused=False)
    for i in range(12):  # 4 x 32 tokens: the CPU's e4m3 x e4m3 _scaled_mm is a slow reference loop
        xb, yb = real_batch(shakespeare_bytes, batch=4, seq=32, start=i * 5000)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fp8(xb, yb)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0  # from ~5.5 (uniform over 256) well down


def test_native_float8_weights_and_state_dict_unchanged():
    model = build_model(DEBUG, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    apply_fp8(model, "native", only_if_pays=False)
    assert isinstance(model.layers[0].mlp.up_proj, Float8NativeLinear)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_float8_that_cannot_start_falls_back_to_bf16_with_one_line(monkeypatch):
    plan = make_plan(
        config_from_dict({"model": {"preset": "debug"}, "train": {"max_steps": 1, "seq_len": 64}}),
        DEBUG,
        detect(),
    )
    plan = plan.replace(fp8="tensorwise")  # as if the plan had chosen it on a GPU
    monkeypatch.setitem(sys.modules, "torchao", None)  # torchao missing: `import torchao` raises
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    model = build_model(DEBUG, seed=0)
    lines = []
    fp8 = apply_speedups(model, plan, lines.append)  # the fp8 in effect: the run's state, not the plan's
    assert fp8 == "off" and "off" in lines[0]
    assert [line for line in lines if line.startswith("fp8: off")] and len(lines) == 1
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_plan_chooses_float8_where_it_pays():
    def plan(gpu, preset, **train):
        cfg = config_from_dict(
            {"model": {"preset": preset}, "train": {"max_steps": 100, "seq_len": 1024, **train}}
        )
        return make_plan(cfg, cfg.model, simulated(gpu))

    assert converted_share(get_preset("tinyllama-1.1b")) > 0.9
    assert converted_share(get_preset("h100-350m")) < 0.5
    tiny = plan("H100 80GB", "tinyllama-1.1b")
    if torchao_available():
        assert tiny.fp8 == "tensorwise" and "convert" in tiny.reasons["fp8"]
    else:  # the native path is never chosen unasked until a GPU run has measured it
        assert tiny.fp8 == "off" and "train.fp8 native" in tiny.reasons["fp8"]
    assert plan("H200", "h100-350m").fp8 == "off"  # d=1024: too few large matmuls
    assert plan("A100 40GB", "tinyllama-1.1b").fp8 == "off"  # sm_80: no fp8 tensor cores
    assert plan("H100 80GB", "tinyllama-1.1b", compile=False).fp8 == "off"  # casts unfused: slower than bf16
    forced = plan("H100 80GB", "tinyllama-1.1b", compile=False, fp8="native")
    assert forced.fp8 == "native" and "warning" in forced.reasons["fp8"]  # explicit wins, with a warning
    assert plan("T4", "gpt2-124m", fp8="tensorwise").fp8 == "off"  # asked for, impossible: a reason, no crash
    # the chunked loss where one sequence's logits are a noticeable share of memory, not on an 80 GB GPU
    small = plan("RTX 4050 6GB", "gpt2-124m")
    assert small.fused_loss and "9.4% of the memory budget" in small.reasons["loss"]
    assert not plan("H100 80GB", "gpt2-124m").fused_loss
    assert plan("H100 80GB", "gpt2-124m", fused_loss=True).fused_loss  # explicit wins


# ---- compile ---------------------------------------------------------------------------------------------
def test_training_step_has_no_graph_breaks(shakespeare_bytes):
    x, y = real_batch(shakespeare_bytes, batch=2)
    for setup in ("plain", "fused loss", "selective-op"):
        torch._dynamo.reset()
        model = build_model(DEBUG, seed=0)
        model.fused_loss = setup == "fused loss"
        apply_activation_checkpointing(model, "selective-op" if setup == "selective-op" else "none")
        explanation = torch._dynamo.explain(model)(x, y)
        assert explanation.graph_break_count == 0, (setup, explanation.break_reasons)
    torch._dynamo.reset()


@pytest.mark.parametrize("scope", ["block", "model"])
def test_compiled_model_matches_eager(shakespeare_bytes, scope):
    x, y = real_batch(shakespeare_bytes, batch=4)
    reference = loss_and_grads(build_model(DEBUG, seed=0), x, y)
    torch._dynamo.reset()
    model = build_model(DEBUG, seed=0)
    model.fused_loss = True
    apply_compile(model, None, scope)
    loss, g = loss_and_grads(model, x, y)
    assert loss == pytest.approx(reference[0], rel=1e-5)
    assert (g - reference[1]).norm() / reference[1].norm() < 1e-4
    assert set(model.state_dict()) == set(build_model(DEBUG, seed=0).state_dict())  # checkpoints unchanged
    torch._dynamo.reset()


# ---- optimizers ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["muon", pytest.param("adamw8bit", marks=needs_torchao)])
def test_other_optimizers_train_and_resume_exactly(shakespeare_bytes, tmp_path, name):
    from hopperlm.config import load_config
    from hopperlm.observe.metrics import read_metrics
    from hopperlm.train.loop import train

    def cfg(run, steps):
        args = ["--data.path", str(shakespeare_bytes), "--run.out_dir", str(run), "--optim.name", name]
        args += ["--train.max_steps", str(steps), "--train.log_every", "1", "--checkpoint.every", "10"]
        model = {"dim": 128, "n_heads": 4, "ffn_dim": 256}
        if name == "adamw8bit":
            # every block matrix 64 x 64 (8-bit states need >= 4096 values): 8-bit AdamW compiles its update
            # once per distinct shape, and these are tests/test_train_step.py's (whose compiles are reused)
            model = {"dim": 64, "n_heads": 4, "n_kv_heads": 4, "ffn_dim": 64}
        args += [arg for key, value in model.items() for arg in (f"--model.{key}", str(value))]
        return load_config(REPO / "configs" / "debug.yaml", args)

    full = train(cfg(tmp_path / "full", 20), log=lambda line: None)
    losses = [r["loss"] for r in read_metrics(tmp_path / "full" / "metrics.jsonl")]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.8
    train(cfg(tmp_path / "cut", 10), log=lambda line: None)
    train(cfg(tmp_path / "cut", 20), resume=True, log=lambda line: None)
    resumed = [r["loss"] for r in read_metrics(tmp_path / "cut" / "metrics.jsonl")]
    assert resumed == losses and full.step == 20


# ---- bench -----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_bench_quick_prints_the_table_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", "--quick", "--presets", "gpt2-124m", "--steps", "1", "--windows", "2", "--warmup", "1"]
    env = {**os.environ, "HOPPERLM_CACHE_DIR": str(tmp_path / "cache")}
    result = subprocess.run(
        [sys.executable, "-m", "hopperlm", *args, "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    # other libraries' chatter (torchao's missing CUDA kernels, torch deprecation notices) is in a file
    assert "Failed to load" not in result.stdout + result.stderr and "_pytree" not in result.stderr
    logged = tmp_path / "cache" / "logs" / "third-party.log"
    if logged.is_file():
        assert f"written to {logged}" in result.stderr
    table = result.stdout[result.stdout.index("preset ") :].splitlines()
    configs = [line[16:42].strip() for line in table[1:] if line.startswith("gpt2-124m")]
    assert configs == ["eager", "hopperlm", "hopperlm muon", "hf"]  # Muon (the race's optimizer) beside AdamW
    assert table[-1].startswith("tokens/s: the median of 2 timed windows")
    record = json.loads(out.read_text())
    assert record["command"].startswith("hopperlm bench --quick") and record["versions"]["torch"]
    rows = {r["config"]: r for r in record["rows"]}
    assert all(r["tokens_per_s"] > 0 and r["error"] is None for r in rows.values())
    for r in rows.values():  # every window kept: the median with the slowest and the fastest beside it
        windows = r["window_tokens_per_s"]
        assert (
            len(windows) == 2
            and r["tokens_per_s_min"] == min(windows)
            and r["tokens_per_s_max"] == max(windows)
        )
        assert min(windows) <= r["tokens_per_s"] <= max(windows)
    assert "muon" in rows["hopperlm muon"]["notes"] and "adamw" in rows["hopperlm"]["notes"]
    assert rows["hopperlm"]["ratios"]["vs eager"] == pytest.approx(
        rows["hopperlm"]["tokens_per_s"] / rows["eager"]["tokens_per_s"]
    )
    assert rows["hopperlm"]["mfu"] is None  # a CPU has no datasheet peak: MFU is n/a, never invented
    bad = subprocess.run(
        [sys.executable, "-m", "hopperlm", "bench", "--presets", "gpt5"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert bad.returncode == 2 and "unknown preset" in bad.stderr


# the hf row never ends: the process is killed there, as a device call's time limit would kill it
HANG_AT_HF = """
import sys, time
import hopperlm.bench as bench
real = bench.measure
def measure(case, row, *args, **kwargs):
    if case.config == "hf":
        time.sleep(3600)
    return real(case, row, *args, **kwargs)
bench.measure = measure
from hopperlm.cli import main
sys.argv = ["hopperlm", *sys.argv[1:]]
main()
"""


@pytest.mark.slow
def test_a_bench_killed_mid_table_keeps_the_rows_it_finished(tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", "--quick", "--presets", "gpt2-124m", "--steps", "1", "--windows", "1", "--warmup", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-c", HANG_AT_HF, *args, "--out", str(out)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:  # wait on the event (two rows saved), not on the clock: only a hang reaches this deadline
        deadline = time.monotonic() + 900
        rows = []
        while len(rows) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            rows = json.loads(out.read_text())["rows"] if out.is_file() else []
        assert len(rows) == 2, (proc.poll(), rows)
        proc.kill()
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.communicate()
    record = json.loads(out.read_text())  # whole, never torn: each save is a rename
    assert [r["config"] for r in record["rows"]] == ["eager", "hopperlm"]
    assert all(r["tokens_per_s"] > 0 and r["error"] is None for r in record["rows"])
    assert record["rows"][1]["ratios"]["vs eager"] > 0 and record["table"][0].startswith("preset")
    assert not [p.name for p in tmp_path.iterdir() if p.name != "bench.json"]  # no temporary file left


def test_bench_rows_selects_rows_and_refuses_unknown_ones(tmp_path):
    from hopperlm.bench import bench_model_config
    from hopperlm.bench_rows import cases_for
    from hopperlm.hardware import detect_for

    hw = detect_for("cpu")
    cfg = bench_model_config("gpt2-124m", quick=True)
    picked = cases_for(cfg, hw, 2, 32, True, print, only=["hopperlm", "hf"])
    assert [c.config for c in picked] == ["hopperlm", "hf"]
    bad = subprocess.run(
        [sys.executable, "-m", "hopperlm", "bench", "--quick", "--rows", "hopperlm,hf-compile"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert bad.returncode == 2 and "unknown row(s) hf-compile in --rows" in bad.stderr, bad.stderr


def test_bench_variants_set_the_optimizer_shape_accumulation_and_documents():
    """--variant rows: optim.* keys reach the optimizer, seq_len and grad_accum the row's tokens per step (and
    its FLOPs per token), documents=N packs each row into N documents (masked attention)."""
    from hopperlm.bench import bench_model_config, run_bench
    from hopperlm.errors import ConfigError
    from hopperlm.hardware import detect_for
    from hopperlm.model.transformer import flops_per_token

    hw = detect_for("cpu")
    variants = ["owt:optim.name=muon,seq_len=64,micro_batch=2,grad_accum=2", "docs:documents=4",
                "wide:model.mlp=relu2,model.ffn_dim=1024,optim.name=muon,muon.normuon=true"]  # fmt: skip
    rows = run_bench(
        ["gpt2-124m"], hw, quick=True, steps=1, windows=1, warmup=1, hf=False, variants=variants,
        only=["hopperlm owt", "hopperlm docs", "hopperlm wide"], log=lambda line: None,
    )  # fmt: skip
    owt, docs, wide = rows
    # a model.* variant trains its own model, and its FLOPs per token are that model's
    assert wide.error is None and "muon" in wide.notes, wide.error
    relu2 = dataclasses.replace(bench_model_config("gpt2-124m", quick=True), mlp="relu2", ffn_dim=1024)
    assert wide.flops_per_token == flops_per_token(relu2, 128)
    assert owt.error is None and docs.error is None, (owt.error, docs.error)
    assert (owt.micro_batch, owt.seq_len, owt.grad_accum) == (2, 64, 2) and "muon" in owt.notes
    assert owt.tokens_per_s == pytest.approx(2 * 64 * 2 / (owt.step_ms / 1000))
    quick = bench_model_config("gpt2-124m", quick=True)  # FLOPs per token follow each row's own context
    assert (owt.flops_per_token, docs.flops_per_token) == (
        flops_per_token(quick, 64),
        flops_per_token(quick, 128),
    )
    assert any(n.startswith("4 documents a row") for n in docs.notes)
    with pytest.raises(ConfigError, match="documents=5 must divide"):
        run_bench(["gpt2-124m"], hw, quick=True, steps=1, windows=1, warmup=1, hf=False,
                  variants=["bad:documents=5"], only=["hopperlm bad"], log=lambda line: None)  # fmt: skip
