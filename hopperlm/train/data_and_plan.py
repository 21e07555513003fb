"""What a run is made of before its first step, shared by `train` and `diagnose`: the data it reads, the model
config that data completes (its vocabulary), and the plan. `diagnose CONFIG` calls `plan_run` exactly as
`train CONFIG` does, so the two always agree on the plan.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hopperlm.config import Config, ModelConfig
from hopperlm.data.batches import BatchLayout, BatchSource, train_batches
from hopperlm.data.sft import open_sft_data
from hopperlm.data.tokenizer import Tokenizer, load_tokenizer
from hopperlm.data.train_data import (
    Dataset,
    ValSet,
    open_train_shards,
    open_val_sets,
    resolve_datasets,
    trained,
)
from hopperlm.errors import ConfigError, DataError
from hopperlm.hardware import Hardware
from hopperlm.interop.inference import sft_tokenizer_path
from hopperlm.parallel.runtime import Runtime
from hopperlm.plan import SHARDED, Plan, World, make_plan
from hopperlm.plan.attention_probe import measure_attention
from hopperlm.train.batch_finder import make_gpu_finder
from hopperlm.train.initial_model import build_train_model


def resolve_model_config(cfg: ModelConfig, data_vocab: int) -> ModelConfig:
    """Take the vocabulary from the data when the model leaves it open (rounded up to 64 for fast matmuls)."""
    if cfg.awaits_init_from:  # a config from load_config that skipped the explicit step
        raise ConfigError(
            f"model.init_from={cfg.init_from} is not resolved yet; call "
            "hopperlm.interop.init_from.resolve_init_from(cfg) after loading the config"
        )
    if cfg.vocab_size is None:
        return dataclasses.replace(cfg, vocab_size=64 * math.ceil(data_vocab / 64))
    if cfg.vocab_size < data_vocab:
        if cfg.init_from:  # a tokenizer extended with new pieces: new rows (resize on load)
            return dataclasses.replace(cfg, vocab_size=64 * math.ceil(data_vocab / 64))
        raise ConfigError(
            f"model.vocab_size={cfg.vocab_size} is smaller than the data's vocabulary ({data_vocab}); "
            "set model.vocab_size to null (take it from the data) or re-prepare with a smaller tokenizer"
        )
    return cfg


def check_tokenizer(spec: str | None, manifest: dict, data_dir: Path) -> None:
    if spec is None:
        return
    ours = load_tokenizer(spec).identity()["sha256"]
    if ours != manifest["tokenizer"]["sha256"]:
        raise DataError(
            f"data.tokenizer={spec} does not match the tokenizer {data_dir} was prepared with "
            f"({manifest['tokenizer'].get('name') or manifest['tokenizer']['kind']}); "
            "re-run `hopperlm prepare` with this tokenizer or drop data.tokenizer"
        )


@dataclass
class RunData:
    """Pretraining shards (one dataset or a mixture) or instruction rows, behind one interface."""

    datasets: list[Dataset]
    val_sets: list[ValSet]
    _open: Callable[..., BatchSource]
    _tokenizer: Tokenizer | None = (
        None  # instruction data's, in memory (RUN_DIR/tokenizer is rank 0's to write)
    )

    def tokenizer(self) -> Tokenizer:
        """The tokenizer the data was encoded with."""
        return self._tokenizer or load_tokenizer(self.data_dir)

    @property
    def data_dir(self) -> Path:
        return self.datasets[0].path

    @property
    def manifest(self) -> dict:
        return self.datasets[0].manifest

    def batches(self, layout: BatchLayout, *, pin: bool, prefetch: int) -> BatchSource:
        """This rank's micro-batches; see data/batches.py."""
        return self._open(layout, pin=pin, prefetch=prefetch)


def open_run_data(cfg: Config, run_dir: Path, log: Callable[[str], None], *, writer: bool = True) -> RunData:
    """data.path / data.mixture for pretraining, or sft.path for instruction data. `writer`: this process
    writes the run's files (rank 0); every rank reads the same data."""
    tc = cfg.train
    if cfg.sft.path:
        sft = open_sft_data(
            cfg.sft,
            tc,
            run_dir,
            log,
            tokenizer_path=sft_tokenizer_path(cfg.sft, cfg.model),
            save_tokenizer=writer,
        )

        def sft_batches(layout: BatchLayout, *, pin: bool, prefetch: int) -> BatchSource:
            # (rows are built in the loop's thread: no pinning or prefetch thread for instruction data)
            return sft.batches(layout, seed=tc.seed)

        data = RunData(sft.datasets, sft.val_sets, sft_batches, sft.tokenizer)
    else:
        datasets = resolve_datasets(cfg.data)  # data.path, or data.mixture's datasets
        drawn = trained(datasets)  # a 0-weight dataset is validated on, never trained on
        shards = open_train_shards(drawn, tc.seq_len, cfg.data.verify)
        val_sets = open_val_sets(datasets, tc.seq_len, tc.eval_windows, cfg.data.verify)

        def pretraining_batches(layout: BatchLayout, *, pin: bool, prefetch: int) -> BatchSource:
            return train_batches(
                cfg.data,
                drawn,
                shards,
                seq_len=tc.seq_len,
                layout=layout,
                seed=tc.seed,
                pin=pin,
                prefetch=prefetch,
            )

        data = RunData(datasets, val_sets, pretraining_batches)
    check_tokenizer(cfg.data.tokenizer, data.manifest, data.data_dir)
    if tc.target_loss is not None and not data.val_sets:
        raise ConfigError(
            f"train.target_loss is set but {data.data_dir} has no validation split; "
            "re-prepare with --val-fraction above 0 or drop train.target_loss"
        )
    return data


def plan_run(
    cfg: Config,
    model_cfg: ModelConfig,
    hw: Hardware,
    *,
    world: World,
    cache_dir: Path,
    log: Callable[[str], None],
    measure: bool = True,
    rt: Runtime | None = None,
    kept_attention: str | None = None,
    kept_muon_ns: str | None = None,
) -> Plan:
    """The plan of `train` and `diagnose`. On a GPU with train.micro_batch unset (and `measure`), the micro-batch
    is measured with real training steps of the run's own model (LoRA/QLoRA included) and cached in
    `cache_dir`; under torchrun every rank measures on its own, without DDP, and the smallest answer holds
    (`rt`). On a GPU (and `measure`) the attention kernel is timed too: cuDNN against flash, about a second,
    the case least kind to cuDNN over the ranks deciding for all (plan/attention_probe.py); a resumed run keeps
    its checkpoint's kernel instead (`kept_attention`), and its Newton–Schulz precision (`kept_muon_ns`)."""
    probe = measure_attention if measure and hw.device_type == "cuda" else None
    if rt is not None:
        probe = rt.agreed_attention_probe(probe)
    finder = None
    if measure and hw.device_type == "cuda" and cfg.train.micro_batch is None:

        def trial_model(plan: Plan):  # the run's kind of model; the weights are not read
            return build_train_model(
                cfg,
                model_cfg,
                device=plan.device,
                compute_dtype=plan.autocast_dtype,
                data_tokenizer=None,
                load=False,
                log=log,
                sharded=plan.strategy in SHARDED,
            )[0]

        finder = make_gpu_finder(
            cache_dir,
            cfg.train.memory_target * hw.free_memory,
            log,
            build=trial_model,
            grad_clip=cfg.optim.grad_clip,
        )
        if rt is not None:
            finder = rt.agreed_finder(finder)
    return make_plan(
        cfg,
        model_cfg,
        hw,
        finder,
        world,
        attention_probe=probe,
        kept_attention=kept_attention,
        kept_muon_ns=kept_muon_ns,
    )
