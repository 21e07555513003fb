"""A model and its tokenizer out of any checkpoint, for generate, eval and chat; where a checkpoint's tokenizer is.

Sources: a hopperlm run (its newest valid checkpoint), checkpoint or model folder (a LoRA checkpoint is merged
into its base on the way), or a Hugging Face folder, converted on the fly.
"""

from __future__ import annotations

from pathlib import Path

from hopperlm.checkpoint.hf import is_hf_dir, model_values
from hopperlm.checkpoint.layout import TOKENIZER_DIR, read_model_config, resolve_model_dir
from hopperlm.checkpoint.tensors import load_weights
from hopperlm.config import Config, ModelConfig
from hopperlm.data.tokenizer import Tokenizer, load_tokenizer
from hopperlm.errors import CheckpointError, ConfigError, DataError
from hopperlm.hardware import detect_for
from hopperlm.model.transformer import Transformer, build_empty


def load_for_inference(path: str | Path, device: str = "auto") -> tuple[Transformer, Tokenizer]:
    """(model in eval mode, tokenizer) from a run, checkpoint, model folder or Hugging Face folder."""
    path = Path(path)
    dev = detect_for(device).device
    if is_hf_dir(path):
        model = build_empty(ModelConfig(**model_values(path)), dev)
        tokenizer_dir = path
    else:
        model_dir = resolve_model_dir(path)
        tokenizer_dir = model_dir / TOKENIZER_DIR
        if not tokenizer_dir.is_dir():
            raise CheckpointError(
                f"{model_dir} has no {TOKENIZER_DIR}/ folder; it was not written by hopperlm"
            )
        model = build_empty(read_model_config(model_dir), dev)
        path = model_dir
    load_weights(model, path)
    try:
        tokenizer = load_tokenizer(tokenizer_dir)
    except DataError as e:
        raise CheckpointError(f"{path} has no usable tokenizer ({e})") from None
    return model.eval(), tokenizer


def tokenizer_path(source: str | Path) -> Path:
    """Where the tokenizer of `source` is: a folder with a tokenizer.json, a Hugging Face model folder or a
    file as they are; a hopperlm run, checkpoint or model folder's tokenizer/."""
    path = Path(source)
    if path.is_dir() and not (path / "tokenizer.json").is_file() and not is_hf_dir(path):
        return resolve_model_dir(path) / TOKENIZER_DIR
    return path


def sft_tokenizer_path(cfg: Config) -> Path:
    """The tokenizer instruction data is read with (data/sft.py): sft.tokenizer, else model.init_from's."""
    spec = cfg.sft.tokenizer or cfg.model.init_from
    if not spec:
        raise ConfigError(
            "sft needs a tokenizer: set sft.tokenizer, or model.init_from (its tokenizer is used)"
        )
    return tokenizer_path(spec)
