"""NaN/Inf injected into the loss or the gradients at random steps, under each guard policy."""

import json
import random
from pathlib import Path

import pytest
import torch

from hopperlm.checkpoint.layout import latest_checkpoint, verify_checkpoint
from hopperlm.config import load_config
from hopperlm.model.transformer import Transformer
from hopperlm.observe.metrics import read_metrics
from hopperlm.train.guard import GuardStop
from hopperlm.train.loop import train

REPO = Path(__file__).resolve().parents[2]
STEPS = 100


def config(data, run, *extra):
    return load_config(
        REPO / "configs" / "debug.yaml",
        [
            "--data.path",
            str(data),
            "--run.out_dir",
            str(run),
            "--train.max_steps",
            str(STEPS),
            "--checkpoint.every",
            "10",
            "--train.eval_every",
            "50",
            *extra,
        ],
    )


def inject_into_loss(monkeypatch, bad_calls: set[int], value: float):
    """Make the training forward pass return `value` (nan, inf or a huge spike) on the given calls."""
    real = Transformer.forward
    calls = [0]

    def forward(self, tokens, targets=None, pos=0):
        out = real(self, tokens, targets, pos)
        if targets is not None and torch.is_grad_enabled():
            calls[0] += 1
            if calls[0] in bad_calls:
                return out * value if value != value or abs(value) == float("inf") else out + value
        return out

    monkeypatch.setattr(Transformer, "forward", forward)


def inject_into_grads(monkeypatch, bad_calls: set[int]):
    real = torch.nn.utils.clip_grad_norm_
    calls = [0]

    def clip(params, max_norm, *a, **k):
        calls[0] += 1
        params = list(params)
        if calls[0] in bad_calls:
            params[0].grad.fill_(float("inf"))
        return real(params, max_norm, *a, **k)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)


@pytest.fixture(scope="module")
def clean_val(shakespeare_bytes, tmp_path_factory):
    return train(
        config(shakespeare_bytes, tmp_path_factory.mktemp("clean") / "run"), log=lambda _: None
    ).val_loss


def events(run):
    path = Path(run) / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_skip_policy_drops_bad_updates(shakespeare_bytes, tmp_path, monkeypatch, clean_val):
    bad = set(random.Random(1).sample(range(5, STEPS), 4))
    inject_into_loss(monkeypatch, bad, float("nan"))
    result = train(config(shakespeare_bytes, tmp_path / "run"), log=lambda _: None)
    assert result.step == STEPS and result.val_loss == result.val_loss  # finished, finite
    assert sorted(e["step"] for e in events(tmp_path / "run")) == sorted(bad)
    assert all(e["action"] == "update skipped" for e in events(tmp_path / "run"))
    assert read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]["skipped_steps"] == 4
    assert abs(result.val_loss - clean_val) / clean_val < 0.03
    for p in torch.load(latest_checkpoint(tmp_path / "run") / "optimizer.pt", weights_only=True)["optimizer"][
        "state"
    ].values():
        assert torch.isfinite(p["exp_avg"]).all()  # the NaN never reached the optimizer state


def test_skip_policy_inf_gradients(shakespeare_bytes, tmp_path, monkeypatch):
    inject_into_grads(monkeypatch, {7, 33})
    result = train(config(shakespeare_bytes, tmp_path / "run"), log=lambda _: None)
    assert result.step == STEPS and [e["step"] for e in events(tmp_path / "run")] == [7, 33]


def test_rollback_policy_after_repeated_bad_steps(shakespeare_bytes, tmp_path, monkeypatch, clean_val):
    inject_into_loss(monkeypatch, {44, 45, 46}, float("inf"))
    lines = []
    result = train(
        config(shakespeare_bytes, tmp_path / "run", "--guard.policy", "rollback"), log=lines.append
    )
    assert result.step == STEPS
    rollbacks = [e for e in events(tmp_path / "run") if "rolled back" in e["action"]]
    assert len(rollbacks) == 1 and "step_000040" in rollbacks[0]["action"]
    assert "skipping the data of steps 41-46" in rollbacks[0]["action"]
    steps = [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert steps == sorted(set(steps))  # the curve restarts at the checkpoint: no duplicate steps
    assert abs(result.val_loss - clean_val) / clean_val < 0.02


def test_rollback_on_loss_spike(shakespeare_bytes, tmp_path, monkeypatch):
    inject_into_loss(monkeypatch, {70}, 50.0)  # finite but far above median + k*MAD
    result = train(
        config(shakespeare_bytes, tmp_path / "run", "--guard.policy", "rollback", "--guard.lr_factor", "0.5"),
        log=lambda _: None,
    )
    assert result.step == STEPS
    (event,) = events(tmp_path / "run")
    assert event["step"] == 70 and "LR x0.5" in event["action"]


def test_stop_policy_saves_and_stops(shakespeare_bytes, tmp_path, monkeypatch):
    inject_into_loss(monkeypatch, {23}, float("nan"))
    with pytest.raises(GuardStop, match="non-finite loss or gradient at step 23"):
        train(config(shakespeare_bytes, tmp_path / "run", "--guard.policy", "stop"), log=lambda _: None)
    ckpt = latest_checkpoint(tmp_path / "run")
    assert ckpt.name == "step_000030" and verify_checkpoint(ckpt) is None  # saved at the log step after it
    weights = __import__("safetensors.torch").torch.load_file(ckpt / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())
