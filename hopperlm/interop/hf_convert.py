"""Hugging Face interop, weights: import HF folders, export to them, and merge LoRA runs into model folders.

Tensors stream through one at a time (tensors.py reads them from any checkpoint under hopperlm's names) and
are written one output shard at a time, so a 7B/8B checkpoint converts with about one shard of memory beside
the source's page cache. Every output folder is staged beside its target and moved into place only when
complete (atomic.py). The config.json side is hf.py's, the tokenizer files hf_tokenizer.py's.

What a Hugging Face folder carries beyond weights and shapes (its family, token ids, generation_config.json)
goes into an imported folder's config.json ("hf") and comes back out on export, also for runs started from it.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from hopperlm.checkpoint.layout import (
    CONFIG_FILE,
    INDEX_FILE,
    MODEL_FILE,
    TOKENIZER_DIR,
    read_lora_config,
    read_model_config,
    resolve_model_dir,
    weight_files,
    write_model_config,
)
from hopperlm.config import ModelConfig
from hopperlm.data.tokenizer import BYTE_MARKER, TOKENIZER_FILES
from hopperlm.diskspace import staged_output
from hopperlm.errors import CheckpointError, ConfigError
from hopperlm.files import save_safetensors
from hopperlm.interop.hf import (
    hf_config_dict,
    is_hf_dir,
    model_values_from_hf,
    read_json,
    with_token_ids,
)
from hopperlm.interop.hf_tokenizer import token_ids, write_hf_tokenizer
from hopperlm.interop.tensors import iter_model_tensors, to_hf_name
from hopperlm.model.completep import residual_multiplier
from hopperlm.model.generate import SAMPLING_DEFAULTS, generation_defaults, sampling_generation_config
from hopperlm.model.mup import output_multiplier
from hopperlm.model.transformer import count_params

GENERATION_FILE = "generation_config.json"
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
    out_dir = Path(out_dir)
    shard: dict[str, torch.Tensor] = {}
    size, total, files, weight_map = 0, 0, [], {}

    def flush() -> None:
        nonlocal shard, size
        if shard:
            name = f"part-{len(files):05d}.safetensors"
            save_safetensors(shard, out_dir / name, metadata={"format": "pt"})
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
    hopperlm config.json with the source's config.json and generation_config.json under "hf", tokenizer/).
    A folder hopperlm exported with its byte tokenizer gets that tokenizer back (its marker), not the
    tokenizer.json written for transformers. Streams one source shard at a time."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if not is_hf_dir(hf_dir):
        raise CheckpointError(f"{hf_dir} is not a Hugging Face model folder (no config.json with model_type)")
    raw = read_json(hf_dir / "config.json")
    values = model_values_from_hf(raw, str(hf_dir / "config.json"), log)
    cfg = ModelConfig(**values)
    files = weight_files(hf_dir)
    needed = sum(f.stat().st_size for f in files)  # the tensors keep their dtype
    with staged_output(out_dir, overwrite, what="the imported model", needed=needed) as tmp:
        shard_bytes = max(f.stat().st_size for f in files)
        write_shards(iter_model_tensors(hf_dir), tmp, shard_bytes)
        origin = {"source": str(hf_dir.resolve()), "model_type": raw["model_type"], "config": raw}
        if (hf_dir / GENERATION_FILE).is_file():
            origin["generation_config"] = read_json(hf_dir / GENERATION_FILE)
        write_model_config(tmp, cfg, extra={"hf": origin})
        if (hf_dir / BYTE_MARKER).is_file():
            tokenizer_files = [BYTE_MARKER]
        else:
            tokenizer_files = [f for f in TOKENIZER_FILES if (hf_dir / f).is_file()]
        if tokenizer_files:
            (tmp / TOKENIZER_DIR).mkdir()
            for name in tokenizer_files:
                shutil.copy2(hf_dir / name, tmp / TOKENIZER_DIR / name)
        else:
            log(f"warning: {hf_dir} has no tokenizer files; generate/eval will need one")
    return out_dir


def hf_origin(model_dir: Path, cfg: ModelConfig) -> tuple[dict | None, dict | None]:
    """(config.json, generation_config.json) of the Hugging Face model a hopperlm model came from, if any: the
    folder's own import record, else its model.init_from (a Hugging Face folder, or an imported one)."""
    sources = [Path(model_dir)]
    if cfg.init_from:
        sources.append(Path(cfg.init_from))
    for source in sources:
        if is_hf_dir(source):
            gen = source / GENERATION_FILE
            return read_json(source / "config.json"), read_json(gen) if gen.is_file() else None
        try:
            own = json.loads((resolve_model_dir(source) / CONFIG_FILE).read_text()).get("hf") or {}
        except (CheckpointError, OSError, ValueError):
            continue
        if own.get("config"):
            return own["config"], own.get("generation_config")
    return None, None


def export_hf(
    source: Path,
    out_dir: Path,
    dtype: str = "auto",
    max_shard_size: str = DEFAULT_SHARD,
    overwrite: bool = False,
    log=print,
) -> Path:
    """A hopperlm run / checkpoint / model folder (LoRA runs: merged on the way) -> a Hugging Face folder that
    transformers.AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained load: safetensors
    (sharded past max_shard_size), config.json and generation_config.json (the Hugging Face base's, else the
    tokenizer's BOS/EOS ids), the tokenizer files (hf_tokenizer.py). `hf_files(out_dir)` names them."""
    model_dir = resolve_model_dir(source)
    cfg = read_model_config(model_dir)
    out_dir = Path(out_dir)
    torch_dtype = output_dtype(dtype, model_dir)
    base, generation = hf_origin(model_dir, cfg)
    ids = token_ids(model_dir / TOKENIZER_DIR)
    config = with_token_ids(hf_config_dict(cfg, DTYPE_NAMES[torch_dtype], base), ids)
    if (
        generation is None and ids
    ):  # a hopperlm-trained model: transformers samples as `hopperlm generate` does
        generation = {
            **ids,
            "pad_token_id": config.get("pad_token_id", ids["eos_token_id"]),
            **sampling_generation_config(),
        }
    needed = count_params(cfg)["total"] * torch_dtype.itemsize
    with staged_output(out_dir, overwrite, what="the exported model", needed=needed) as tmp:
        tensors = (
            (to_hf_name(name), fold_output_multiplier(name, t, cfg))
            for name, t in iter_model_tensors(model_dir)
            if not (cfg.tie_embeddings and name == "lm_head.weight")
        )
        write_shards(tensors, tmp, parse_size(max_shard_size), torch_dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if generation is not None:
            (tmp / GENERATION_FILE).write_text(json.dumps(generation, indent=2) + "\n")
        write_hf_tokenizer(model_dir / TOKENIZER_DIR, tmp, cfg.max_seq_len)
    return out_dir


def fold_output_multiplier(name: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The multipliers hopperlm puts on layers' outputs, folded into those layers' weights (`name`: hopperlm's):
    μP multiplies the LM head's output by base_dim / dim (model/mup.py), CompleteP each block's attention and
    MLP output by base_dim / n_layers (model/completep.py), and those outputs are o_proj's and down_proj's (no
    bias). A Hugging Face or GGUF model has no such multipliers, so the weights carry them instead: the exported
    model computes the same logits. Every export to another format (HF, GGUF) goes through here."""
    if name == "lm_head.weight" and cfg.parametrization == "mup":
        return t * output_multiplier(cfg)
    if name.endswith(("attn.o_proj.weight", "mlp.down_proj.weight")) and residual_multiplier(cfg) != 1.0:
        return t * residual_multiplier(cfg)
    return t


def hf_files(out_dir: Path) -> str:
    """What an exported Hugging Face folder holds, for the export's message: weights, configs, tokenizer."""
    names = sorted(p.name for p in Path(out_dir).iterdir() if p.is_file())
    weights = [n for n in names if n.endswith(".safetensors")]
    tokenizer = [
        n for n in names if n not in weights and n not in ("config.json", GENERATION_FILE, INDEX_FILE)
    ]
    parts = [weights[0] if len(weights) == 1 else f"{len(weights)} weight shards + {INDEX_FILE}"]
    parts += [n for n in ("config.json", GENERATION_FILE) if n in names]
    parts.append("tokenizer: " + (", ".join(tokenizer) if tokenizer else "none (the checkpoint had none)"))
    if BYTE_MARKER in tokenizer:
        parts[-1] += (
            f" (tokenizer.json: the byte tokenizer as transformers loads it; {BYTE_MARKER}: what import keeps)"
        )
    return "; ".join(parts)


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
    from hopperlm.interop.inference import TRAINED_WITH, trained_with

    cfg = read_model_config(model_dir)
    torch_dtype = output_dtype(dtype, model_dir)
    trained = trained_with(model_dir)
    extra = {"merged_from": str(model_dir), **({TRAINED_WITH: trained.to_dict()} if trained else {})}
    needed = count_params(cfg)["total"] * torch_dtype.itemsize
    with staged_output(out_dir, overwrite, what="the merged model", needed=needed) as tmp:
        write_shards(iter_model_tensors(model_dir), tmp, parse_size(max_shard_size), torch_dtype)
        write_model_config(tmp, cfg, extra=extra)  # init_from: provenance
        if (model_dir / TOKENIZER_DIR).is_dir():
            shutil.copytree(model_dir / TOKENIZER_DIR, tmp / TOKENIZER_DIR)
    return Path(out_dir)


def sampling_defaults(source: Path) -> dict:
    """What `hopperlm generate` samples `source` with when no flag is given (and what an Ollama Modelfile of it
    says): the generation_config.json of the Hugging Face model behind it (its folder; an import or export of
    it; a run fine-tuned from either), else hopperlm's defaults. Keys: SAMPLING_DEFAULTS's, max_new_tokens
    (None: the model's config sets none) and eos_ids (None: the tokenizer's)."""
    if is_hf_dir(source):
        found = source / "generation_config.json"
        config = read_json(found) if found.is_file() else None
    else:
        _, config = hf_origin(source, read_model_config(source))
    settings = {**SAMPLING_DEFAULTS, "max_new_tokens": None, "eos_ids": None}
    if config is None:
        return settings
    try:
        d = generation_defaults(config)
    except (ValueError, TypeError, AttributeError) as e:
        raise ConfigError(f"the generation_config.json of {source} is not valid ({e}); fix it") from None
    settings.update(temperature=d.temperature, top_k=d.top_k, top_p=d.top_p, eos_ids=d.eos_ids)
    settings.update(repetition_penalty=d.repetition_penalty, max_new_tokens=d.max_new_tokens)
    return settings
