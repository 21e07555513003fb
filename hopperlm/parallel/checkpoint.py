"""Checkpoints of a data-parallel run, in one of two formats under RUN_DIR/checkpoints/step_N/, each with the
same config.json, tokenizer/, state.json, rng.pt (every rank's RNG states) and checksums.json
(hopperlm/checkpoint/layout.py):

  single   model.safetensors + optimizer.pt. One process, and DDP, where every rank holds the whole state:
           rank 0 writes it while the others wait.
  sharded  sharded/: torch.distributed.checkpoint (DCP) of the model and optimizer state, each rank writing
           its own shards (FSDP/HSDP, where no rank holds the whole state), optionally in the background
           (`parallel.async_checkpoint`: the state is copied to CPU memory and written while training goes on).

Either format loads at any world size and under any strategy: DCP reshards by parameter name, and a
single-file checkpoint is cut into shards on load. The single format's guarantees hold for the sharded one:
files are written under a temporary name; every rank hashes and fsyncs a share of them; rank 0 writes
checksums.json last and renames the directory; a failure on any rank leaves the previous checkpoints as they
were and every rank goes on; --resume verifies the checksums (each rank a share) and falls back to the
checkpoint before a corrupt one. The run directory must be on a filesystem that every node sees.
The files themselves are hopperlm/checkpoint/'s (layout.py, single.py, sharded.py); here the ranks take turns.

The `Checkpointer` owns what a checkpoint holds: set-up builds it once with the model, optimizer, loss scaler,
the run's state (train/state.py's TrainState), the tokenizer and the keep policy, and the loop calls
`save(step)`, `latest()`, `load(path)` (a resume) and `roll_back(path, bad_step)`, nothing else passed.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
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
    checkpoint_dir,
    is_sharded,
    latest_valid_checkpoint,
    list_checkpoints,
    read_state,
    verify_checkpoint,
    write_model_config,
)
from hopperlm.checkpoint.sharded import single_process_ok
from hopperlm.checkpoint.single import (
    CheckpointSaveError,
    load_model_weights,
    load_training_state,
    lora_record,
    publish_checkpoint,
    rng_state,
    save_checkpoint,
    save_failed,
    set_rng_state,
)
from hopperlm.checkpoint.tensors import check_base, read_adapters
from hopperlm.config import ModelConfig, ParallelConfig
from hopperlm.diskspace import write_failure
from hopperlm.errors import CheckpointError, first_line
from hopperlm.files import file_sha256, fsync_path
from hopperlm.model.lora import has_lora
from hopperlm.parallel.runtime import Runtime
from hopperlm.plan.strategy import SHARDED


def checkpoint_format(cfg: ParallelConfig, strategy: str) -> str:
    if cfg.checkpoint != "auto":
        return cfg.checkpoint
    return "sharded" if strategy in SHARDED or cfg.async_checkpoint else "single"


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


def latest_valid(run_dir: Path, rt: Runtime, log: Callable[[str], None]) -> Path | None:
    """The newest checkpoint whose files verify; with several ranks each verifies a share of the files and
    all agree on the answer (rank 0's listing decides which checkpoints there are)."""
    if rt.world_size == 1:
        return latest_valid_checkpoint(run_dir, log)
    found = rt.broadcast_object([str(p) for p in list_checkpoints(run_dir)] if rt.is_main else None)
    for name in reversed(found):
        ckpt = Path(name)
        problems = [p for p in rt.all_gather_object(verify_checkpoint(ckpt, (rt.rank, rt.world_size))) if p]
        if not problems:
            return ckpt
        log(f"warning: checkpoint {ckpt} is corrupt ({problems[0]}); falling back to the one before it")
    return None


class RunState(Protocol):
    """What a run changes as it goes, saved as state.json: train/state.py's TrainState (a layer above this
    one, so named here by the three calls the checkpointer makes on it)."""

    def state_dict(self, world_size: int) -> dict[str, Any]: ...

    def load_state_dict(self, saved: dict[str, Any]) -> None: ...

    def roll_back(self, saved: dict[str, Any], bad_step: int) -> None: ...


class Checkpointer:
    """A run's checkpoints: saved in the format its strategy calls for, loaded from either. Built once with
    every part a checkpoint holds, so saving is `save(step)` and resuming `load(path)`."""

    def __init__(
        self,
        rt: Runtime,
        *,
        run_dir: Path,
        strategy: str,
        cfg: ParallelConfig,
        model: nn.Module,
        model_cfg: ModelConfig,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None,
        state: RunState,
        tokenizer_dir: Path | None,
        keep_last: int,
        keep_every: int = 0,
    ) -> None:
        """`model`: the unwrapped model (not the DDP wrapper; FSDP shards it in place), whose weights are
        saved and loaded. `optimizer`: the run's (train/optim.py's OptimizerPair saves both of its own).
        `tokenizer_dir`: copied into every checkpoint. `keep_last`, `keep_every`: train's keep policy, applied
        after each save (the newest keep_last, and every keep_every-th step for good)."""
        self.rt, self.strategy, self.log = rt, strategy, rt.log
        self.run_dir, self.tokenizer_dir = run_dir, tokenizer_dir
        self.model, self.model_cfg, self.optimizer, self.scaler = model, model_cfg, optimizer, scaler
        self.state = state
        self.keep_last, self.keep_every = keep_last, keep_every
        self.format = checkpoint_format(cfg, strategy)
        self.async_save = cfg.async_checkpoint
        self._pending: tuple | None = None  # a background save: (its future, temporary dir, final dir)
        self._group = None
        if self.async_save and not rt.active:  # the background writer would say so on every save
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")
        if self.async_save and rt.backend == "nccl":
            import torch.distributed as dist

            # the background writer's collectives go over gloo, never beside training's NCCL ones
            self._group = dist.new_group(backend="gloo")

    # ---- saving ----------------------------------------------------------------------------------------------
    def save(self, step: int, *, wait: bool = False) -> Path:
        """A checkpoint of the run as it stands, as step `step`; every rank calls it. CheckpointSaveError on
        every rank when any rank could not write its part (the previous checkpoints are untouched). An async
        save returns once the state is copied and completes at the next save, `finish()` or `latest()`;
        `wait`: complete it before returning (the run's end)."""
        with self.rt.long_phase("checkpoint"):  # collectives get the start-up limit while it writes
            path = self._save(step)
            if wait:
                self.finish()
        return path

    def _save(self, step: int) -> Path:
        rt = self.rt
        record = self.state.state_dict(rt.world_size)  # (read before an earlier background save completes)
        self.finish()
        rank_rng = rt.all_gather_object(rng_state()[1]) if rt.world_size > 1 else None
        if self.format == "single":  # rank 0 holds the whole state (one process, DDP) and writes it
            error = None
            if rt.is_main:
                try:
                    save_checkpoint(
                        self.run_dir,
                        step,
                        model=self.model,
                        model_cfg=self.model_cfg,
                        optimizer=self.optimizer,
                        scaler=self.scaler,
                        state=record,
                        tokenizer_dir=self.tokenizer_dir,
                        keep_last=self.keep_last,
                        keep_every=self.keep_every,
                        rank_rng=rank_rng,
                    )
                except CheckpointSaveError as e:
                    error = (str(e), e.latest, e.needed)
            error = rt.broadcast_object(error)  # the others wait here while rank 0 writes
            if error:
                message, latest, needed = error
                raise CheckpointSaveError(message, latest=latest, needed=needed)
            return checkpoint_dir(self.run_dir, step)
        return self._save_sharded(step, record, rank_rng)

    def _save_sharded(self, step: int, record: dict[str, Any], rank_rng: list | None) -> Path:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        rt, run_dir, model, model_cfg, scaler = self.rt, self.run_dir, self.model, self.model_cfg, self.scaler
        final = checkpoint_dir(run_dir, step)
        tmp = final.parent / f"{final.name}.tmp-sharded"
        error = None
        if rt.is_main:  # the small files first; the shards and then checksums.json complete the directory
            try:
                final.parent.mkdir(parents=True, exist_ok=True)
                for stale in final.parent.glob(f"{PREFIX}*.tmp-*"):  # left by a save that was killed
                    shutil.rmtree(stale, ignore_errors=True)
                tmp.mkdir()
                write_model_config(tmp, model_cfg, self.tokenizer_dir, lora_record(model, model_cfg))
                plain_rng, tensor_rng = rng_state()
                torch.save({**tensor_rng, "ranks": rank_rng} if rank_rng else tensor_rng, tmp / RNG_FILE)
                scaler_state = scaler.state_dict() if scaler is not None else None
                record = {
                    **record,
                    "step": step,
                    "rng": plain_rng,
                    "scaler": scaler_state,
                    "format": "sharded",
                }
                (tmp / STATE_FILE).write_text(json.dumps(record, indent=1))
            except (OSError, RuntimeError) as e:  # (torch.save reports a full disk as a RuntimeError)
                error = write_failure(e) or first_line(e)
                if not isinstance(e, OSError) and write_failure(e) is None:
                    raise
        self._raise_if_any(rt.broadcast_object(error), tmp, run_dir, final)
        model_sd, optim_sd = get_state_dict(
            model, optimizers_of(self.optimizer), options=state_dict_options(model)
        )
        content = {"model": model_sd, "optim": optim_sd}
        alone = {} if rt.active else {"no_dist": True}  # (passed only when needed: older torch lacks it)
        try:
            if self.async_save:
                with single_process_ok():
                    future = dcp.async_save(
                        content, checkpoint_id=tmp / SHARDED_DIR, process_group=self._group, **alone
                    )
                self._pending = (future, tmp, final)
                return final
            with single_process_ok():
                dcp.save(content, checkpoint_id=tmp / SHARDED_DIR, **alone)
        except BaseException as e:  # DCP raises on every rank when any rank's write failed
            if isinstance(e, KeyboardInterrupt | SystemExit):  # (its CheckpointException is a BaseException)
                raise
            self._raise_if_any(write_failure(e) or first_line(e), tmp, run_dir, final)
        return self._complete(tmp, final)

    def _complete(self, tmp: Path, final: Path) -> Path:
        """Every rank hashes and fsyncs its share of the files; rank 0 writes checksums.json and renames."""
        rt, run_dir = self.rt, self.run_dir
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
                publish_checkpoint(tmp, final, run_dir, self.keep_last, self.keep_every)
            except OSError as e:
                error = write_failure(e) or e.strerror or str(e)
        self._raise_if_any(rt.broadcast_object(error), tmp, run_dir, final)
        return final

    def _raise_if_any(self, error: str | None, tmp: Path, run_dir: Path, final: Path) -> None:
        if error is None:
            return
        if self.rt.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise save_failed(final, run_dir, error)

    def finish(self) -> None:
        """Complete a background save (waits for its files); every rank calls it at the same point."""
        if self._pending is None:
            return
        future, tmp, final = self._pending
        run_dir = self.run_dir
        self._pending = None
        try:
            future.result()
        except BaseException as e:  # the background write failed (a full disk): reported at this save point
            # (DCP's CheckpointException is a BaseException: only an interrupt or an exit passes through)
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            self._raise_if_any(write_failure(e) or first_line(e), tmp, run_dir, final)
        self._complete(tmp, final)
        self.log(f"checkpoint: {final} complete (written in the background)")

    # ---- loading ---------------------------------------------------------------------------------------------
    def latest(self) -> Path | None:
        """The newest complete checkpoint of the run whose files verify (None: there is none); a background
        save completes first. Every rank calls it and gets the same answer."""
        self.finish()
        return latest_valid(self.run_dir, self.rt, self.log)

    def load(self, path: Path) -> dict[str, Any]:
        """Resume from the checkpoint `path` (either format, any world size): weights, optimizer, scaler and
        RNG states into the run's parts, and state.json into its state (its `load_state_dict`). Returns
        state.json."""
        saved = self._load_parts(path)
        self.state.load_state_dict(saved)
        return saved

    def roll_back(self, path: Path, bad_step: int) -> dict[str, Any]:
        """Back to the checkpoint `path` after divergence at `bad_step`: the parts as `load` restores them,
        the state through its `roll_back` (the guard's counters and the data stream go on). Returns
        state.json."""
        saved = self._load_parts(path)
        self.state.roll_back(saved, bad_step)
        return saved

    def _load_parts(self, ckpt: Path) -> dict[str, Any]:
        """Weights, optimizer, scaler and RNG states from either format into this run's (possibly sharded)
        model; returns state.json."""
        model, optimizer, scaler = self.model, self.optimizer, self.scaler
        if is_sharded(ckpt):
            state = self._load_sharded(ckpt, model, optimizer, scaler)
        elif self.strategy in SHARDED:
            state = self._load_single_into_shards(ckpt, model, optimizer, scaler)
        else:
            load_model_weights(ckpt, model)
            state = load_training_state(ckpt, optimizer, scaler)
        self._restore_rank_rng(ckpt, state)
        return state

    def _load_sharded(self, ckpt: Path, model: nn.Module, optimizer, scaler) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        optimizers = optimizers_of(optimizer)
        options = state_dict_options(model)
        model_sd, optim_sd = get_state_dict(model, optimizers, options=options)
        content = {"model": model_sd, "optim": optim_sd}
        try:
            with single_process_ok():
                dcp.load(
                    content, checkpoint_id=ckpt / SHARDED_DIR, **({} if self.rt.active else {"no_dist": True})
                )
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
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        set_rng_state(state["rng"], torch.load(ckpt / RNG_FILE, map_location="cpu", weights_only=True))
        return state

    def _load_single_into_shards(self, ckpt: Path, model: nn.Module, optimizer, scaler) -> dict[str, Any]:
        """A model.safetensors + optimizer.pt checkpoint (one process, DDP) into FSDP shards: every rank reads
        the whole files and keeps its shards."""
        import safetensors.torch
        from torch.distributed.checkpoint.state_dict import set_state_dict

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
        optimizers = optimizers_of(optimizer)
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
                f"{ckpt} does not match this model/optimizer ({first_line(e)}); resume with the run's own "
                "config"
            ) from None
        state = read_state(ckpt)
        if scaler is not None and saved.get("scaler"):
            scaler.load_state_dict(saved["scaler"])
        set_rng_state(state["rng"], torch.load(ckpt / RNG_FILE, map_location="cpu", weights_only=True))
        return state

    def _restore_rank_rng(self, ckpt: Path, state: dict[str, Any]) -> None:
        """Each rank continues its own RNG stream (dropout) when the checkpoint has one for it; ranks beyond
        the checkpoint's world size get a fresh stream from (step, rank)."""
        rt = self.rt
        if rt.world_size == 1:
            return  # rank 0's streams, restored with the rest of the state
        saved = torch.load(ckpt / RNG_FILE, map_location="cpu", weights_only=True).get("ranks") or []
        if rt.rank < len(saved):
            torch.set_rng_state(saved[rt.rank]["torch"])
            if "cuda" in saved[rt.rank] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(saved[rt.rank]["cuda"])
        elif saved or rt.rank > 0:  # (rank 0 keeps a one-process checkpoint's stream, restored already)
            torch.manual_seed(
                int(np.random.SeedSequence([state["step"], rt.rank, 0x5EED]).generate_state(1)[0])
            )
        if len(saved) != rt.world_size:
            self.log(
                f"resume: the checkpoint holds RNG streams for {len(saved) or 1} rank(s), this run has "
                f"{rt.world_size}; the others start new streams (dropout masks differ from an uninterrupted run)"
            )


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
