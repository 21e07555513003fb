"""The one training step: a bad update is never applied whatever the optimizer, `hopperlm bench` times the
step `hopperlm train` runs (same loss on the same batches), `diagnose` plans as `train` does, and no other
module of hopperlm runs a step of its own."""

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hopperlm.bench_rows import hopperlm_case
from hopperlm.config import ModelConfig, config_from_dict, load_config
from hopperlm.data.loader import Batch, RandomWindows, TokenShards
from hopperlm.hardware import detect_for, simulated
from hopperlm.model.transformer import build_model
from hopperlm.observe.metrics import read_metrics
from hopperlm.parallel.parallelize import Parallel
from hopperlm.plan import make_plan
from hopperlm.train.loop import train
from hopperlm.train.optim import build_optimizer
from hopperlm.train.step import build_step, honours_found_inf, make_step_parts, skip_on_device, train_step

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "hopperlm"
DEBUG = REPO / "configs" / "debug.yaml"
CUDA = torch.device("cuda")  # only asked about, never used: the decision a GPU run would make


def _config(optimizer: str = "adamw"):
    """The debug model with every block matrix 64 x 64 (4096 values: the least 8-bit AdamW keeps in 8 bits) and
    the vocabulary a byte-level run rounds up to (320): 8-bit AdamW compiles its update once per distinct shape,
    and tests/test_speed.py's 8-bit run has these shapes too (the second of the two reuses the first's compiles)."""
    return config_from_dict(
        {
            "model": {"preset": "debug", "vocab_size": 320, "n_kv_heads": 4, "ffn_dim": 64},
            "optim": {"name": optimizer, "fused": True},
            "train": {"seq_len": 32, "max_steps": 2},
        }
    )


def _optimizer(name: str, model):
    if name == "adamw8bit":
        pytest.importorskip("torchao.optim")
    return build_optimizer(model, _config(name).optim, fused=True, name=name)


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "muon"])
def test_a_non_finite_gradient_never_reaches_the_weights(name):
    """optim.fused: true with each optimizer, the skip decided as on a GPU (where the device-side skip
    applies): the step is dropped and the weights and optimizer state stay as they were."""
    cfg = _config(name)
    model = build_model(cfg.model, seed=0)
    optimizer = _optimizer(name, model)
    plan = make_plan(cfg, cfg.model, detect_for("cpu"))
    parts = make_step_parts(model, Parallel("none", model), optimizer, plan=plan, grad_clip=1.0)
    parts = dataclasses.replace(parts, skip_on_device=skip_on_device(optimizer, CUDA))
    assert parts.skip_on_device == (name != "adamw8bit")  # fused AdamW and hopperlm's Muon read found_inf
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = Batch(x, x)
    good = train_step(parts, lambda micro: batch, grad_accum=1, lr=1e-3)  # optimizer state exists now
    assert bool(good.finite)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hook = model.layers[0].mlp.up_proj.weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    bad = train_step(parts, lambda micro: batch, grad_accum=1, lr=1e-3)
    hook.remove()
    assert not bool(bad.finite) and not torch.isfinite(bad.grad_norm)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a skipped step changed the weights"


@pytest.mark.parametrize("name", ["adamw8bit"])
def test_found_inf_alone_would_not_stop_these_optimizers(name):
    """Why the skip is decided per optimizer: with found_inf set, 8-bit AdamW (and torch's Muon) still apply
    a non-finite update (the bug the per-optimizer rule prevents)."""
    cfg = _config(name)
    model = build_model(cfg.model, seed=0)
    optimizer = _optimizer(name, model)
    assert not honours_found_inf(optimizer)
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    optimizer.found_inf = torch.ones(())
    optimizer.step()
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_fused_adamw_honours_found_inf():
    model = build_model(_config().model, seed=0)
    optimizer = _optimizer("adamw", model)
    assert honours_found_inf(optimizer) and skip_on_device(optimizer, CUDA)
    assert not skip_on_device(optimizer, torch.device("cpu"))  # a CPU reads the flag on the host for free


@pytest.mark.parametrize("checkpointing", ["full", "selective-op"])
def test_a_forced_attention_kernel_holds_through_the_recomputing_backward(checkpointing):
    """train.attention math on a CPU (SDPA's other CPU kernel is flash). Activation checkpointing recomputes
    each block's forward in the backward; under another kernel it would save other tensors (CheckpointError).
    The micro-batch finder runs exactly this eager step."""
    cfg = config_from_dict(
        {
            "model": {"preset": "debug", "vocab_size": 256},
            "train": {
                "seq_len": 32,
                "max_steps": 1,
                "attention": "math",
                "activation_checkpointing": checkpointing,
            },
        }
    )
    plan = make_plan(cfg, cfg.model, detect_for("cpu"))
    assert (plan.attention, plan.activation_checkpointing) == ("math", checkpointing)
    assert "SDPA math only" in plan.reasons["attention"]
    parts, _ = build_step(build_model(cfg.model, seed=0), plan, cfg.optim, log=lambda line: None)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    result = train_step(parts, lambda micro: Batch(x, x), grad_accum=1, lr=1e-3)
    assert bool(result.finite)


def test_bench_row_trains_exactly_as_train_does(shakespeare_bytes, tmp_path):
    """The bench's hopperlm row and `train` give the same losses on the same batches, step after step:
    the same step (clipping included) on the same weights."""
    steps, micro, seq = 4, 8, 64
    overrides = ["--data.path", str(shakespeare_bytes), "--run.out_dir", str(tmp_path / "run")]
    overrides += [
        "--train.max_steps",
        str(steps),
        "--train.log_every",
        "1",
        "--train.micro_batch",
        str(micro),
    ]
    overrides += ["--train.seed", "0", "--schedule.name", "constant", "--schedule.warmup_steps", "0"]
    overrides += ["--optim.grad_clip", "0.05"]  # small: every step is clipped, so clipping must match
    cfg = load_config(DEBUG, overrides)
    train(cfg, log=lambda line: None)
    trained = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]

    model_record = json.loads((tmp_path / "run" / "plan.json").read_text())["model"]
    model_cfg = ModelConfig(**{f.name: model_record[f.name] for f in dataclasses.fields(ModelConfig)})
    case = hopperlm_case(
        "hopperlm",
        model_cfg,
        detect_for("cpu"),
        micro,
        seq,
        lambda line: None,
        {"optim": dataclasses.asdict(cfg.optim)},
    )
    step, notes = case.build()
    assert "clip 0.05" in notes
    windows = RandomWindows(TokenShards(shakespeare_bytes, "train"), seq, micro, seed=0)
    benched = [float(step(*windows.batch(s, 0))) for s in range(steps)]
    assert benched == pytest.approx(trained, rel=1e-6, abs=1e-6)


def test_diagnose_plans_as_train_does(shakespeare_bytes, tmp_path):
    run_dir = tmp_path / "run"
    args = ["--data.path", str(shakespeare_bytes), "--run.out_dir", str(run_dir)]
    train(load_config(DEBUG, [*args, "--train.max_steps", "1"]), log=lambda line: None)
    trained = json.loads((run_dir / "plan.json").read_text())["plan"]
    out = subprocess.run(
        [sys.executable, "-m", "hopperlm", "diagnose", str(DEBUG), "--json", "--no-selftest", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    planned = json.loads(out.stdout)["plan"]
    assert (run_dir / "events.jsonl").read_text() == ""  # always there, empty when nothing happened
    # (the threads line follows the load average of its moment: the machine's, not the plan's, so it is named only)
    assert {k: v for k, v in planned["reasons"].items() if k != "threads"} == {
        k: v for k, v in trained["reasons"].items() if k != "threads"
    }
    assert planned["reasons"]["threads"] and trained["reasons"]["threads"]
    assert (planned["micro_batch"], planned["grad_accum"]) == (trained["micro_batch"], trained["grad_accum"])


def test_only_train_step_steps():
    """Backward passes and optimizer updates happen in train/step.py only (the bench's transformers
    baseline, a float8 start-up probe, the LR-range finder's own trial and the mixture law's curve fit, whose
    L-BFGS steps a handful of law coefficients, not a model, aside)."""
    allowed = {
        "train/step.py",
        "bench_rows.py",
        "speed/__init__.py",
        "train/optim.py",
        "observe/mixture_law.py",
    }
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            if call and node.func.attr == "backward" and rel not in allowed:
                found.append(f"{rel}:{node.lineno}")
    assert not found, f"a training step outside train/step.py: {found}"


@pytest.mark.parametrize(
    "name, fused, where",
    [
        ("adamw", None, "dropped on the device"),
        ("muon", None, "dropped on the device"),  # hopperlm's Muon + a fused AdamW
        ("muon", False, "caught on the host"),  # an unfused AdamW beside it ignores found_inf
    ],
)
def test_the_plan_says_where_a_bad_step_is_caught(name, fused, where):
    cfg = config_from_dict(
        {
            "model": {"preset": "debug", "vocab_size": 256},
            "optim": {"name": name, "fused": fused},
            "train": {"max_steps": 1, "seq_len": 32},
        }
    )
    plan = make_plan(cfg, cfg.model, simulated("H100 80GB"))
    assert f"non-finite step is {where}" in plan.reasons["optimizer"]


@pytest.mark.parametrize("machine, kept, chosen, said", [
    ("cpu", None, "fp32", "Newton–Schulz in fp32 (bf16 matrix products run 30-90x slower"),
    ("H100 80GB", None, "bf16", None),  # torch.optim.Muon's precision, nothing to say
    ("cpu", "bf16", "bf16", "Newton–Schulz in bf16, as the checkpoint trained"),
])  # fmt: skip
def test_muons_newton_schulz_precision_is_the_devices_or_the_checkpoints(machine, kept, chosen, said):
    """A CPU orthogonalises in fp32 (its bf16 GEMMs are 30-90x slower), CUDA in bf16; a resume keeps its
    checkpoint's, and the optimizer the step builds runs what the plan chose."""
    cfg = config_from_dict({"model": {"preset": "debug", "vocab_size": 256}, "optim": {"name": "muon"},
                            "train": {"max_steps": 1, "seq_len": 32}})  # fmt: skip
    hw = detect_for("cpu") if machine == "cpu" else simulated(machine)
    plan = make_plan(cfg, cfg.model, hw, kept_muon_ns=kept)
    assert plan.muon_ns == chosen
    assert (
        (said in plan.reasons["optimizer"]) if said else "Newton–Schulz in" not in plan.reasons["optimizer"]
    )
    if machine == "cpu":
        model = build_model(dataclasses.replace(cfg.model, vocab_size=256), seed=0)
        pair = build_optimizer(model, cfg.optim, False, "muon", cfg.muon, ns_precision=plan.muon_ns)
        assert pair.optimizers[0].ns_precision == chosen


def test_a_resume_on_another_kind_of_device_takes_that_devices_newton_schulz(shakespeare_bytes, tmp_path):
    """Kept where the checkpoint trained on this kind of device (or does not say: older ones); from a GPU's
    checkpoint a CPU resume is not bitwise anyway, so the CPU's own fp32 runs (bf16 there is 30-90x slower)."""
    from hopperlm.checkpoint.checkpointer import ResumePoint
    from hopperlm.train.run import checkpoint_muon_ns

    said = []
    gpu = ResumePoint(tmp_path, {"muon_ns": "bf16", "device_type": "cuda"})
    assert checkpoint_muon_ns(gpu, "cuda", "muon", said.append) == "bf16" and not said
    assert checkpoint_muon_ns(gpu, "cpu", "muon", said.append) is None
    assert (
        len(said) == 1 and "trained on cuda (Newton–Schulz in bf16); on cpu no resume is bitwise" in said[0]
    )
    assert (
        checkpoint_muon_ns(ResumePoint(tmp_path, {}), "cpu", "muon", said.append) == "bf16"
    )  # older: as saved
    assert checkpoint_muon_ns(None, "cpu", "muon", said.append) is None and len(said) == 1
    args = [
        "--data.path",
        str(shakespeare_bytes),
        "--run.out_dir",
        str(tmp_path / "run"),
        "--train.max_steps",
        "1",
    ]
    train(load_config(DEBUG, args), log=lambda line: None)
    saved = json.loads(next((tmp_path / "run" / "checkpoints").glob("step_*/state.json")).read_text())
    assert saved["device_type"] == "cpu"


def test_a_step_of_minutes_on_a_cpu_is_announced(shakespeare_bytes, tmp_path, monkeypatch):
    """The preflight says, before the wait, that one step will take minutes (here: a machine that would
    compute 10 tokens/s), with the predicted time and what to change."""
    from hopperlm.train import run as run_module

    monkeypatch.setattr(run_module, "predicted_tokens_per_s", lambda plan, fpt: (10.0, 1e9))
    lines = []
    args = ["--data.path", str(shakespeare_bytes), "--run.out_dir", str(tmp_path / "run")]
    train(load_config(DEBUG, [*args, "--train.max_steps", "1"]), log=lines.append)
    warnings = [line for line in lines if line.startswith("warning: one optimizer step will take")]
    assert len(warnings) == 1 and "at least 102 s" in warnings[0] and "made for a GPU" in warnings[0], (
        warnings
    )
    monkeypatch.undo()  # this machine's own rate: the debug step takes milliseconds
    quiet = []
    train(
        load_config(DEBUG, [*args[:-1], str(tmp_path / "fast"), "--train.max_steps", "1"]), log=quiet.append
    )
    assert not [line for line in quiet if "optimizer step will take" in line]


@pytest.mark.parametrize("horizon", ["extend", "keep"])
def test_resuming_with_a_longer_budget_says_how_the_schedule_changes(shakespeare_bytes, tmp_path, horizon):
    args = ["--data.path", str(shakespeare_bytes), "--run.out_dir", str(tmp_path / "run")]
    args += ["--train.log_every", "1", "--schedule.warmup_steps", "2", "--train.eval_every", "0"]
    train(load_config(DEBUG, [*args, "--train.max_steps", "10"]), log=lambda line: None)
    lines = []
    resumed = load_config(DEBUG, [*args, "--train.max_steps", "20", "--schedule.resume_horizon", horizon])
    train(resumed, resume=True, log=lines.append)
    said = [line for line in lines if line.startswith("resume: budget changed (max_steps 10 -> 20)")]
    assert len(said) == 1, lines
    lr = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")}
    floor = resumed.optim.lr * resumed.schedule.min_lr_ratio
    if horizon == "keep":  # the original decay had ended: the LR stays at its floor
        assert "original schedule kept" in said[0] and lr[11] == pytest.approx(floor)
    else:  # cosine re-laid over 20 steps: the LR jumps back up, and the line says by how much
        assert "re-laid" in said[0] and lr[11] > 5 * floor
        assert f"-> {lr[11]:.3g}" in said[0]


def test_threads_are_the_users_choice_else_the_cores_a_busy_machine_leaves(monkeypatch):
    hw = detect_for("cpu")
    cfg = _config()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torch follows it; the plan says so, busy or not
    monkeypatch.setattr("os.getloadavg", lambda: (hw.cpu_cores + 0.0, 0.0, 0.0))
    assert make_plan(cfg, cfg.model, hw).reasons["threads"] == "1 (set by OMP_NUM_THREADS)"
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr("os.getloadavg", lambda: (hw.cpu_cores + 0.0, 0.0, 0.0))
    plan = make_plan(cfg, cfg.model, hw)  # the cores the others leave, at least one, and how to take them all
    assert plan.threads == (None if hw.cpu_cores == 1 else 1) and "load average is" in plan.reasons["threads"]
    assert f"train.threads {hw.cpu_cores}" in plan.reasons["threads"] or hw.cpu_cores == 1
    monkeypatch.setattr("os.getloadavg", lambda: (0.0, 0.0, 0.0))
    assert "warning" not in make_plan(cfg, cfg.model, hw).reasons["threads"]
    one = make_plan(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, threads=1)), cfg.model, hw)
    before = torch.get_num_threads()
    try:
        one.apply_runtime_settings(lambda line: None)
        assert (
            one.threads == 1
            and torch.get_num_threads() == 1
            and "set by train.threads" in one.reasons["threads"]
        )
    finally:
        torch.set_num_threads(before)
