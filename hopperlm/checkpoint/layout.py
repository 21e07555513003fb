"""The files of run checkpoints and model folders: their names, which are complete, and reading them.

Layout of RUN_DIR/checkpoints/step_000100/:
  model.safetensors  weights (tied tensors stored once)      config.json  model config (+ lora config)
  adapter.safetensors  instead of model.safetensors in a LoRA run: the adapters only (the base is
                     model.init_from, whose files are fingerprinted in config.json and checked on load)
  optimizer.pt       optimizer + loss-scaler state (tensors and plain data: loads with weights_only=True)
  rng.pt             torch CPU/CUDA RNG states                 state.json   step, tokens, clock, run config, RNGs
  tokenizer/         the tokenizer, so a checkpoint alone can generate and export
  checksums.json     sha256 of every other file, written last: a checkpoint without it is incomplete
The model part (model.safetensors, or the shards of model.safetensors.index.json, + config.json + tokenizer/)
is also the format of exported model folders. The sharded format of FSDP runs (sharded.py) has `sharded/`
(torch.distributed.checkpoint: model, optimizer and scaler state) in place of model.safetensors + optimizer.pt;
the rest is alike, and everything here reads both. Writing them is single.py's and sharded.py's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from hopperlm.config import LoRAConfig, ModelConfig
from hopperlm.errors import CheckpointError, first_line
from hopperlm.files import file_sha256, save_safetensors, usual_permissions
from hopperlm.model.lora import adapter_state, has_lora

PREFIX = "step_"
MODEL_FILE, CONFIG_FILE, STATE_FILE = "model.safetensors", "config.json", "state.json"
OPTIM_FILE, RNG_FILE, TOKENIZER_DIR = "optimizer.pt", "rng.pt", "tokenizer"
CHECKSUM_FILE = "checksums.json"  # written last: sha256 of every other file, checked before a resume
SHARDED_DIR = "sharded"  # the sharded format's torch.distributed.checkpoint directory
ADAPTER_FILE, INDEX_FILE = "adapter.safetensors", "model.safetensors.index.json"  # LoRA runs; sharded weights
FORMAT = "hopperlm-model-v1"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"{PREFIX}{step:06d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary directories of interrupted saves are ignored)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit()
    ]
    complete = (p for p in found if (p / STATE_FILE).is_file() and (p / CHECKSUM_FILE).is_file())
    return sorted(complete, key=lambda p: int(p.name[len(PREFIX) :]))


def checkpoint_step(path: Path) -> int:
    return int(Path(path).name[len(PREFIX) :])


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def is_sharded(ckpt: Path) -> bool:
    return (Path(ckpt) / SHARDED_DIR / ".metadata").is_file()


def verify_checkpoint(ckpt: Path, part: tuple[int, int] = (0, 1)) -> str | None:
    """None when every file matches the checksums written with it, else what is wrong (one line).
    part=(i, n): check only every n-th file from the i-th (n ranks verify a sharded checkpoint together)."""
    try:
        expected = json.loads((ckpt / CHECKSUM_FILE).read_text())
    except (OSError, ValueError) as e:
        return f"{CHECKSUM_FILE} unreadable ({e})"
    for name, digest in sorted(expected.items())[part[0] :: part[1]]:
        path = ckpt / name
        if not path.is_file():
            return f"{name} is missing"
        if file_sha256(path) != digest:
            return f"{name} does not match its checksum (truncated or corrupted)"
    return None


def latest_valid_checkpoint(run_dir: Path, log=print) -> Path | None:
    """The newest checkpoint whose files verify; a corrupt one is skipped with a warning, never loaded."""
    for ckpt in reversed(list_checkpoints(run_dir)):
        problem = verify_checkpoint(ckpt)
        if problem is None:
            return ckpt
        log(f"warning: checkpoint {ckpt} is corrupt ({problem}); falling back to the one before it")
    return None


def has_weights(path: Path) -> bool:
    """A hopperlm model folder: config.json beside weights (one file, shards, or LoRA adapters)."""
    if not any((path / f).is_file() for f in (MODEL_FILE, INDEX_FILE, ADAPTER_FILE)):
        return False
    try:
        return json.loads((path / CONFIG_FILE).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def resolve_model_dir(path: str | Path) -> Path:
    """A run dir (its latest checkpoint), a checkpoint dir, or an exported model dir -> the dir with the weights."""
    path = Path(path)
    if has_weights(path) or (is_sharded(path) and (path / CONFIG_FILE).is_file()):
        return path
    if path.is_dir() and list_checkpoints(path):
        # the same rule as --resume: the newest checkpoint whose checksums verify
        latest = latest_valid_checkpoint(path, log=lambda line: print(line, file=sys.stderr))
        if latest is not None:
            return latest
        raise CheckpointError(f"every checkpoint in {path} is corrupt; nothing to load")
    if not path.exists():
        raise CheckpointError(
            f"{path} does not exist; pass a run dir, a checkpoint dir or an exported model dir"
        )
    raise CheckpointError(
        f"{path} holds no checkpoint (no {MODEL_FILE} + {CONFIG_FILE}, no checkpoints/step_*); train first"
    )


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a model folder (hopperlm's or Hugging Face's), in index order: one file, or
    the shards of an index."""
    directory = Path(directory)
    if (directory / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{directory / INDEX_FILE} is unreadable ({e})") from None
        files = [directory / f for f in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(
                f"{directory} lacks shard(s) {', '.join(missing[:3])} listed in {INDEX_FILE}"
            )
        return files
    if (directory / MODEL_FILE).is_file():
        return [directory / MODEL_FILE]
    if any(directory.glob("pytorch_model*.bin")):
        raise CheckpointError(
            f"{directory} holds pytorch_model.bin weights (pickles, which hopperlm does not load); convert them "
            "once with transformers: AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(OUT)"
        )
    raise CheckpointError(f"{directory} has no {MODEL_FILE} or {INDEX_FILE}")


def write_model_config(
    directory: Path, cfg: ModelConfig, tokenizer_dir: Path | None = None, extra: dict[str, Any] | None = None
) -> None:
    """config.json (the model section, plus `extra`) and tokenizer/ of a model directory."""
    cfg_dict = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    (directory / CONFIG_FILE).write_text(
        json.dumps({"format": FORMAT, "model": cfg_dict, **(extra or {})}, indent=2)
    )
    if tokenizer_dir is not None:
        shutil.copytree(tokenizer_dir, directory / TOKENIZER_DIR, dirs_exist_ok=True)


def read_model_config(model_dir: Path) -> ModelConfig:
    try:
        raw = json.loads((model_dir / CONFIG_FILE).read_text())
        return ModelConfig(**raw["model"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{model_dir / CONFIG_FILE} is not a hopperlm model config ({e})") from None


def read_lora_config(model_dir: Path) -> LoRAConfig | None:
    """The LoRAConfig of an adapter checkpoint, or None for a full one."""
    raw = json.loads((Path(model_dir) / CONFIG_FILE).read_text())
    return LoRAConfig(**raw["lora"]) if raw.get("lora") else None


def read_state(ckpt: Path) -> dict[str, Any]:
    """state.json of a checkpoint: step, tokens, clock, micro-batch, run config."""
    try:
        return json.loads((Path(ckpt) / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {ckpt} has no readable {STATE_FILE} ({e}); pick another") from None


def is_hf_dir(path: Path) -> bool:
    """A folder with a transformers config.json (not a hopperlm one)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "model_type" in data and data.get("format") != FORMAT


# ---- writing a model folder; a LoRA checkpoint's adapters and the base they belong to ----------------------
def read_adapters(model_dir: Path) -> dict[str, torch.Tensor]:
    """The adapters of a LoRA checkpoint by name, from adapter.safetensors (one process, DDP) or from the
    sharded format (FSDP), so merge and export read a run however many ranks trained it."""
    from safetensors.torch import load_file

    if (Path(model_dir) / ADAPTER_FILE).is_file():
        return load_file(str(Path(model_dir) / ADAPTER_FILE))
    if is_sharded(model_dir):
        return load_sharded_adapters(model_dir)
    raise CheckpointError(f"{model_dir} has a lora config but neither {ADAPTER_FILE} nor sharded adapters")


def base_fingerprint(init_from: str | None) -> dict[str, Any] | None:
    """Size and edge hashes of the base's weight files: a LoRA checkpoint is only valid on the same base."""
    if not init_from:
        return None
    base = Path(init_from)
    model_dir = base if is_hf_dir(base) else resolve_model_dir(base)
    files = [model_dir / ADAPTER_FILE] if (model_dir / ADAPTER_FILE).is_file() else weight_files(model_dir)
    return {"path": str(base), "files": {f.name: _edge_hash(f) for f in files}}


def _edge_hash(path: Path, span: int = 1 << 20) -> str:
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        h.update(f.read(span))
        f.seek(max(0, path.stat().st_size - span))
        h.update(f.read(span))
    return h.hexdigest()


def write_model(
    directory: Path, model: torch.nn.Module, cfg: ModelConfig, tokenizer_dir: Path | None
) -> None:
    """The model part of a checkpoint (also the export format). A LoRA model writes its adapters only."""
    directory.mkdir(parents=True, exist_ok=True)
    adapters = adapter_state(model)
    if adapters is None:
        safetensors.torch.save_model(model, str(directory / MODEL_FILE))  # tied tensors stored once
        usual_permissions(directory / MODEL_FILE)
        write_model_config(directory, cfg, tokenizer_dir)
    else:
        save_safetensors({k: v.contiguous() for k, v in adapters.items()}, directory / ADAPTER_FILE)
        write_model_config(directory, cfg, tokenizer_dir, lora_record(model, cfg))


def lora_record(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, Any] | None:
    """What config.json adds for a LoRA model (its lora section and the base's fingerprint); None otherwise."""
    if not has_lora(model):
        return None
    return {"lora": dataclasses.asdict(model.lora), "base": base_fingerprint(cfg.init_from)}


def check_base(model_dir: Path) -> None:
    """CheckpointError when a LoRA checkpoint's base files changed since it was written."""
    saved = json.loads((model_dir / CONFIG_FILE).read_text()).get("base")
    if not saved or not saved.get("files"):
        return
    now = base_fingerprint(saved["path"])
    if now is None or now["files"] != saved["files"]:
        raise CheckpointError(
            f"{model_dir} holds LoRA adapters trained on {saved['path']}, whose weight files have changed "
            "since; point model.init_from at the original base"
        )


# ---- the sharded format's adapters, read whole in one process (the format is sharded.py's) ----------------
@contextmanager
def single_process_ok() -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group: that is what we asked for."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


def load_sharded_adapters(model_dir: Path) -> dict[str, torch.Tensor]:
    """The LoRA adapters of a sharded checkpoint (an FSDP LoRA run saves the adapters alone), gathered whole in
    this process, by name (layers.0.attn.q_proj.lora_A.weight), in the dtype they were saved in."""
    import torch.distributed.checkpoint as dcp

    folder = Path(model_dir) / SHARDED_DIR
    try:
        stored = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        adapters = {
            key.removeprefix("model."): torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
            for key, meta in stored.items()
            if key.startswith("model.") and ".lora_" in key
        }
        with single_process_ok():
            dcp.load({"model": adapters}, checkpoint_id=folder, no_dist=True)
    except Exception as e:
        raise CheckpointError(f"cannot read the adapters of {folder} ({first_line(e)})") from None
    if not adapters:
        raise CheckpointError(f"{folder} holds no LoRA adapters although {model_dir} has a lora config")
    return adapters
