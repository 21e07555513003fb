"""Run checkpoints in the single-file format: write one, load its weights and training state, export it.

A checkpoint (layout.py: RUN_DIR/checkpoints/step_N/) is written under a temporary name, checksummed, fsynced,
then renamed: a kill during saving leaves the previous checkpoint as the latest. One process writes it (rank 0
of a DDP run, which holds the whole state); the sharded format of FSDP runs is parallel/checkpoint.py's, and the
loaders here read the model of both. LoRA runs store their adapters only, beside a fingerprint of the base.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from hopperlm.checkpoint.atomic import save_safetensors
from hopperlm.checkpoint.layout import (
    ADAPTER_FILE,
    CHECKSUM_FILE,
    CONFIG_FILE,
    INDEX_FILE,
    MODEL_FILE,
    OPTIM_FILE,
    PREFIX,
    RNG_FILE,
    SHARDED_DIR,
    STATE_FILE,
    TOKENIZER_DIR,
    checkpoint_dir,
    checkpoint_step,
    is_sharded,
    latest_checkpoint,
    list_checkpoints,
    read_lora_config,
    read_model_config,
    read_state,
    resolve_model_dir,
    weight_files,
    write_model_config,
)
from hopperlm.checkpoint.sharded import load_sharded_model, materialize_model
from hopperlm.checkpoint.tensors import base_fingerprint, check_base, load_weights, read_adapters
from hopperlm.config import ModelConfig
from hopperlm.diskspace import DiskError, room, staged_output, write_failure
from hopperlm.errors import CheckpointError
from hopperlm.files import file_sha256, fsync_path, fsync_tree, swap_in, tree_bytes, usual_permissions
from hopperlm.model.lora import adapter_state, has_lora, load_adapter_state


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


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
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
    """Write the checkpoint of `step` in one process, then prune to the keep policy (a run's checkpoints are
    saved through parallel/checkpoint.py's Checkpointer, which calls this on rank 0). `state`: state.json
    without the step and RNGs, added here; `rank_rng`: every data-parallel rank's torch RNG states (rng.pt
    keeps them beside rank 0's)."""
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
        fsync_tree(tmp)
    except BaseException as e:  # never a partial copy left; every earlier checkpoint kept
        shutil.rmtree(tmp, ignore_errors=True)
        # disk full, quota, permissions (torch.save reports them as RuntimeErrors), a vanished folder
        why = write_failure(e) or (e.strerror if isinstance(e, OSError) else None)
        if why is None:
            raise
        raise save_failed(final, run_dir, why) from e
    try:
        publish_checkpoint(tmp, final, run_dir, keep_last, keep_every)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise save_failed(final, run_dir, write_failure(e) or e.strerror or str(e)) from e
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


def load_model_weights(model_dir: Path, model: torch.nn.Module) -> None:
    """The weights of any hopperlm model folder or checkpoint (one file, index shards, sharded, LoRA adapters)
    into a model built on its config."""
    lora = read_lora_config(model_dir) is not None
    if is_sharded(model_dir) and not lora:
        return load_sharded_model(model_dir, model)
    if lora or (model_dir / INDEX_FILE).is_file():
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
    """Resume: a LoRA checkpoint's adapters into the LoRA model (its base checked first), or the weights of a
    model folder sharded by an index."""
    if read_lora_config(model_dir) is not None:
        check_base(model_dir)
        load_adapter_state(model, read_adapters(model_dir), str(model_dir))
    else:
        load_weights(model, model_dir)


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


def export_model(path: str | Path, out_dir: Path, overwrite: bool = False) -> Path:
    """Copy the model part of a checkpoint (weights, config, tokenizer) to out_dir, atomically. config.json
    also keeps how the run trained (inference.py's TrainedWith), so `eval` of the copy repeats the run's
    context and validation windows."""
    from hopperlm.checkpoint.inference import TRAINED_WITH, trained_with

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
