"""The Checkpointer owns what it saves: built once with the model, optimizer, scaler, run state, tokenizer
and the checkpoint section, then `save(step)`, `latest()`, `load(path)` and nothing else passed
(checkpoint/checkpointer.py).
The format, resume, kill and async behaviour are tested through `train` (test_train.py, faults/, test_dist.py);
this pins the object's own calls, in both formats."""

import pytest
import torch

from hopperlm.checkpoint.checkpointer import Checkpointer
from hopperlm.checkpoint.single import Parts
from hopperlm.config import CheckpointConfig, ModelConfig, OptimConfig
from hopperlm.model.transformer import build_model
from hopperlm.parallel.runtime import Runtime
from hopperlm.train.optim import build_optimizer


class Counter:
    """The least a run state is: what the checkpointer calls on it."""

    def __init__(self):
        self.step, self.loaded, self.rolled = 0, None, None

    def state_dict(self, world_size: int) -> dict:
        return {"step": self.step, "tokens": 64 * self.step}

    def load_state_dict(self, saved: dict) -> None:
        self.loaded, self.step = saved, saved["step"]

    def roll_back(self, saved: dict, bad_step: int) -> None:
        self.rolled, self.step = (saved["step"], bad_step), saved["step"]


def train_a_step(model, optimizer, tokens) -> None:
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("fmt", ["single", "sharded"])
def test_save_step_latest_and_load_path_with_nothing_else_passed(tmp_path, fmt):
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=16)
    model = build_model(cfg, seed=0)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2), fused=False)
    state, tokens = Counter(), torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
    ckpt = Checkpointer(CheckpointConfig(format=fmt, keep_last=1), Runtime(),
                        Parts(model, cfg, optimizer, None, tokenizer_dir=tmp_path / "tokenizer"), state,
                        run_dir=tmp_path, strategy="single")  # fmt: skip
    assert ckpt.latest() is None
    for step in (1, 2):
        train_a_step(model, optimizer, tokens)
        state.step = step
        saved = ckpt.save(step)
    kept = {k: v.clone() for k, v in model.state_dict().items()}
    assert (
        ckpt.latest() == saved
        and saved.name.endswith("2")
        and (saved / "tokenizer" / "tokenizer.json").is_file()
    )
    assert [p.name for p in saved.parent.iterdir()] == [saved.name]  # keep_last 1 pruned step 1
    train_a_step(model, optimizer, tokens)  # the run moves on, then resumes from step 2
    state.step = 3
    assert not torch.equal(model.state_dict()["embed.weight"], kept["embed.weight"])
    ckpt.load(saved)
    assert state.step == 2 and state.loaded["tokens"] == 128
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, kept[name], rtol=0, atol=0)
    ckpt.roll_back(saved, bad_step=7)
    assert state.rolled == (2, 7)
