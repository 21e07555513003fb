"""The training loop on real data: loss falls, budgets stop it, checkpoints resume it exactly, CLI verbs work."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hopperlm.checkpoint.layout import latest_checkpoint, list_checkpoints
from hopperlm.config import load_config
from hopperlm.errors import CheckpointError, DataError
from hopperlm.interop.inference import load_for_inference
from hopperlm.observe.metrics import read_metrics
from hopperlm.train.loop import train

REPO = Path(__file__).resolve().parents[1]
DEBUG = REPO / "configs" / "debug.yaml"
QUIET = lambda line: None  # noqa: E731


def debug_config(data_dir, run_dir, *overrides):
    return load_config(DEBUG, ["--data.path", str(data_dir), "--run.out_dir", str(run_dir), *overrides])


def test_a_run_inside_its_first_log_interval_says_its_speed_includes_the_warm_up(shakespeare_bytes, tmp_path):
    lines = []
    # one step: a longer short run now logs every step (observe/log_cadence.py), and its second is warm
    cfg = debug_config(
        shakespeare_bytes, tmp_path / "run", "--train.max_steps", "1", "--train.log_every", "10"
    )
    train(cfg, log=lines.append)
    checks = [line for line in lines if line.startswith("preflight check: speed")]
    assert len(checks) == 1 and "(over the first steps: compile and warm-up included)" in checks[0], lines


def test_debug_preset_trains_and_val_loss_falls(shakespeare_bytes, tmp_path):
    lines = []
    cfg = debug_config(
        shakespeare_bytes, tmp_path / "run", "--train.max_steps", "120", "--train.eval_every", "20"
    )
    result = train(cfg, log=lines.append)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(vals) == 6
    assert vals[-1] < vals[0] - 0.3, vals
    assert vals[-1] < 2.7  # byte-level Tiny Shakespeare: uniform would be ln(257) = 5.55
    assert result.stopped_by == "max_steps" and result.step == 120
    banner = "\n".join(lines[: next(i for i, line in enumerate(lines) if line.startswith("step "))])
    for word in (
        "device: CPU",
        "precision: fp32",
        "compile: off",
        "micro_batch: 16 (set by train.micro_batch)",
        "parameters",
        "FLOPs/token",
        "tokens/step",
        "preflight: speed at most",
        "plan: 120 steps",
    ):
        assert word in banner, word
    # measured after warm-up: at the second log step, not the first (whose interval holds the compile)
    checks = [i for i, line in enumerate(lines) if line.startswith("preflight check: speed")]
    steps = [i for i, line in enumerate(lines) if line.startswith("step ")]
    assert len(checks) == 1 and steps[1] < checks[0] < steps[2], lines
    assert "warm-up included" not in lines[checks[0]]
    expected = {
        "step",
        "tokens",
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "mfu",
        "step_time_s",
        "peak_mem_gb",
    }
    assert all(expected <= set(r) for r in records)
    assert all(r["mfu"] is None for r in records)  # CPU: n/a, never invented
    assert any("MFU n/a" in line for line in lines)
    assert records[-1]["tokens"] == 120 * 16 * 64


# the pretraining race's levers (issue 60): Muon's momentum warm-up and warm-down, cautious weight decay on a
# cosine schedule, NorMuon and Polar Express (optimizer state beyond momentum), group LRs, a warm-up share, a ReLU²
# MLP, QK-norm and a logit softcap; the run crosses its checkpoint inside the momentum warm-up
RECIPE_LEVERS = [
    "--optim.name", "muon", "--muon.momentum_warmup_steps", "8", "--muon.momentum_final", "0.9",
    "--muon.cautious_weight_decay", "true", "--muon.weight_decay_schedule", "cosine", "--muon.normuon", "true",
    "--muon.ns", "polar_express", "--optim.groups", "[{pattern: embed.weight, lr: 10}, {pattern: lm_head.weight, lr: 0.6667}]",
    "--schedule.warmup_share", "0.2", "--schedule.name", "wsd", "--model.mlp", "relu2", "--model.qk_norm", "true",
    "--model.logit_softcap", "15",
]  # fmt: skip


@pytest.mark.parametrize("levers", [[], RECIPE_LEVERS], ids=["adamw", "race-levers"])
def test_resume_gives_the_same_losses_as_an_uninterrupted_run(shakespeare_bytes, tmp_path, levers):
    overrides = [
        *levers,
        "--train.max_steps",
        "12",
        "--checkpoint.every",
        "6",
        "--train.log_every",
        "1",
        "--train.eval_every",
        "6",
        "--model.dropout",
        "0.1",
        "--train.batch_tokens",
        "2048",
    ]
    full = tmp_path / "full"
    train(debug_config(shakespeare_bytes, full, *overrides), log=QUIET)
    assert [p.name for p in list_checkpoints(full)] == ["step_000006", "step_000012"]

    # the same run "killed" after its step-6 checkpoint: only what was on disk then survives
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step_000012")
    kept = [
        line for line in (cut / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= 6
    ]
    (cut / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    (cut / "checkpoints" / "step_000012.tmp-4242").mkdir()  # a save that was killed half-way
    assert latest_checkpoint(cut).name == "step_000006"

    train(debug_config(shakespeare_bytes, cut, *overrides), resume=True, log=QUIET)
    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(cut / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 13))
    for ra, rb in zip(a, b, strict=True):
        assert ra["loss"] == rb["loss"] and ra["lr"] == rb["lr"] and ra["grad_norm"] == rb["grad_norm"]
        assert ra.get("val_loss") == rb.get("val_loss")
    assert not (cut / "checkpoints" / "step_000012.tmp-4242").exists()  # cleaned by the next save


def test_run_dir_protection_and_mismatched_resume(shakespeare_bytes, tmp_path):
    run = tmp_path / "run"
    train(debug_config(shakespeare_bytes, run, "--train.max_steps", "2"), log=QUIET)
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        train(debug_config(shakespeare_bytes, run, "--train.max_steps", "2"), log=QUIET)
    with pytest.raises(CheckpointError, match="different model section"):
        train(
            debug_config(shakespeare_bytes, run, "--train.max_steps", "4", "--model.dim", "128"),
            resume=True,
            log=QUIET,
        )
    with pytest.raises(CheckpointError, match="has no valid checkpoint"):
        train(
            debug_config(shakespeare_bytes, tmp_path / "new", "--train.max_steps", "2"),
            resume=True,
            log=QUIET,
        )
    assert latest_checkpoint(run).name == "step_000002"  # nothing on disk was lost


@pytest.mark.slow
def test_token_time_and_target_budgets(shakespeare_bytes, tmp_path):
    by_tokens = train(
        debug_config(
            shakespeare_bytes, tmp_path / "t", "--train.max_steps", "null", "--train.max_tokens", "5000"
        ),
        log=QUIET,
    )
    assert by_tokens.stopped_by == "max_tokens" and by_tokens.step == 5  # ceil(5000 / 1024)
    by_time = train(
        debug_config(
            shakespeare_bytes,
            tmp_path / "h",
            "--train.max_steps",
            "null",
            "--train.max_hours",
            "0.001",  # 3.6 s: even a step of 0.3 s on a busy machine starts past 89% of it
            "--train.log_every",
            "1",
            "--schedule.warmup_steps",
            "0",  # the shape is then set by the clock alone, however few steps a busy machine manages
            "--train.threads",
            "1",  # (no spinning against the suite's other workers: a few steps fit besides the final evaluation)
        ),
        log=QUIET,
    )
    assert by_time.stopped_by == "max_hours" and by_time.step > 3
    # the step nearest the deadline, less the final evaluation's time, stops it, busy or not
    assert 0.9 * 3.6 <= by_time.elapsed_s < 15.0
    records = read_metrics(tmp_path / "h" / "metrics.jsonl")
    assert records[-1]["lr"] < 0.2 * records[len(records) // 3]["lr"]  # the decay landed at the deadline
    by_target = train(
        debug_config(
            shakespeare_bytes,
            tmp_path / "g",
            "--train.max_steps",
            "500",
            "--train.eval_every",
            "10",
            "--train.target_loss",
            "3.2",
        ),
        log=QUIET,
    )
    assert by_target.stopped_by == "target_loss" and by_target.step < 500 and by_target.val_loss <= 3.2


def test_tokenizer_must_match_manifest(shakespeare_bytes, tmp_path, data_dir):
    gpt2 = data_dir / "tokenizers" / "gpt2" / "tokenizer.json"
    cfg = debug_config(shakespeare_bytes, tmp_path / "x", "--data.tokenizer", str(gpt2))
    with pytest.raises(DataError, match="does not match the tokenizer"):
        train(cfg, log=QUIET)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "hopperlm", *args], capture_output=True, text=True, cwd=REPO)


@pytest.mark.slow
def test_cli_train_generate_export(shakespeare_bytes, tmp_path):
    run = tmp_path / "run"
    result = run_cli(
        "train",
        str(DEBUG),
        "--data.path",
        str(shakespeare_bytes),
        "--run.out_dir",
        str(run),
        "--train.max_steps",
        "30",
    )
    assert result.returncode == 0, result.stderr
    assert "done: max_steps after 30 steps" in result.stdout
    gen = run_cli("generate", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "40", "--seed", "1")
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("ROMEO:") and len(gen.stdout) > 30
    out = tmp_path / "export"
    exp = run_cli(
        "export", str(run), str(out)
    )  # a Hugging Face folder (the byte tokenizer's marker beside it)
    assert exp.returncode == 0, exp.stderr
    # what transformers loads (tokenizer.json giving the byte ids, the token names, sampling as the run samples)
    # and the byte marker that hopperlm import keeps
    assert {p.name for p in out.iterdir()} == {
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "hopperlm-byte.json",
    }
    native = run_cli("export", str(run), str(tmp_path / "native"), "--format", "hopperlm")
    assert native.returncode == 0 and (tmp_path / "native" / "tokenizer").is_dir()
    again = run_cli("export", str(run), str(out))
    assert again.returncode == 2 and "pass --overwrite" in again.stderr
    model, tokenizer = load_for_inference(out)
    assert model.cfg.n_layers == 2 and tokenizer.decode(tokenizer.encode("Hi")) == "Hi"
    gen2 = run_cli("generate", str(out), "--prompt", "ROMEO:", "--max-new-tokens", "40", "--seed", "1")
    assert gen2.stdout == gen.stdout  # the exported model is the checkpoint's model
    missing = run_cli("generate", str(tmp_path / "nope"))
    assert missing.returncode == 2 and missing.stderr.startswith("error: ")


def test_out_of_memory_halves_micro_batch_and_keeps_global_batch(shakespeare_bytes, tmp_path, monkeypatch):
    """An OOM in a step (simulated: forward refuses micro-batches above 4) is caught and the step redone."""
    import torch

    from hopperlm.model.transformer import Transformer
    from hopperlm.train.out_of_memory import OutOfMemory

    real_forward = Transformer.forward

    def tight_forward(self, tokens, targets=None, pos=0):
        if torch.is_grad_enabled() and tokens.shape[0] > 4:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_forward(self, tokens, targets, pos)

    monkeypatch.setattr(Transformer, "forward", tight_forward)
    lines = []
    cfg = debug_config(
        shakespeare_bytes, tmp_path / "oom", "--train.max_steps", "6", "--train.log_every", "1"
    )
    result = train(cfg, log=lines.append)
    halvings = [line for line in lines if line.startswith("out of memory at step 1")]
    assert len(halvings) == 2  # 16 -> 8 -> 4
    assert "accumulation doubled to 4 (global batch unchanged)" in halvings[-1]
    assert result.step == 6 and result.tokens == 6 * 16 * 64

    monkeypatch.setattr(
        Transformer, "forward", lambda *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError())
    )
    with pytest.raises(OutOfMemory, match="activation_checkpointing full"):
        train(
            debug_config(
                shakespeare_bytes, tmp_path / "oom2", "--train.max_steps", "2", "--train.micro_batch", "1"
            ),
            log=QUIET,
        )


def test_threads_chosen_for_a_busy_machine_are_kept_by_a_resume(shakespeare_bytes, tmp_path, monkeypatch):
    """The plan takes the cores a busy machine leaves (plan/choices.py choose_threads); another thread count sums
    floats in another order, so a resume on a quiet machine keeps the checkpoint's count, and says so."""
    import torch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.getloadavg", lambda: (64.0, 0.0, 0.0))  # every core busy: one thread
    before = torch.get_num_threads()
    try:
        run = tmp_path / "run"
        train(
            debug_config(shakespeare_bytes, run, "--train.max_steps", "2", "--checkpoint.every", "2"),
            log=QUIET,
        )
        saved = json.loads((latest_checkpoint(run) / "state.json").read_text())
        assert saved["threads"] == 1
        monkeypatch.setattr("os.getloadavg", lambda: (0.0, 0.0, 0.0))
        torch.set_num_threads(2)
        lines = []
        train(debug_config(shakespeare_bytes, run, "--train.max_steps", "3"), resume=True, log=lines.append)
        assert torch.get_num_threads() == 1
        assert "resume: 1 CPU threads, as the checkpoint trained (train.threads to choose others)" in lines
    finally:
        torch.set_num_threads(before)
