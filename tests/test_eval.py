"""`hopperlm eval`: held-out loss/perplexity/bits per byte over every token, GSM8K answer extraction and CLI."""

import json
import math
import subprocess
import sys
from pathlib import Path

import torch

from hopperlm.checkpoint.inference import load_for_inference
from hopperlm.eval.gsm8k import normalize, predicted_answer, reference_answer
from hopperlm.eval.heldout import heldout_loss, token_stream

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
