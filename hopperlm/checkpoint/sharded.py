"""The sharded checkpoint format: a torch.distributed.checkpoint (DCP) folder `sharded/` holding the model and
optimizer state of an FSDP run, each rank writing its own shards, beside the same config.json, tokenizer/,
state.json, rng.pt and checksums.json as the single format (layout.py).

The single format's guarantees hold here: files are written under a temporary name; every rank hashes and
fsyncs a share of them; rank 0 writes checksums.json last and renames the directory; a failure on any rank
leaves the previous checkpoints as they were and raises the same CheckpointSaveError on every rank. A save may
run in the background (`checkpoint.async_save`: the state is copied to CPU memory and written while training
goes on; `save_sharded` then returns the pending write, which `complete_sharded` finishes). Either format loads
at any world size and under any strategy: DCP reshards by parameter name, and a single-file checkpoint is cut
into shards on load (`load_single_into_shards`). The run directory must be on a filesystem every node sees.

The model alone, read whole in one process (generate, export), is interop/tensors.py's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from hopperlm.checkpoint.layout import (
    CHECKSUM_FILE,
    MODEL_FILE,
    OPTIM_FILE,
    PREFIX,
    RNG_FILE,
    SHARDED_DIR,
    STATE_FILE,
    check_base,
    checkpoint_dir,
    lora_record,
    read_adapters,
    read_model_config,
    read_state,
    single_process_ok,
    write_model_config,
)
from hopperlm.checkpoint.single import (
    Parts,
    publish_checkpoint,
    rng_state,
    save_failed,
    set_rng_state,
)
from hopperlm.diskspace import write_failure
from hopperlm.errors import CheckpointError, first_line
from hopperlm.files import file_sha256, fsync_path
from hopperlm.model.lora import has_lora
from hopperlm.model.transformer import build_empty
from hopperlm.parallel.runtime import Runtime


def optimizers_of(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind the run's: both of a pair (train/optim.py's OptimizerPair holds them in
    `optimizers`), else the optimizer itself."""
    return list(getattr(optimizer, "optimizers", (optimizer,)))


def state_dict_options(model: nn.Module, **options):
    """A LoRA run's checkpoints hold the adapters alone (and their optimizer state): the frozen base is
    model.init_from's, never written, and loading leaves it as it is."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    lora = has_lora(model)
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora, **options)


# ---- saving (every rank) -----------------------------------------------------------------------------------
class Pending:
    """A background save under way: DCP's future, its temporary folder and the folder it becomes."""

    def __init__(self, future, tmp: Path, final: Path) -> None:
        self.future, self.tmp, self.final = future, tmp, final


def save_sharded(
    rt: Runtime,
    run_dir: Path,
    step: int,
    parts: Parts,
    record: dict[str, Any],
    *,
    keep: tuple[int, int],
    rank_rng: list | None,
    background: bool = False,
    group=None,
) -> Path | Pending:
    """The checkpoint of `step`, every rank writing its shards: the small files first (rank 0), then the
    shards, then checksums.json (complete_sharded). `background`: an async save, which returns the Pending
    write, its collectives over `group` (None: the default group); else saved before returning."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = checkpoint_dir(run_dir, step)
    tmp = final.parent / f"{final.name}.tmp-sharded"
    error = None
    if rt.is_main:  # the small files first; the shards and then checksums.json complete the directory
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            for stale in final.parent.glob(f"{PREFIX}*.tmp-*"):  # left by a save that was killed
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
            write_model_config(
                tmp, parts.model_cfg, parts.tokenizer_dir, lora_record(parts.model, parts.model_cfg)
            )
            plain_rng, tensor_rng = rng_state()
            torch.save({**tensor_rng, "ranks": rank_rng} if rank_rng else tensor_rng, tmp / RNG_FILE)
            scaler = parts.scaler.state_dict() if parts.scaler is not None else None
            record = {**record, "step": step, "rng": plain_rng, "scaler": scaler, "format": "sharded"}
            (tmp / STATE_FILE).write_text(json.dumps(record, indent=1))
        except (OSError, RuntimeError) as e:  # (torch.save reports a full disk as a RuntimeError)
            error = write_failure(e) or first_line(e)
            if not isinstance(e, OSError) and write_failure(e) is None:
                raise
    _raise_if_any(rt, rt.broadcast_object(error), tmp, run_dir, final)
    model_sd, optim_sd = get_state_dict(
        parts.model, optimizers_of(parts.optimizer), options=state_dict_options(parts.model)
    )
    content = {"model": model_sd, "optim": optim_sd}
    alone = {} if rt.active else {"no_dist": True}  # (passed only when needed: older torch lacks it)
    try:
        if background:
            with single_process_ok():
                future = dcp.async_save(
                    content, checkpoint_id=tmp / SHARDED_DIR, process_group=group, **alone
                )
            return Pending(future, tmp, final)
        with single_process_ok():
            dcp.save(content, checkpoint_id=tmp / SHARDED_DIR, **alone)
    except BaseException as e:  # DCP raises on every rank when any rank's write failed
        if isinstance(e, KeyboardInterrupt | SystemExit):  # (its CheckpointException is a BaseException)
            raise
        _raise_if_any(rt, write_failure(e) or first_line(e), tmp, run_dir, final)
    return complete_sharded(rt, run_dir, tmp, final, keep)


def finish_pending(rt: Runtime, run_dir: Path, pending: Pending, keep: tuple[int, int]) -> Path:
    """Wait for a background save's files, then complete it (complete_sharded); every rank calls it."""
    try:
        pending.future.result()
    except BaseException as e:  # the background write failed (a full disk): reported at this save point
        # (DCP's CheckpointException is a BaseException: only an interrupt or an exit passes through)
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        _raise_if_any(rt, write_failure(e) or first_line(e), pending.tmp, run_dir, pending.final)
    return complete_sharded(rt, run_dir, pending.tmp, pending.final, keep)


def complete_sharded(rt: Runtime, run_dir: Path, tmp: Path, final: Path, keep: tuple[int, int]) -> Path:
    """Every rank hashes and fsyncs its share of the files; rank 0 writes checksums.json and renames."""
    names = None
    if rt.is_main:
        names = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    names = rt.broadcast_object(names)
    digests, error = {}, None
    try:
        for name in names[rt.rank :: rt.world_size]:
            digests[name] = file_sha256(tmp / name)
            fsync_path(tmp / name)
    except OSError as e:  # e.g. a node that does not see the run dir
        error = f"rank {rt.rank}: {write_failure(e) or e.strerror or e} ({e.filename})"
    gathered = rt.all_gather_object((digests, error))
    error = next((e for _, e in gathered if e), None)
    if rt.is_main and error is None:
        try:
            checksums = dict(sorted((k, v) for d, _ in gathered for k, v in d.items()))
            (tmp / CHECKSUM_FILE).write_text(json.dumps(checksums, indent=1))
            fsync_path(tmp / CHECKSUM_FILE)
            for directory in sorted({(tmp / n).parent for n in names} | {tmp}):
                fsync_path(directory)
            publish_checkpoint(tmp, final, run_dir, keep)
        except OSError as e:
            error = write_failure(e) or e.strerror or str(e)
    _raise_if_any(rt, rt.broadcast_object(error), tmp, run_dir, final)
    return final


def _raise_if_any(rt: Runtime, error: str | None, tmp: Path, run_dir: Path, final: Path) -> None:
    if error is None:
        return
    if rt.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    raise save_failed(final, run_dir, error)


# ---- loading into a run (every rank) -----------------------------------------------------------------------
def load_sharded(rt: Runtime, ckpt: Path, parts: Parts) -> dict[str, Any]:
    """A sharded checkpoint into this run's (possibly sharded) model and optimizer, its scaler and RNGs;
    returns state.json."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizers = parts.model, optimizers_of(parts.optimizer)
    options = state_dict_options(model)
    model_sd, optim_sd = get_state_dict(model, optimizers, options=options)
    content = {"model": model_sd, "optim": optim_sd}
    try:
        with single_process_ok():
            dcp.load(content, checkpoint_id=ckpt / SHARDED_DIR, **({} if rt.active else {"no_dist": True}))
    except Exception as e:
        raise CheckpointError(
            f"cannot load {ckpt / SHARDED_DIR} into this model/optimizer ({first_line(e)}); resume with "
            "the run's own config"
        ) from None
    set_state_dict(
        model,
        optimizers,
        model_state_dict=content["model"],
        optim_state_dict=content["optim"],
        options=options,
    )
    state = read_state(ckpt)
    if parts.scaler is not None and state.get("scaler"):
        parts.scaler.load_state_dict(state["scaler"])
    set_rng_state(state["rng"], torch.load(ckpt / RNG_FILE, map_location="cpu", weights_only=True))
    return state


def load_single_into_shards(ckpt: Path, parts: Parts) -> dict[str, Any]:
    """A model.safetensors + optimizer.pt checkpoint (one process, DDP) into FSDP shards: every rank reads
    the whole files and keeps its shards. Returns state.json."""
    import safetensors.torch
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model = parts.model
    try:
        if has_lora(model):  # the adapters alone; the base (model.init_from) must be the one trained on
            check_base(ckpt)
            weights = read_adapters(ckpt)
        else:
            weights = safetensors.torch.load_file(str(ckpt / MODEL_FILE))
        saved = torch.load(ckpt / OPTIM_FILE, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"checkpoint {ckpt} is unreadable ({first_line(e)})") from None
    if has_lora(model):  # set_state_dict is not strict for LoRA (the base is not in the file): check here
        adapters = {n for n, p in model.named_parameters() if p.requires_grad}
        if set(weights) != adapters:
            raise CheckpointError(
                f"{ckpt} does not match the model's adapters (missing {sorted(adapters - set(weights))[:2]}, "
                f"unexpected {sorted(set(weights) - adapters)[:2]}); the lora section must equal the run's"
            )
    for name, alias in tied_names(model):  # safetensors stores a tied tensor under one name
        if name not in weights and alias in weights:
            weights[name] = weights[alias]
    optimizers = optimizers_of(parts.optimizer)
    subs = saved["optimizer"]["pair"] if "pair" in saved["optimizer"] else [saved["optimizer"]]
    by_name = [named_optimizer_state(sub, opt, model) for sub, opt in zip(subs, optimizers, strict=True)]
    optim_sd = {
        "state": {k: v for sd in by_name for k, v in sd["state"].items()},
        "param_groups": [g for sd in by_name for g in sd["param_groups"]],
    }
    try:
        set_state_dict(
            model,
            optimizers,
            model_state_dict=weights,
            optim_state_dict=optim_sd,
            options=state_dict_options(model, full_state_dict=True),
        )
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointError(
            f"{ckpt} does not match this model/optimizer ({first_line(e)}); resume with the run's own config"
        ) from None
    state = read_state(ckpt)
    if parts.scaler is not None and saved.get("scaler"):
        parts.scaler.load_state_dict(saved["scaler"])
    set_rng_state(state["rng"], torch.load(ckpt / RNG_FILE, map_location="cpu", weights_only=True))
    return state


def tied_names(model: nn.Module) -> list[tuple[str, str]]:
    """(name, the first name of the same parameter) for parameters shared under several names."""
    first: dict[int, str] = {}
    pairs = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            pairs.append((name, first[id(p)]))
        else:
            first[id(p)] = name
    return pairs


def named_optimizer_state(saved: dict, optimizer: torch.optim.Optimizer, model: nn.Module) -> dict:
    """A torch optimizer state_dict (parameters numbered in param-group order) keyed by parameter name instead,
    as torch.distributed.checkpoint.state_dict expects; the numbering follows this optimizer's groups, which
    were built in the same order."""
    names = {id(p): n for n, p in model.named_parameters()}
    state, groups = {}, []
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError("the saved optimizer has another number of parameter groups than this one")
    for saved_group, group in zip(saved["param_groups"], optimizer.param_groups, strict=True):
        fqns = [names[id(p)] for p in group["params"]]
        if len(fqns) != len(saved_group["params"]):
            raise CheckpointError("the saved optimizer state does not match this model's parameters")
        for index, fqn in zip(saved_group["params"], fqns, strict=True):
            if index in saved["state"]:
                state[fqn] = saved["state"][index]
        groups.append({**saved_group, "params": fqns})
    return {"state": state, "param_groups": groups}


# ---- the model alone, read whole in one process, without a process group (generate, export) --------------
def load_sharded_model(model_dir: Path, model: torch.nn.Module) -> None:
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


def materialize_model(model_dir: Path) -> torch.nn.Module:
    """A sharded checkpoint's model on the CPU, without spending time on a random initialisation first."""
    model = build_empty(read_model_config(model_dir), "cpu")
    load_sharded_model(model_dir, model)
    return model.eval()
