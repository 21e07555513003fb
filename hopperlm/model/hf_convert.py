"""Hugging Face interop, weights: stream tensors between HF safetensors folders and hopperlm, shard by shard.

Nothing here holds a whole model twice: tensors are read one at a time from memory-mapped safetensors files
(`safe_open`) and either copied into the parameters of a built model or written out, one output shard at a
time, so a 7B/8B checkpoint converts with about one shard of memory beside the source's page cache.

Names: hopperlm's modules follow HF's Llama layout, so conversion is a renaming:
  embed.weight                       <-> model.embed_tokens.weight
  layers.N.attn_norm.weight          <-> model.layers.N.input_layernorm.weight
  layers.N.attn.{q,k,v,o}_proj.*     <-> model.layers.N.self_attn.{q,k,v,o}_proj.*
  layers.N.mlp_norm.weight           <-> model.layers.N.post_attention_layernorm.weight
  layers.N.mlp.{gate,up,down}_proj.* <-> model.layers.N.mlp.{gate,up,down}_proj.*
  norm.weight / lm_head.weight       <-> model.norm.weight / lm_head.weight (absent when tied)
No permutation is needed: hopperlm's RoPE is HF's rotate-half.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from hopperlm.config import ModelConfig
from hopperlm.errors import CheckpointError, ConfigError
from hopperlm.model import hf

SAFETENSORS, INDEX = "model.safetensors", "model.safetensors.index.json"
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

_BLOCK = {
    "attn_norm": "input_layernorm",
    "mlp_norm": "post_attention_layernorm",
    "attn": "self_attn",
    "mlp": "mlp",
}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_TOP_BACK = {v: k for k, v in _TOP.items()}
_OURS = re.compile(r"^layers\.(\d+)\.(attn_norm|mlp_norm|attn|mlp)\.(.+)$")
_THEIRS = re.compile(
    r"^model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm|self_attn|mlp)\.(.+)$"
)
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")  # RoPE tables some old conversions saved; recomputed here


def to_hf_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    m = _OURS.match(name)
    if not m:
        raise KeyError(f"no Hugging Face name for hopperlm tensor {name!r}")
    return f"model.layers.{m[1]}.{_BLOCK[m[2]]}.{m[3]}"


def from_hf_name(name: str) -> str | None:
    """hopperlm's name for an HF tensor; None for tensors hopperlm recomputes (old RoPE buffers)."""
    if _IGNORED.search(name):
        return None
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    m = _THEIRS.match(name)
    if not m:
        raise CheckpointError(f"tensor {name!r} is not part of a Llama-family model; cannot convert it")
    return f"layers.{m[1]}.{_BLOCK_BACK[m[2]]}.{m[3]}"


def parse_size(text: str) -> int:
    """'5GB', '200MB', '20KB', '1GiB' or a plain byte count -> bytes."""
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(f"--max-shard-size {text!r} is not a size; write e.g. 5GB or 500MB")
    return int(float(m[1]) * _UNITS[(m[2] or "B").lower()])


# ---- reading -----------------------------------------------------------------------------------------------
def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a model folder, in index order (one file, or the shards of an index)."""
    directory = Path(directory)
    if (directory / INDEX).is_file():
        try:
            weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{directory / INDEX} is unreadable ({e})") from None
        files = [directory / f for f in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{directory} lacks shard(s) {', '.join(missing[:3])} listed in {INDEX}")
        return files
    if (directory / SAFETENSORS).is_file():
        return [directory / SAFETENSORS]
    if any(directory.glob("pytorch_model*.bin")):
        raise CheckpointError(
            f"{directory} holds pytorch_model.bin weights (pickles, which hopperlm does not load); convert them "
            "once with transformers: AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(OUT)"
        )
    raise CheckpointError(f"{directory} has no {SAFETENSORS} or {INDEX}")


def iter_file_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor, one file open at a time, one tensor materialised at a time."""
    from safetensors import SafetensorError, safe_open

    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(f"cannot read {path}: {e}") from None


def iter_model_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a checkpoint under hopperlm's names: a Hugging Face folder, a hopperlm model folder
    (one file or shards), a sharded FSDP checkpoint (gathered whole in memory), or a LoRA checkpoint (its base,
    with the adapters folded in on the way)."""
    path = Path(path)
    if hf.is_hf_dir(path):
        for name, tensor in iter_file_tensors(weight_files(path)):
            ours = from_hf_name(name)
            if ours is not None:
                yield ours, tensor
        return
    from hopperlm.train import checkpoint as ckpt_io

    model_dir = ckpt_io.resolve_model_dir(path)
    if (model_dir / ckpt_io.ADAPTER_FILE).is_file():
        from hopperlm.model.lora import merged_tensors

        yield from merged_tensors(model_dir)
        return
    if ckpt_io.is_sharded(model_dir):  # FSDP's torch.distributed.checkpoint shards, gathered in this process
        from hopperlm.dist.checkpoint import materialize_model

        yield from materialize_model(model_dir).state_dict().items()
        return
    yield from iter_file_tensors(weight_files(model_dir))


@torch.no_grad()
def load_weights(model: torch.nn.Module, source: str | Path, quantize: Callable | None = None) -> int:
    """Copy every tensor of `source` into `model` (built on the same shape, RoPE tables set). A source with
    fewer vocabulary rows fills the first rows of embed/lm_head and returns how many it had (the model's own
    count when the sizes match): the caller initialises the rest. `quantize(name, tensor)` may take a tensor
    instead (QLoRA's frozen matrices) and returns True when it did. Every parameter must be filled."""
    params = dict(model.named_parameters())
    tied = model.cfg.tie_embeddings
    filled: set[str] = set()
    base_rows = model.cfg.vocab_size
    for name, tensor in iter_model_tensors(source):
        if tied and name == "lm_head.weight":
            continue  # some tied checkpoints store it anyway: it is the embedding
        if quantize is not None and quantize(name, tensor):
            filled.add(name)
            continue
        target = params.get(name)
        if target is None:
            raise CheckpointError(
                f"{source} holds {name!r}, which the model does not have (another architecture?)"
            )
        if name in ("embed.weight", "lm_head.weight") and tensor.shape[0] < target.shape[0]:
            if tensor.shape[1:] != target.shape[1:]:
                raise CheckpointError(
                    f"{source}: {name} has shape {tuple(tensor.shape)}, the model {tuple(target.shape)}"
                )
            target[: tensor.shape[0]].copy_(tensor)
            base_rows = tensor.shape[0]
        elif tensor.shape != target.shape:
            raise CheckpointError(
                f"{source}: {name} has shape {tuple(tensor.shape)} but the model's is {tuple(target.shape)}; "
                "the model section must match the checkpoint"
            )
        else:
            target.copy_(tensor)
        filled.add(name)
    missing = sorted(set(params) - filled - getattr(model, "_quantized_names", set()))
    if missing:
        raise CheckpointError(f"{source} lacks {len(missing)} tensor(s) of the model, e.g. {missing[:3]}")
    return base_rows


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
        (out_dir / files[0]).rename(out_dir / SAFETENSORS)
        return [SAFETENSORS]
    final = {f: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files)}
    for old, new in final.items():
        (out_dir / old).rename(out_dir / new)
    index = {"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in weight_map.items()}}
    (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return list(final.values())


@contextmanager
def staged_dir(out_dir: Path, overwrite: bool) -> Iterator[Path]:
    """Build an output folder beside OUT_DIR and move it into place only when the block completes: a failure
    or Ctrl-C half-way leaves no partial folder and whatever OUT_DIR held before untouched."""
    from hopperlm.train.checkpoint import swap_in

    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise CheckpointError(
            f"{out_dir} exists and is not empty; pass --overwrite or choose another directory"
        )
    tmp = out_dir.parent / f"{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    swap_in(tmp, out_dir)


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
    from hopperlm.train import checkpoint as ckpt_io

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if not hf.is_hf_dir(hf_dir):
        raise CheckpointError(f"{hf_dir} is not a Hugging Face model folder (no config.json with model_type)")
    values = hf.model_values_from_hf(hf.read_json(hf_dir / "config.json"), str(hf_dir / "config.json"), log)
    cfg = ModelConfig(**values)
    files = weight_files(hf_dir)
    with staged_dir(out_dir, overwrite) as tmp:
        shard_bytes = max(f.stat().st_size for f in files)
        write_shards(iter_model_tensors(hf_dir), tmp, shard_bytes)
        provenance = {
            "source": str(hf_dir.resolve()),
            "model_type": hf.read_json(hf_dir / "config.json")["model_type"],
        }
        ckpt_io.write_model_config(tmp, cfg, extra={"hf": provenance})
        tokenizer_files = [f for f in TOKENIZER_FILES if (hf_dir / f).is_file()]
        if tokenizer_files:
            (tmp / ckpt_io.TOKENIZER_DIR).mkdir()
            for name in tokenizer_files:
                shutil.copy2(hf_dir / name, tmp / ckpt_io.TOKENIZER_DIR / name)
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
    from hopperlm.train import checkpoint as ckpt_io

    model_dir = ckpt_io.resolve_model_dir(source)
    cfg = ckpt_io.read_model_config(model_dir)
    out_dir = Path(out_dir)
    torch_dtype = output_dtype(dtype, model_dir)
    base_dir = Path(cfg.init_from) if cfg.init_from and hf.is_hf_dir(Path(cfg.init_from)) else None
    base = hf.read_json(base_dir / "config.json") if base_dir else None
    config = hf.hf_config_dict(cfg, DTYPE_NAMES[torch_dtype], base)
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
        tokenizer_dir = model_dir / ckpt_io.TOKENIZER_DIR
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
    from hopperlm.train import checkpoint as ckpt_io

    model_dir = ckpt_io.resolve_model_dir(source)
    if ckpt_io.read_lora_config(model_dir) is None:
        raise CheckpointError(
            f"{model_dir} has no LoRA adapters to merge; use it as it is (or hopperlm export)"
        )
    cfg = ckpt_io.read_model_config(model_dir)
    torch_dtype = output_dtype(dtype, model_dir)
    with staged_dir(out_dir, overwrite) as tmp:
        write_shards(iter_model_tensors(model_dir), tmp, parse_size(max_shard_size), torch_dtype)
        ckpt_io.write_model_config(tmp, cfg, extra={"merged_from": str(model_dir)})  # init_from: provenance
        if (model_dir / ckpt_io.TOKENIZER_DIR).is_dir():
            shutil.copytree(model_dir / ckpt_io.TOKENIZER_DIR, tmp / ckpt_io.TOKENIZER_DIR)
    return Path(out_dir)
