"""Checkpoints and exports are written with the process's usual permissions: safetensors' save_file makes
0600 files, which other users of a shared cluster cannot read; every weight file must have config.json's mode."""

import os
import stat
from pathlib import Path

import pytest
import torch

from hopperlm.checkpoint.layout import TOKENIZER_DIR, write_model
from hopperlm.config import LoRAConfig, ModelConfig
from hopperlm.interop import hf
from hopperlm.interop.hf_convert import export_hf, import_hf
from hopperlm.interop.peft import export_peft
from hopperlm.model.transformer import build_empty
from hopperlm.train.initial_model import build_lora_model

QUIET = lambda line: None  # noqa: E731


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(params=[0o022, 0o027])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def test_weights_have_the_mode_of_config_json(umask, tinyllama_hf, tmp_path):
    usual = 0o666 & ~umask
    imported = import_hf(tinyllama_hf, tmp_path / "imported", log=QUIET)  # sharded writer
    exported = export_hf(imported, tmp_path / "exported", log=QUIET)
    cfg = ModelConfig(**hf.model_values(tinyllama_hf))
    plain = tmp_path / "plain"
    write_model(plain, build_empty(cfg, "cpu"), cfg, imported / TOKENIZER_DIR)  # save_model (tied weights)
    lora = LoRAConfig(rank=4, alpha=8, targets="all-linear")
    adapted = build_lora_model(cfg, lora, "cpu", str(tinyllama_hf), torch.float32, None, seed=0)
    ckpt = tmp_path / "lora"
    write_model(ckpt, adapted, cfg, imported / TOKENIZER_DIR)
    peft = export_peft(ckpt, tmp_path / "peft")
    weights = [f for d in (imported, exported, plain, ckpt, peft) for f in d.glob("*.safetensors")]
    assert len(weights) == 5
    named = {str(f.relative_to(tmp_path)): mode(f) for f in weights}
    assert named == dict.fromkeys(named, usual)
    assert mode(plain / "config.json") == usual and mode(exported / "config.json") == usual
