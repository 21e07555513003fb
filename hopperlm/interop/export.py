"""A checkpoint's model part (weights, config, tokenizer) copied out as a model folder of its own: what
`hopperlm export --format hopperlm` writes. A sharded checkpoint is gathered into one model.safetensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from hopperlm.checkpoint.layout import (
    ADAPTER_FILE,
    CONFIG_FILE,
    INDEX_FILE,
    MODEL_FILE,
    SHARDED_DIR,
    TOKENIZER_DIR,
    is_sharded,
    read_adapters,
    read_lora_config,
    read_model_config,
    resolve_model_dir,
    weight_files,
    write_model,
)
from hopperlm.checkpoint.sharded import materialize_model
from hopperlm.diskspace import staged_output
from hopperlm.files import fsync_tree, save_safetensors, tree_bytes
from hopperlm.interop.inference import TRAINED_WITH, trained_with


def export_model(path: str | Path, out_dir: Path, overwrite: bool = False) -> Path:
    """Copy the model part of a checkpoint (weights, config, tokenizer) to out_dir, atomically. config.json
    also keeps how the run trained (inference.py's TrainedWith), so `eval` of the copy repeats the run's
    context and validation windows."""
    model_dir, out_dir = resolve_model_dir(path), Path(out_dir)
    needed = sum(tree_bytes(model_dir / name) for name in _weight_file_names(model_dir)) + tree_bytes(
        model_dir / TOKENIZER_DIR
    )  # (a sharded checkpoint: its shards hold the optimizer state too, so this is generous)
    if is_sharded(model_dir):
        needed = tree_bytes(model_dir / SHARDED_DIR)
    with staged_output(out_dir, overwrite, what="the exported model", needed=needed) as tmp:
        if is_sharded(model_dir) and read_lora_config(model_dir) is not None:  # an FSDP LoRA run's adapters
            save_safetensors(read_adapters(model_dir), tmp / ADAPTER_FILE)
            shutil.copy2(model_dir / CONFIG_FILE, tmp / CONFIG_FILE)
        elif is_sharded(model_dir):  # gather the shards into one model.safetensors
            write_model(tmp, materialize_model(model_dir), read_model_config(model_dir), None)
        else:
            for name in (CONFIG_FILE, *_weight_file_names(model_dir)):
                shutil.copy2(model_dir / name, tmp / name)
        trained = trained_with(model_dir)
        if trained is not None:
            config = json.loads((tmp / CONFIG_FILE).read_text())
            (tmp / CONFIG_FILE).write_text(json.dumps({**config, TRAINED_WITH: trained.to_dict()}, indent=2))
        if (model_dir / TOKENIZER_DIR).is_dir():
            shutil.copytree(model_dir / TOKENIZER_DIR, tmp / TOKENIZER_DIR)
        fsync_tree(tmp)
    return out_dir


def _weight_file_names(model_dir: Path) -> list[str]:
    if (model_dir / ADAPTER_FILE).is_file():
        return [ADAPTER_FILE]
    if (model_dir / INDEX_FILE).is_file():
        return [INDEX_FILE, *(f.name for f in weight_files(model_dir))]
    return [MODEL_FILE]
