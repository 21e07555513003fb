"""The sharded checkpoint format, read in one process: a torch.distributed.checkpoint (DCP) folder `sharded/`
holding the model (and optimizer) state of an FSDP run, one file per rank.

Here the model alone is loaded whole, without a process group, for generate, export and conversion; saving
and resuming a sharded run, where every rank takes part, is parallel/checkpoint.py's (with the helpers below).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn as nn

from hopperlm.checkpoint.layout import SHARDED_DIR, read_model_config
from hopperlm.errors import CheckpointError, first_line
from hopperlm.model.transformer import build_empty


@contextmanager
def single_process_ok() -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group: that is what we asked for."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


def load_sharded_model(model_dir: Path, model: nn.Module) -> None:
    """The weights of a sharded checkpoint into a whole (unsharded) model, in this process alone."""
    import torch.distributed.checkpoint as dcp

    weights = model.state_dict()
    try:
        with single_process_ok():
            dcp.load({"model": weights}, checkpoint_id=Path(model_dir) / SHARDED_DIR, no_dist=True)
    except Exception as e:
        raise CheckpointError(
            f"cannot load {Path(model_dir) / SHARDED_DIR} into this model ({first_line(e)}); the config's "
            "model section must equal the checkpoint's"
        ) from None
    model.load_state_dict(weights)


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


def materialize_model(model_dir: Path) -> nn.Module:
    """A sharded checkpoint's model on the CPU, without spending time on a random initialisation first."""
    model = build_empty(read_model_config(model_dir), "cpu")
    load_sharded_model(model_dir, model)
    return model.eval()
