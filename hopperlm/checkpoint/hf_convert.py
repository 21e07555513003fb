"""Hugging Face interop, weights: import HF folders, export to them, and merge LoRA runs into model folders.

Tensors stream through one at a time (tensors.py reads them from any checkpoint under hopperlm's names) and
are written one output shard at a time, so a 7B/8B checkpoint converts with about one shard of memory beside
the source's page cache. Every output folder is staged beside its target and moved into place only when
complete (atomic.py). The config.json side is hf.py's.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from hopperlm.checkpoint.atomic import staged_dir
from hopperlm.checkpoint.hf import hf_config_dict, is_hf_dir, model_values_from_hf, read_json
from hopperlm.checkpoint.layout import (
    INDEX_FILE,
    MODEL_FILE,
    TOKENIZER_DIR,
    read_lora_config,
    read_model_config,
    resolve_model_dir,
    weight_files,
    write_model_config,
)
from hopperlm.checkpoint.tensors import iter_model_tensors, to_hf_name
from hopperlm.config import ModelConfig
from hopperlm.errors import CheckpointError, ConfigError

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
)
EXTRA_HF_FILES = ("generation_config.json",)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DEFAULT_SHARD = "5GB"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str) -> int:
    """'5GB', '200MB', '20KB', '1GiB' or a plain byte count -> bytes."""
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(f"--max-shard-size {text!r} is not a size; write e.g. 5GB or 500MB")
    return int(float(m[1]) * _UNITS[(m[2] or "B").lower()])


# ---- writing -----------------------------------------------------------------------------------------------
def write_shards(
    tensors: Iterator[tuple[str, torch.Tensor]],
    out_dir: Path,
    max_shard_bytes: int,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Write (name, tensor) pairs as safetensors shards of at most max_shard_bytes (one file when it all fits,
    else model-0000i-of-0000n + index), holding one shard in memory. Returns the file names."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    shard: dict[str, torch.Tensor] = {}
    size, total, files, weight_map = 0, 0, [], {}

    def flush() -> None:
        nonlocal shard, size
        if shard:
            name = f"part-{len(files):05d}.safetensors"
            save_file(shard, str(out_dir / name), metadata={"format": "pt"})
            files.append(name)
            weight_map.update(dict.fromkeys(shard, name))
        shard, size = {}, 0

    for name, tensor in tensors:
        tensor = tensor.to(dtype) if dtype is not None else tensor
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
        shard[name] = tensor.contiguous()
        size += nbytes
        total += nbytes
    flush()
    if len(files) == 1:
        (out_dir / files[0]).rename(out_dir / MODEL_FILE)
        return [MODEL_FILE]
    final = {f: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files)}
    for old, new in final.items():
        (out_dir / old).rename(out_dir / new)
    index = {"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in weight_map.items()}}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return list(final.values())


def output_dtype(dtype: str, model_dir: Path) -> torch.dtype:
    """--dtype: fp32/bf16/fp16, or auto = the dtype the checkpoint's weights are stored in."""
    if dtype == "auto":
        for _, tensor in iter_model_tensors(model_dir):
            if tensor.is_floating_point():
                return tensor.dtype
        return torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype} is unknown; use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def import_hf(hf_dir: Path, out_dir: Path, overwrite: bool = False, log=print) -> Path:
    """A Hugging Face folder -> a hopperlm model folder (renamed tensors in the source dtype and sharding,
    hopperlm config.json, tokenizer/). Streams one source shard at a time."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if not is_hf_dir(hf_dir):
        raise CheckpointError(f"{hf_dir} is not a Hugging Face model folder (no config.json with model_type)")
    values = model_values_from_hf(read_json(hf_dir / "config.json"), str(hf_dir / "config.json"), log)
    cfg = ModelConfig(**values)
    files = weight_files(hf_dir)
    with staged_dir(out_dir, overwrite) as tmp:
        shard_bytes = max(f.stat().st_size for f in files)
        write_shards(iter_model_tensors(hf_dir), tmp, shard_bytes)
        provenance = {
            "source": str(hf_dir.resolve()),
            "model_type": read_json(hf_dir / "config.json")["model_type"],
        }
        write_model_config(tmp, cfg, extra={"hf": provenance})
        tokenizer_files = [f for f in TOKENIZER_FILES if (hf_dir / f).is_file()]
        if tokenizer_files:
            (tmp / TOKENIZER_DIR).mkdir()
            for name in tokenizer_files:
                shutil.copy2(hf_dir / name, tmp / TOKENIZER_DIR / name)
        else:
            log(f"warning: {hf_dir} has no tokenizer files; generate/eval will need one")
    return out_dir


def export_hf(
    source: Path,
    out_dir: Path,
    dtype: str = "auto",
    max_shard_size: str = DEFAULT_SHARD,
    overwrite: bool = False,
    log=print,
) -> Path:
    """A hopperlm run / checkpoint / model folder (LoRA runs: merged on the way) -> a Hugging Face folder that
    transformers.AutoModelForCausalLM.from_pretrained loads: safetensors (sharded past max_shard_size),
    config.json, generation_config.json of the base when known, tokenizer files."""
    model_dir = resolve_model_dir(source)
    cfg = read_model_config(model_dir)
    out_dir = Path(out_dir)
    torch_dtype = output_dtype(dtype, model_dir)
    base_dir = Path(cfg.init_from) if cfg.init_from and is_hf_dir(Path(cfg.init_from)) else None
    base = read_json(base_dir / "config.json") if base_dir else None
    config = hf_config_dict(cfg, DTYPE_NAMES[torch_dtype], base)
    with staged_dir(out_dir, overwrite) as tmp:
        tensors = (
            (to_hf_name(name), t)
            for name, t in iter_model_tensors(model_dir)
            if not (cfg.tie_embeddings and name == "lm_head.weight")
        )
        write_shards(tensors, tmp, parse_size(max_shard_size), torch_dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in EXTRA_HF_FILES:
            if base_dir is not None and (base_dir / name).is_file():
                shutil.copy2(base_dir / name, tmp / name)
        tokenizer_dir = model_dir / TOKENIZER_DIR
        if tokenizer_dir.is_dir():  # HF tokenizer files, or hopperlm's byte marker (generate reads it)
            for f in tokenizer_dir.iterdir():
                if f.is_file():
                    shutil.copy2(f, tmp / f.name)
    return out_dir


def save_merged(
    source: Path,
    out_dir: Path,
    dtype: str = "auto",
    max_shard_size: str = DEFAULT_SHARD,
    overwrite: bool = False,
) -> Path:
    """A LoRA run/checkpoint -> a hopperlm model folder with the adapters folded into the base (`hopperlm
    merge`): generate, eval, export and model.init_from then use it as a plain model. Streams the base."""
    model_dir = resolve_model_dir(source)
    if read_lora_config(model_dir) is None:
        raise CheckpointError(
            f"{model_dir} has no LoRA adapters to merge; use it as it is (or hopperlm export)"
        )
    cfg = read_model_config(model_dir)
    torch_dtype = output_dtype(dtype, model_dir)
    with staged_dir(out_dir, overwrite) as tmp:
        write_shards(iter_model_tensors(model_dir), tmp, parse_size(max_shard_size), torch_dtype)
        write_model_config(tmp, cfg, extra={"merged_from": str(model_dir)})  # init_from: provenance
        if (model_dir / TOKENIZER_DIR).is_dir():
            shutil.copytree(model_dir / TOKENIZER_DIR, tmp / TOKENIZER_DIR)
    return Path(out_dir)
