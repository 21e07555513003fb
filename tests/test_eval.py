"""`hopperlm eval`: held-out loss/perplexity/bits per byte over every token, GSM8K answer extraction and CLI."""

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hopperlm.eval.gsm8k import normalize, predicted_answer, reference_answer
from hopperlm.eval.heldout import heldout_loss, token_stream
from hopperlm.interop.inference import load_for_inference

REPO = Path(__file__).resolve().parents[1]


def test_gsm8k_answers_are_compared_as_numbers():
    assert reference_answer("She makes 9 * 2 = $<<9*2=18>>18.\n#### 18") == "18"
    assert reference_answer("#### 1,250") == "1250"
    assert predicted_answer("So 3 + 4 = 7 apples, then 7 * 2 = 14.\n#### 14") == "14"
    assert predicted_answer("The total is $1,250.00.") == "1250"
    assert predicted_answer("no number here") is None
    assert normalize("-3.50") == "-3.5" and normalize("18.0") == "18"


def test_heldout_scores_every_token_once(tinyllama_hf, data_dir, tmp_path):
    model, tokenizer = load_for_inference(tinyllama_hf, device="cpu")
    text = data_dir / "hornmt" / "eng.txt"
    sample = tmp_path / "sample.txt"
    sample.write_text(text.read_text(encoding="utf-8")[:1500], encoding="utf-8")
    ids, nbytes = token_stream(sample, tokenizer, None)
    r = heldout_loss(model, tokenizer, sample, seq_len=100, batch=4)  # windows of 100 with a shorter last one
    assert r.tokens == len(ids) - 1 and nbytes == len(sample.read_bytes())
    with torch.no_grad():  # the same number from one pass over the whole stream
        x = torch.from_numpy(ids[None, :-1])
        y = torch.from_numpy(ids[None, 1:])
        whole = torch.nn.functional.cross_entropy(model(x)[0], y[0]).item()
    assert abs(r.nats_per_token - whole) > 0  # windows restart the context, so not identical ...
    assert abs(r.nats_per_token - whole) < 0.1  # ... but close for a random model (0.052 with BOS first)
    assert math.isclose(r.bits_per_byte, r.nats_per_token * r.tokens / math.log(2) / nbytes)


def test_eval_cli_reports_heldout_and_gsm8k(tinyllama_hf, data_dir, tmp_path):
    out = tmp_path / "eval.json"
    result = subprocess.run(
        [
            sys.executable, "-m", "hopperlm", "eval", str(tinyllama_hf),
            "--data", str(data_dir / "hornmt" / "eng.txt"), "--max-tokens", "2000", "--seq-len", "256",
            "--gsm8k", str(data_dir / "gsm8k" / "test.jsonl"), "--limit", "2", "--max-new-tokens", "6",
            "--json", str(out),
        ],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    held = report["heldout"][0]
    assert held["tokens"] == 2000 and 9.0 < held["loss"] < 12.0  # a random model: about ln(32000) = 10.4
    assert math.isclose(held["perplexity"], math.exp(held["loss"]))
    assert report["gsm8k"]["total"] == 2 and len(report["gsm8k"]["samples"]) == 2
    assert "gsm8k: " in result.stdout and "exact match" in result.stdout
    nothing = subprocess.run(
        [sys.executable, "-m", "hopperlm", "eval", str(tinyllama_hf)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert nothing.returncode == 2 and "nothing to evaluate" in nothing.stderr


def _recording_shapes(model) -> list[tuple[int, ...]]:
    """The token shape of every forward call of `model` (what torch.compile would specialise on)."""
    shapes = []
    model.register_forward_pre_hook(lambda m, args: shapes.append(tuple(args[0].shape)))
    return shapes


def test_training_evaluation_runs_one_batch_shape_and_keeps_the_loss(shakespeare_bytes):
    """7 windows in batches of 3: the last batch is padded to 3 rows that add nothing to the loss, so a compiled
    model never recompiles for it, and the loss is that of one window at a time."""
    from hopperlm.config import config_from_dict
    from hopperlm.config.presets import get_preset
    from hopperlm.data.loader import TokenShards, eval_windows
    from hopperlm.hardware import detect
    from hopperlm.model.transformer import build_model
    from hopperlm.plan import make_plan
    from hopperlm.train.evaluate import evaluate

    cfg = dataclasses.replace(get_preset("debug"), vocab_size=256)
    plan = make_plan(
        config_from_dict({"model": {"preset": "debug"}, "train": {"max_steps": 1, "seq_len": 64}}),
        cfg,
        detect(),
    )
    shards = TokenShards(shakespeare_bytes, "val")
    starts = eval_windows(shards, 64, 7)
    model = build_model(cfg, seed=0)
    shapes = _recording_shapes(model)
    one_at_a_time = evaluate(model, shards, starts, plan, micro_batch=1)
    assert set(shapes) == {(1, 64)}
    shapes.clear()
    batched = evaluate(model, shards, starts, plan, micro_batch=3)
    assert shapes == [(3, 64)] * 3  # not [(3, 64), (3, 64), (1, 64)]
    assert batched == pytest.approx(one_at_a_time, rel=1e-6)
    shapes.clear()
    assert evaluate(model, shards, starts, plan, micro_batch=3, packing=True) == pytest.approx(
        one_at_a_time, rel=1e-6
    )  # one document per window here: packing changes nothing but the path
    assert shapes == [(3, 64)] * 3


def test_heldout_runs_one_batch_shape_and_keeps_the_loss(data_dir, shakespeare_bytes, tmp_path):
    """`hopperlm eval` pads the last batch and the last, shorter window with ignored targets, so every forward
    has one shape, and the loss is that of each window alone."""
    from hopperlm.config import ModelConfig
    from hopperlm.data.tokenizer import ByteTokenizer
    from hopperlm.model.transformer import build_model

    cfg = ModelConfig(dim=32, n_layers=1, n_heads=2, ffn_dim=64, vocab_size=320, max_seq_len=64)
    model = build_model(cfg, seed=0).eval()
    shapes = _recording_shapes(model)
    sample = tmp_path / "sample.txt"
    sample.write_text((data_dir / "hornmt" / "eng.txt").read_text(encoding="utf-8")[:300], encoding="utf-8")
    ids, _ = token_stream(sample, ByteTokenizer(), None)
    r = heldout_loss(model, ByteTokenizer(), sample, seq_len=32, batch=4)
    assert r.windows == 10 and (len(ids) - 1) % 32  # 10 windows in batches of 4, the last one shorter
    assert shapes == [(4, 32)] * 3  # not [(4, 32), (4, 32), (1, 32), (1, <32)]
    with torch.no_grad():  # each window alone, at its own length
        nats = sum(
            torch.nn.functional.cross_entropy(
                model(torch.from_numpy(ids[None, s : min(s + 32, len(ids) - 1)]))[0],
                torch.from_numpy(ids[s + 1 : s + 33]),
                reduction="sum",
            ).item()
            for s in range(0, len(ids) - 1, 32)
        )
    assert r.nats_per_token == pytest.approx(nats / (len(ids) - 1), rel=1e-5)

    shapes.clear()
    batched = heldout_loss(model, ByteTokenizer(), shakespeare_bytes, seq_len=32, batch=4, windows=6)
    assert shapes == [(4, 32)] * 2
    alone = heldout_loss(model, ByteTokenizer(), shakespeare_bytes, seq_len=32, batch=1, windows=6)
    assert batched.nats_per_token == pytest.approx(alone.nats_per_token, rel=1e-5)
    assert (batched.tokens, batched.bytes, batched.windows) == (alone.tokens, alone.bytes, alone.windows)
