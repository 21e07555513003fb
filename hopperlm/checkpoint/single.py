"""Run checkpoints in the single-file format: write one, load its weights and training state.

A checkpoint (layout.py: RUN_DIR/checkpoints/step_N/) is written under a temporary name, checksummed, fsynced,
then renamed: a kill during saving leaves the previous checkpoint as the latest. One process writes it (rank 0
of a DDP run, which holds the whole state; checkpointer.py has the others wait); the sharded format of FSDP
runs is sharded.py's, and the loaders here read the model of both. LoRA runs store their adapters only, beside
a fingerprint of the base. `Parts` names what a checkpoint holds beside state.json, in either format.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from hopperlm.checkpoint.layout import (
    CHECKSUM_FILE,
    MODEL_FILE,
    OPTIM_FILE,
    PREFIX,
    RNG_FILE,
    STATE_FILE,
    check_base,
    checkpoint_dir,
    checkpoint_step,
    latest_checkpoint,
    list_checkpoints,
    read_adapters,
    read_lora_config,
    read_state,
    write_model,
)
from hopperlm.config import ModelConfig
from hopperlm.diskspace import DiskError, room, write_failure
from hopperlm.errors import CheckpointError
from hopperlm.files import (
    file_sha256,
    fsync_path,
    fsync_tree,
    swap_in,
    tree_bytes,
)
from hopperlm.model.lora import load_adapter_state


@dataclass
class Parts:
    """What a checkpoint holds beside state.json. `model`: the unwrapped model (not the DDP wrapper; FSDP
    shards it in place), whose weights are saved and loaded; `optimizer`: the run's (train/optim.py's
    OptimizerPair saves both of its own); `tokenizer_dir`: copied into every checkpoint."""

    model: torch.nn.Module
    model_cfg: ModelConfig
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    tokenizer_dir: Path | None


class CheckpointSaveError(CheckpointError, DiskError):
    """A checkpoint could not be written (disk full, quota, permissions); the previous ones are untouched.
    `latest`: the newest complete checkpoint (None: there is none); `needed`: about how many bytes one takes."""

    def __init__(self, message: str, *, latest: Path | None = None, needed: int | None = None) -> None:
        super().__init__(message)
        self.latest, self.needed = latest, needed


def save_failed(final: Path, run_dir: Path, why: str) -> CheckpointSaveError:
    """The one line for a checkpoint that could not be written (its partial copy already removed): where,
    why, the room there, and the checkpoint that stands instead. Single and sharded saves say it alike."""
    previous = latest_checkpoint(run_dir)
    needed = tree_bytes(previous) if previous is not None else None
    kept = (
        f"the previous checkpoint {previous.name} is intact" if previous else "no earlier checkpoint exists"
    )
    return CheckpointSaveError(
        f"could not write checkpoint {final.name} in {final.parent} ({why}: {room(final.parent, needed)}); "
        f"{kept}",
        latest=previous,
        needed=needed,
    )


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


def save_checkpoint(
    run_dir: Path,
    step: int,
    parts: Parts,
    state: dict[str, Any],
    *,
    keep: tuple[int, int],
    rank_rng: list[dict[str, Any]] | None = None,
) -> Path:
    """Write the checkpoint of `step` in one process, then prune to the keep policy `keep` (keep_last,
    keep_every): checkpointer.py's Checkpointer calls this on rank 0. `state`: state.json without the step
    and RNGs, added here; `rank_rng`: every data-parallel rank's torch RNG states (rng.pt keeps them beside
    rank 0's)."""
    model, model_cfg, optimizer, scaler = parts.model, parts.model_cfg, parts.optimizer, parts.scaler
    final = checkpoint_dir(run_dir, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f"{PREFIX}*.tmp-*"):  # left by a save that was killed
        shutil.rmtree(stale, ignore_errors=True)
    tmp = final.parent / f"{final.name}.tmp-{os.getpid()}"
    try:
        write_model(tmp, model, model_cfg, parts.tokenizer_dir)
        torch.save(
            {"optimizer": optimizer.state_dict(), "scaler": scaler.state_dict() if scaler else None},
            tmp / OPTIM_FILE,
        )
        plain_rng, tensor_rng = rng_state()
        torch.save({**tensor_rng, "ranks": rank_rng} if rank_rng else tensor_rng, tmp / RNG_FILE)
        (tmp / STATE_FILE).write_text(json.dumps({**state, "step": step, "rng": plain_rng}, indent=1))
        checksums = {str(p.relative_to(tmp)): file_sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        (tmp / CHECKSUM_FILE).write_text(json.dumps(checksums, indent=1))
        fsync_tree(tmp)
    except BaseException as e:  # never a partial copy left; every earlier checkpoint kept
        shutil.rmtree(tmp, ignore_errors=True)
        # disk full, quota, permissions (torch.save reports them as RuntimeErrors), a vanished folder
        why = write_failure(e) or (e.strerror if isinstance(e, OSError) else None)
        if why is None:
            raise
        raise save_failed(final, run_dir, why) from e
    try:
        publish_checkpoint(tmp, final, run_dir, keep)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise save_failed(final, run_dir, write_failure(e) or e.strerror or str(e)) from e
    return final


def publish_checkpoint(tmp: Path, final: Path, run_dir: Path, keep: tuple[int, int]) -> None:
    """Rename a complete (checksummed, fsynced) temporary checkpoint into place, then drop old ones: all but
    the newest keep_last, except the steps that are multiples of keep_every (`keep`)."""
    keep_last, keep_every = keep
    swap_in(tmp, final)  # the same step saved by an earlier attempt goes only once the new one is whole
    fsync_path(final.parent)
    removable = [
        c for c in list_checkpoints(run_dir)[:-keep_last] if not keep_every or checkpoint_step(c) % keep_every
    ]
    for old in removable:
        shutil.rmtree(old, ignore_errors=True)


def load_model_weights(model_dir: Path, model: torch.nn.Module) -> None:
    """The weights of a single-format checkpoint or model folder (one file, index shards, LoRA adapters) into
    a model built on its config (a sharded checkpoint is sharded.py's)."""
    if read_lora_config(model_dir) is not None:
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


def load_checkpoint_weights(model_dir: Path, model: torch.nn.Module) -> None:
    """Resume: a LoRA checkpoint's adapters into the LoRA model, its base checked first. (A checkpoint never
    holds index-sharded weights: those are exported folders, which have no state.json to resume from.)"""
    check_base(model_dir)
    load_adapter_state(model, read_adapters(model_dir), str(model_dir))


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
