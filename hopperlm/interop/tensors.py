"""Reading weights: any checkpoint as a stream of tensors under hopperlm's names, and into a built model.

Nothing here holds a whole model twice: tensors are read one at a time from memory-mapped safetensors files
(`safe_open`) and copied into the parameters of a built model (or written out by hf_convert.py), so a 7B/8B
checkpoint loads with about one tensor of memory beside the source's page cache. Sources: a Hugging Face
folder, a hopperlm model folder (one file or shards), a sharded FSDP checkpoint (gathered whole), or a LoRA
checkpoint, whose base (model.init_from) is streamed with the adapters folded in; a LoRA checkpoint is only
valid on the base it was trained on, which its config.json fingerprints (`base_fingerprint`). A sharded
checkpoint is read whole in one process here, without a process group (its saving and resuming, where every
rank takes part, are checkpoint/sharded.py's).

Names: hopperlm's modules follow HF's Llama layout, so conversion is a renaming:
  embed.weight                       <-> model.embed_tokens.weight
  layers.N.attn_norm.weight          <-> model.layers.N.input_layernorm.weight
  layers.N.attn.{q,k,v,o}_proj.*     <-> model.layers.N.self_attn.{q,k,v,o}_proj.*
  layers.N.attn.{q,k}_norm.weight    <-> model.layers.N.self_attn.{q,k}_norm.weight (QK-norm: Qwen3)
  layers.N.mlp_norm.weight           <-> model.layers.N.post_attention_layernorm.weight
  layers.N.mlp.{gate,up,down}_proj.* <-> model.layers.N.mlp.{gate,up,down}_proj.* (ReLU²: up, down; Arcee)
  norm.weight / lm_head.weight       <-> model.norm.weight / lm_head.weight (absent when tied)
No permutation is needed: hopperlm's RoPE is HF's rotate-half.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from hopperlm.checkpoint.layout import (
    check_base,
    is_hf_dir,
    is_sharded,
    read_adapters,
    read_lora_config,
    read_model_config,
    resolve_model_dir,
    weight_files,
)
from hopperlm.checkpoint.sharded import materialize_model
from hopperlm.errors import CheckpointError
from hopperlm.model.lora import scale_of

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


# ---- reading -----------------------------------------------------------------------------------------------
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
    if is_hf_dir(path):
        for name, tensor in iter_file_tensors(weight_files(path)):
            ours = from_hf_name(name)
            if ours is not None:
                yield ours, tensor
        return
    model_dir = resolve_model_dir(path)
    if read_lora_config(model_dir) is not None:
        yield from merged_tensors(model_dir)
        return
    if is_sharded(model_dir):  # FSDP's torch.distributed.checkpoint shards, gathered in this process
        yield from materialize_model(model_dir).state_dict().items()
        return
    yield from iter_file_tensors(weight_files(model_dir))


def merged_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a LoRA checkpoint's model with its adapters folded in, streamed from its base
    (model.init_from) one tensor at a time: what `merge` and `export` write."""
    model_cfg, lora_cfg = read_model_config(model_dir), read_lora_config(model_dir)
    if lora_cfg is None or not model_cfg.init_from:
        raise CheckpointError(f"{model_dir} holds adapters without a lora config and a model.init_from base")
    check_base(model_dir)
    adapters = read_adapters(model_dir)
    scale = scale_of(lora_cfg)
    for name, tensor in iter_model_tensors(model_cfg.init_from):
        module = name.removesuffix(".weight")
        a = adapters.get(f"{module}.lora_A.weight")
        if a is not None:
            b = adapters[f"{module}.lora_B.weight"]
            tensor = (tensor.float() + (b.float() @ a.float()) * scale).to(tensor.dtype)
        yield name, tensor


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
