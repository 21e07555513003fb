"""A model and its tokenizer out of any checkpoint, for generate, eval and chat; where a checkpoint's tokenizer is;
how a run trained (the context and validation windows `eval` repeats).

Sources: a hopperlm run (its newest valid checkpoint), checkpoint or model folder (a LoRA checkpoint is merged
into its base on the way), or a Hugging Face folder, converted on the fly.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from hopperlm.checkpoint.layout import (
    CONFIG_FILE,
    STATE_FILE,
    TOKENIZER_DIR,
    read_lora_config,
    read_model_config,
    resolve_model_dir,
)
from hopperlm.config import ModelConfig, SFTConfig
from hopperlm.data.tokenizer import BYTE_MARKER, Tokenizer, load_tokenizer
from hopperlm.errors import CheckpointError, ConfigError, DataError
from hopperlm.hardware import detect_for
from hopperlm.interop.hf import is_hf_dir, model_values
from hopperlm.interop.tensors import load_weights
from hopperlm.model.transformer import Transformer, build_empty


def load_for_inference(
    path: str | Path, device: str = "auto", *, merge: bool = True
) -> tuple[Transformer, Tokenizer]:
    """(model in eval mode, tokenizer) from a run, checkpoint, model folder or Hugging Face folder. A LoRA
    checkpoint is merged into its base on the way, or with merge=False kept as trained: the base with its
    adapters beside it (what `eval --tasks` scores, so a run is judged as it trained)."""
    path = Path(path)
    dev = detect_for(device).device
    if not merge and not is_hf_dir(path) and read_lora_config(resolve_model_dir(path)) is not None:
        model_dir = resolve_model_dir(path)
        return unmerged_lora(model_dir, dev), _tokenizer_of(model_dir, model_dir / TOKENIZER_DIR)
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
    return model.eval(), _tokenizer_of(path, tokenizer_dir)


def _tokenizer_of(path: Path, tokenizer_dir: Path) -> Tokenizer:
    try:  # a folder hopperlm exported with its byte tokenizer: the marker, not its transformers form
        marker = tokenizer_dir / BYTE_MARKER
        return load_tokenizer(marker if marker.is_file() else tokenizer_dir)
    except DataError as e:
        raise CheckpointError(f"{path} has no usable tokenizer ({e})") from None


def unmerged_lora(model_dir: Path, device) -> Transformer:
    """A LoRA checkpoint's model as it trained: its base (model.init_from, checked unchanged) wrapped with the
    adapters, in eval mode. A QLoRA run's base is its 16-bit weights (the NF4 copy is rebuilt only to train)."""
    from hopperlm.checkpoint.layout import check_base, read_adapters
    from hopperlm.model.lora import apply_lora, load_adapter_state

    model_cfg, lora_cfg = read_model_config(model_dir), read_lora_config(model_dir)
    if not model_cfg.init_from:
        raise CheckpointError(f"{model_dir} holds adapters without a model.init_from base")
    check_base(model_dir)
    model = build_empty(model_cfg, device)
    load_weights(model, model_cfg.init_from)
    apply_lora(model, lora_cfg)
    load_adapter_state(model, read_adapters(model_dir), str(model_dir))
    return model.eval()


def tokenizer_path(source: str | Path) -> Path:
    """Where the tokenizer of `source` is: a folder with a tokenizer.json, a Hugging Face model folder or a
    file as they are; a hopperlm run, checkpoint or model folder's tokenizer/."""
    path = Path(source)
    if path.is_dir() and not (path / "tokenizer.json").is_file() and not is_hf_dir(path):
        return resolve_model_dir(path) / TOKENIZER_DIR
    return path


def sft_tokenizer_path(sc: SFTConfig, model_cfg: ModelConfig) -> Path:
    """The tokenizer instruction data is read with (data/sft.py): sft.tokenizer, else model.init_from's."""
    spec = sc.tokenizer or model_cfg.init_from
    if not spec:
        raise ConfigError(
            "sft needs a tokenizer: set sft.tokenizer, or model.init_from (its tokenizer is used)"
        )
    return tokenizer_path(spec)


TRAINED_WITH = "trained_with"  # the key of config.json that keeps TrainedWith in exported and merged folders


@dataclass(frozen=True)
class TrainedWith:
    """How a hopperlm run trained and validated, which `hopperlm eval` repeats by default."""

    seq_len: int
    """train.seq_len: the context the model was trained at."""
    eval_windows: int
    """train.eval_windows: the validation windows per evaluation."""
    packing: bool
    """data.packing: validation windows were read with document masks."""
    micro_batch: int
    """Validation windows per forward (the run's micro-batch, all ranks together)."""

    def to_dict(self) -> dict:
        return asdict(self)


def trained_with(source: str | Path) -> TrainedWith | None:
    """How the run behind `source` trained: from a checkpoint's state.json, or the record export and merge keep
    in config.json. None for a Hugging Face folder or a model folder without either."""
    source = Path(source)
    if is_hf_dir(source):
        return None
    model_dir = resolve_model_dir(source)
    try:
        state = json.loads((model_dir / STATE_FILE).read_text()) if (model_dir / STATE_FILE).is_file() else {}
        kept = json.loads((model_dir / CONFIG_FILE).read_text()).get(TRAINED_WITH)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{model_dir} has an unreadable {STATE_FILE} or {CONFIG_FILE} ({e})") from None
    if kept:
        return TrainedWith(**kept)
    cfg = state.get("config") or {}
    train, data = cfg.get("train") or {}, cfg.get("data") or {}
    if not train.get("seq_len"):
        return None
    return TrainedWith(
        seq_len=int(train["seq_len"]),
        eval_windows=int(train.get("eval_windows", 200)),
        packing=bool(data.get("packing", False)),
        micro_batch=int(state.get("micro_batch") or train.get("micro_batch") or 1),
    )
