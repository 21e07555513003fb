"""`hopperlm eval` scores what the numbers it is compared with score: a run's own validation windows (its loss
equals the val_loss the run logged) and transformers' `model(ids, labels=ids).loss` on the same windows."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from hopperlm.cli import main
from hopperlm.config import ModelConfig, load_config
from hopperlm.data.loader import TokenShards, eval_windows
from hopperlm.data.tokenizer import ByteTokenizer
from hopperlm.eval import heldout
from hopperlm.interop.inference import load_for_inference
from hopperlm.model.transformer import build_model
from hopperlm.observe.metrics import read_metrics
from hopperlm.train.loop import train

REPO = Path(__file__).resolve().parents[1]
QUIET = lambda line: None  # noqa: E731


def run_eval(capsys, out: Path, *args: str) -> tuple[dict, list[str]]:
    """`hopperlm eval ARGS --json OUT` in this process: (the JSON report, the printed lines)."""
    capsys.readouterr()
    main(["eval", *args, "--json", str(out)])
    return json.loads(out.read_text()), capsys.readouterr().out.splitlines()


def test_eval_of_a_run_equals_its_logged_val_loss(shakespeare_bytes, tmp_path, capsys):
    run = tmp_path / "run"
    overrides = ["--data.path", str(shakespeare_bytes), "--run.out_dir", str(run), "--train.max_steps", "20"]
    overrides += ["--train.eval_every", "20", "--train.log_every", "10", "--train.eval_windows", "24"]
    train(load_config(REPO / "configs" / "debug.yaml", overrides), log=QUIET)
    logged = [r["val_loss"] for r in read_metrics(run / "metrics.jsonl") if r.get("val_loss") is not None]

    report, lines = run_eval(capsys, tmp_path / "eval.json", str(run), "--data", str(shakespeare_bytes))
    held = report["heldout"][0]
    assert abs(held["loss"] - logged[-1]) < 1e-5, (held["loss"], logged[-1])
    # the run's context, its validation windows (train.eval_windows of seq_len + 1 tokens) and micro-batch
    assert "context 64 tokens (the run's train.seq_len); 16 windows per forward" in lines
    assert (
        f"{shakespeare_bytes}: windows of 65 tokens (64 predicted), stride 65, 24 windows, 1,536 tokens scored"
        in (lines)
    )
    assert (held["window"], held["stride"], held["windows"], held["tokens"]) == (65, 65, 24, 24 * 64)
    # bits per byte of a byte-level prepared dir: every scored id below 256 is one byte of text
    assert 0 < held["bytes"] <= held["tokens"]
    assert held["bits_per_byte"] == pytest.approx(held["loss"] * held["tokens"] / math.log(2) / held["bytes"])
    assert not any("n/a" in line for line in lines)

    # an export in hopperlm's format keeps how the run trained: the same windows, the same loss
    main(["export", str(run), str(tmp_path / "exported"), "--format", "hopperlm"])
    report, _ = run_eval(
        capsys, tmp_path / "exported.json", str(tmp_path / "exported"), "--data", str(shakespeare_bytes)
    )
    assert report["heldout"][0] == held


def test_bits_per_byte_of_a_byte_dir_counts_the_scored_bytes(shakespeare_bytes):
    model = build_model(
        ModelConfig(dim=32, n_layers=1, n_heads=2, ffn_dim=64, vocab_size=320, max_seq_len=64), seed=0
    )
    r = heldout.heldout_loss(model.eval(), ByteTokenizer(), shakespeare_bytes, seq_len=32, batch=4, windows=6)
    val = TokenShards(shakespeare_bytes, "val")
    starts = eval_windows(val, 32, 6)
    scored = np.stack([val.read(s, 33)[1:] for s in starts])
    assert r.tokens == 6 * 32 and r.windows == 6 and r.stride == 33
    assert r.bytes == int((scored < 256).sum()) and r.bits_per_byte is not None
    assert r.bits_per_byte == pytest.approx(r.nats_per_token * r.tokens / math.log(2) / r.bytes)


def test_eval_of_a_hf_model_equals_transformers_on_the_same_windows(tinyllama_hf, data_dir, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    text = (data_dir / "hornmt" / "eng.txt").read_text(encoding="utf-8")[:3000]
    sample = tmp_path / "sample.txt"
    sample.write_text(text, encoding="utf-8")

    report, lines = run_eval(capsys, tmp_path / "eval.json", str(tinyllama_hf), "--data", str(sample))

    # transformers: tokenizer(text) once, windows of 512 + 1 tokens at stride 512 (max_position_embeddings = 512),
    # each window's mean loss weighted by its predictions
    tok = transformers.AutoTokenizer.from_pretrained(tinyllama_hf)
    model = transformers.AutoModelForCausalLM.from_pretrained(tinyllama_hf).float().eval()
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    total, windows = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(ids) - 1, 512):
            window = torch.tensor([ids[s : s + 513]])
            total += model(window, labels=window).loss.item() * (window.shape[1] - 1)
            windows += 1
    theirs = total / (len(ids) - 1)

    held = report["heldout"][0]
    assert abs(held["loss"] - theirs) < 1e-4, (held["loss"], theirs)
    assert held["tokens"] == len(ids) - 1 and held["bytes"] == len(text.encode("utf-8"))
    assert "context 512 tokens (the model's context (max_position_embeddings))" in lines[0]
    windowing = f"windows of 513 tokens (512 predicted), stride 512, {windows} windows, {len(ids) - 1:,} tokens scored"
    assert f"{sample}: {windowing}" in lines


def test_default_context_is_capped_so_one_windows_logits_fit(tinyllama_hf, monkeypatch):
    model, _ = load_for_inference(tinyllama_hf, device="cpu")
    assert heldout.default_context(model, None, None) == (
        512,
        "the model's context (max_position_embeddings)",
    )
    assert heldout.default_context(model, 64, None) == (64, "the run's train.seq_len")
    assert heldout.default_context(model, 64, 1000)[0] == 512  # --seq-len, never beyond the context
    monkeypatch.setattr(heldout, "CPU_LOGITS_BUDGET", 200 * 32000 * heldout.LOGIT_BYTES)
    seq_len, why = heldout.default_context(model, None, None)
    assert seq_len == 192 and "capped at 192 so one window's logits fit in memory" in why
    assert heldout.default_batch(model, 192) == 1
