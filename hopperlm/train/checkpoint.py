"""Checkpoints that are either complete or absent, and load without unpickling code.

Layout of RUN_DIR/checkpoints/step_000100/:
  model.safetensors  weights (tied tensors stored once)      config.json  model config (+ lora config)
  adapter.safetensors  instead of model.safetensors in a LoRA run: the adapters only (the base is
                     model.init_from, whose files are fingerprinted in config.json and checked on load)
  optimizer.pt       optimizer + loss-scaler state (tensors and plain data: loads with weights_only=True)
  rng.pt             torch CPU/CUDA RNG states                 state.json   step, tokens, clock, run config, RNGs
  tokenizer/         the tokenizer, so a checkpoint alone can generate and export
A checkpoint is written under a temporary name, fsynced, then renamed: a kill during saving leaves the previous
checkpoint as the latest. The model part (model.safetensors + config.json + tokenizer/) is also the export format.
The sharded format of FSDP runs (dist/checkpoint.py) has `sharded/` (torch.distributed.checkpoint: model,
optimizer and scaler state, one file per rank) in place of model.safetensors + optimizer.pt; the rest is alike,
and everything here that reads a checkpoint reads both.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import random
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from hopperlm.config import ModelConfig
from hopperlm.data.prepare import file_sha256
from hopperlm.errors import CheckpointError

PREFIX = "step_"
MODEL_FILE, CONFIG_FILE, STATE_FILE = "model.safetensors", "config.json", "state.json"
OPTIM_FILE, RNG_FILE, TOKENIZER_DIR = "optimizer.pt", "rng.pt", "tokenizer"
CHECKSUM_FILE = "checksums.json"  # written last: sha256 of every other file, checked before a resume
SHARDED_DIR = "sharded"  # the sharded format's torch.distributed.checkpoint directory
ADAPTER_FILE, INDEX_FILE = "adapter.safetensors", "model.safetensors.index.json"  # LoRA runs; sharded imports
FORMAT = "hopperlm-model-v1"


class CheckpointSaveError(CheckpointError):
    """A checkpoint could not be written (disk full, permissions); the previous ones are untouched."""


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


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_path(path)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's entries: a rename survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> tuple[dict[str, Any], dict[str, Any]]:
    """(JSON-able Python/NumPy states, tensor states for rng.pt)."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    plain = {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state_all()
    return plain, tensors


def set_rng_state(plain: dict[str, Any], tensors: dict[str, Any]) -> None:
    version, internal, gauss = plain["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = plain["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(tensors["cuda"])


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


def write_model(
    directory: Path, model: torch.nn.Module, cfg: ModelConfig, tokenizer_dir: Path | None
) -> None:
    """The model part of a checkpoint (also the export format). A LoRA model writes its adapters only."""
    from hopperlm.model.lora import adapter_state

    directory.mkdir(parents=True, exist_ok=True)
    adapters = adapter_state(model)
    if adapters is None:
        safetensors.torch.save_model(model, str(directory / MODEL_FILE))
        write_model_config(directory, cfg, tokenizer_dir)
    else:
        safetensors.torch.save_file(
            {k: v.contiguous() for k, v in adapters.items()}, str(directory / ADAPTER_FILE)
        )
        extra = {"lora": dataclasses.asdict(model.lora), "base": base_fingerprint(cfg.init_from)}
        write_model_config(directory, cfg, tokenizer_dir, extra)


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    model_cfg: ModelConfig,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    state: dict[str, Any],
    tokenizer_dir: Path | None,
    keep_last: int,
    keep_every: int = 0,
    rank_rng: list[dict[str, Any]] | None = None,
) -> Path:
    """`rank_rng`: every data-parallel rank's torch RNG states (rng.pt keeps them beside rank 0's)."""
    final = checkpoint_dir(run_dir, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f"{PREFIX}*.tmp-*"):  # left by a save that was killed
        shutil.rmtree(stale, ignore_errors=True)
    tmp = final.parent / f"{final.name}.tmp-{os.getpid()}"
    try:
        write_model(tmp, model, model_cfg, tokenizer_dir)
        torch.save(
            {"optimizer": optimizer.state_dict(), "scaler": scaler.state_dict() if scaler else None},
            tmp / OPTIM_FILE,
        )
        plain_rng, tensor_rng = rng_state()
        torch.save({**tensor_rng, "ranks": rank_rng} if rank_rng else tensor_rng, tmp / RNG_FILE)
        (tmp / STATE_FILE).write_text(json.dumps({**state, "step": step, "rng": plain_rng}, indent=1))
        checksums = {str(p.relative_to(tmp)): file_sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        (tmp / CHECKSUM_FILE).write_text(json.dumps(checksums, indent=1))
        _fsync_tree(tmp)
    except OSError as e:  # disk full, quota, permissions: drop the partial copy, keep every earlier one
        shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_checkpoint(run_dir)
        kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        raise CheckpointSaveError(
            f"could not write checkpoint {final.name} ({e.strerror or e}); {kept}"
        ) from e
    publish_checkpoint(tmp, final, run_dir, keep_last, keep_every)
    return final


def publish_checkpoint(tmp: Path, final: Path, run_dir: Path, keep_last: int, keep_every: int) -> None:
    """Rename a complete (checksummed, fsynced) temporary checkpoint into place, then drop old ones."""
    swap_in(tmp, final)  # the same step saved by an earlier attempt goes only once the new one is whole
    fsync_path(final.parent)
    removable = [
        c for c in list_checkpoints(run_dir)[:-keep_last] if not keep_every or checkpoint_step(c) % keep_every
    ]
    for old in removable:
        shutil.rmtree(old, ignore_errors=True)


def has_weights(path: Path) -> bool:
    """A hopperlm model folder: config.json beside weights (one file, shards, or LoRA adapters)."""
    if not any((path / f).is_file() for f in (MODEL_FILE, INDEX_FILE, ADAPTER_FILE)):
        return False
    try:
        return json.loads((path / CONFIG_FILE).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def base_fingerprint(init_from: str | None) -> dict[str, Any] | None:
    """Size and edge hashes of the base's weight files: a LoRA checkpoint is only valid on the same base."""
    if not init_from:
        return None
    from hopperlm.model.hf import is_hf_dir
    from hopperlm.model.hf_convert import weight_files

    base = Path(init_from)
    model_dir = base if is_hf_dir(base) else resolve_model_dir(base)
    files = [model_dir / ADAPTER_FILE] if (model_dir / ADAPTER_FILE).is_file() else weight_files(model_dir)
    return {"path": str(base), "files": {f.name: _edge_hash(f) for f in files}}


def _edge_hash(path: Path, span: int = 1 << 20) -> str:
    import hashlib

    h = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        h.update(f.read(span))
        f.seek(max(0, path.stat().st_size - span))
        h.update(f.read(span))
    return h.hexdigest()


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


def read_lora_config(model_dir: Path):
    """The LoRAConfig of an adapter checkpoint, or None for a full one."""
    from hopperlm.config import LoRAConfig

    raw = json.loads((Path(model_dir) / CONFIG_FILE).read_text())
    return LoRAConfig(**raw["lora"]) if raw.get("lora") else None


def swap_in(tmp: Path, final: Path) -> Path:
    """Move a complete folder into place; one already there is removed only once the new one is whole."""
    if final.exists():
        old = final.parent / f"{final.name}.old-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    return final


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


def read_model_config(model_dir: Path) -> ModelConfig:
    try:
        raw = json.loads((model_dir / CONFIG_FILE).read_text())
        return ModelConfig(**raw["model"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{model_dir / CONFIG_FILE} is not a hopperlm model config ({e})") from None


def load_model_weights(model_dir: Path, model: torch.nn.Module) -> None:
    if is_sharded(model_dir):
        from hopperlm.dist.checkpoint import load_sharded_model

        return load_sharded_model(model_dir, model)
    if (model_dir / ADAPTER_FILE).is_file() or (model_dir / INDEX_FILE).is_file():
        from hopperlm.train.model_setup import load_checkpoint_weights

        load_checkpoint_weights(model_dir, model)
        return
    try:
        missing, unexpected = safetensors.torch.load_model(model, str(model_dir / MODEL_FILE), strict=False)
    except (OSError, RuntimeError, safetensors.SafetensorError) as e:
        raise CheckpointError(f"cannot load {model_dir / MODEL_FILE}: {str(e).splitlines()[0]}") from None
    if missing or unexpected:
        raise CheckpointError(
            f"{model_dir / MODEL_FILE} does not match the model (missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}); the config's model section must equal the checkpoint's"
        )


def read_state(ckpt: Path) -> dict[str, Any]:
    """state.json of a checkpoint: step, tokens, clock, micro-batch, run config."""
    try:
        return json.loads((Path(ckpt) / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {ckpt} has no readable {STATE_FILE} ({e}); pick another") from None


def load_training_state(
    ckpt: Path, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None
) -> dict[str, Any]:
    """Restore optimizer, scaler and RNG states; return state.json (step, tokens, clock, ...)."""
    try:
        opt = torch.load(ckpt / OPTIM_FILE, map_location="cpu", weights_only=True)
        rng = torch.load(ckpt / RNG_FILE, map_location="cpu", weights_only=True)
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError) as e:
        # weights_only=True refuses any pickled code: a tampered file ends here, nothing of it runs
        raise CheckpointError(f"checkpoint {ckpt} is unreadable ({str(e).splitlines()[0]})") from None
    state = read_state(ckpt)
    try:
        optimizer.load_state_dict(opt["optimizer"])
    except (ValueError, KeyError) as e:
        raise CheckpointError(
            f"optimizer state in {ckpt} does not match this model/optimizer ({e})"
        ) from None
    if scaler is not None and opt.get("scaler"):
        scaler.load_state_dict(opt["scaler"])
    set_rng_state(state["rng"], rng)
    return state


def load_pretrained(path: str | Path, device: str = "auto"):
    """(model in eval mode, tokenizer) from a run dir, checkpoint dir, exported model dir or Hugging Face
    model folder (converted on the fly; LoRA checkpoints are merged into their base)."""
    from hopperlm.train.model_setup import load_for_inference

    return load_for_inference(path, device)


def export_model(path: str | Path, out_dir: Path, overwrite: bool = False) -> Path:
    """Copy the model part of a checkpoint (weights, config, tokenizer) to out_dir, atomically."""
    model_dir = resolve_model_dir(path)
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise CheckpointError(
            f"{out_dir} exists and is not empty; pass --overwrite or choose another directory"
        )
    tmp = out_dir.parent / f"{out_dir.name}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True)
    if is_sharded(model_dir):  # gather the shards into one model.safetensors
        from hopperlm.dist.checkpoint import materialize_model

        write_model(tmp, materialize_model(model_dir), read_model_config(model_dir), None)
    else:
        for name in (CONFIG_FILE, *_weight_file_names(model_dir)):
            shutil.copy2(model_dir / name, tmp / name)
    if (model_dir / TOKENIZER_DIR).is_dir():
        shutil.copytree(model_dir / TOKENIZER_DIR, tmp / TOKENIZER_DIR)
    _fsync_tree(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


def _weight_file_names(model_dir: Path) -> list[str]:
    if (model_dir / ADAPTER_FILE).is_file():
        return [ADAPTER_FILE]
    if (model_dir / INDEX_FILE).is_file():
        from hopperlm.model.hf_convert import weight_files

        return [INDEX_FILE, *(f.name for f in weight_files(model_dir))]
    return [MODEL_FILE]
