"""The rows of `hopperlm bench` (hopperlm/bench.py times them): each a `Case` whose `build()` makes fresh weights
and the step to time. hopperlm's rows are built exactly as `hopperlm train` builds a run (config -> plan ->
`build_step`, then `train_step`); the baselines are what a user would run instead (transformers'
LlamaForCausalLM, eager and compiled); `--variant` rows are hopperlm's with config overrides."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hopperlm.config import ModelConfig, config_from_dict
from hopperlm.data.loader import Batch
from hopperlm.errors import ConfigError
from hopperlm.hardware import Hardware
from hopperlm.interop.hf import llama_config, require_transformers
from hopperlm.model.transformer import build_model
from hopperlm.plan import make_plan
from hopperlm.plan.attention_probe import measure_attention
from hopperlm.plan.float8_payoff import torchao_available
from hopperlm.train.step import build_step, train_step


@dataclass
class Case:
    """One row to measure: `build()` returns (step function, notes on what it runs) on fresh weights. The step
    takes one (x, y) micro-batch and runs `grad_accum` micro-batches of it per optimizer step."""

    config: str
    micro_batch: int
    build: Callable[[], tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], list[str]]]
    seq_len: int | None = None  # None: the preset's
    grad_accum: int = 1
    documents: int = 0  # packed documents a row (masked attention)
    model_cfg: ModelConfig | None = None  # None: the preset's (a --variant with model.* keys has its own)


# ---- the rows --------------------------------------------------------------------------------------------
# the optimizer of the race recipe (configs/owt-350m-h100.yaml) for the Muon rows
MUON = {"optim": {"name": "muon", "lr": 1.5e-3}, "muon": {"lr_adjust": "spectral"}}
# the config sections a --variant key may name as SECTION.FIELD (train.* fields go bare)
VARIANT_SECTIONS = ("optim", "muon", "schedule")


def hopperlm_case(
    label: str,
    model_cfg: ModelConfig,
    hw: Hardware,
    micro: int,
    seq: int,
    log,
    sections: dict[str, dict] | None = None,
    *,
    grad_accum: int = 1,
    documents: int = 0,
    **train,
) -> Case:
    """A row built exactly as `hopperlm train` builds it: config -> plan -> speed-ups, parallel wrapper and
    optimizer (train/step.py `build_step`), then `train_step` itself: clipping and the finite check included.
    `sections`: the optim, muon and schedule sections (default AdamW at 3e-4, no warm-up), `train`: train.*
    overrides; `grad_accum` micro-batches
    per optimizer step; `documents` > 0: every sequence packed from that many equal documents (doc_ids)."""
    if documents and seq % documents:
        raise ConfigError(f"--variant documents={documents} must divide the sequence length {seq}")
    if seq > model_cfg.max_seq_len:
        model_cfg = dataclasses.replace(model_cfg, max_seq_len=seq)

    def build():
        cfg = config_from_dict(
            {
                "model": {"preset": None, **dataclasses.asdict(model_cfg)},
                "train": {
                    "seq_len": seq,
                    "micro_batch": micro,
                    "batch_tokens": micro * seq * grad_accum,
                    "max_steps": 1000,
                    **train,
                },
                **(sections or {}),
                "optim": {"lr": 3e-4, **(sections or {}).get("optim", {})},
                "schedule": {"warmup_steps": 0, **(sections or {}).get("schedule", {})},
            }
        )
        # on a real GPU the attention kernel is measured as `train` measures it (cuDNN against flash)
        probe = measure_attention if hw.device.type == "cuda" else None
        plan = make_plan(cfg, model_cfg, hw, attention_probe=probe)
        plan.apply_runtime_settings(log)
        model = build_model(model_cfg, hw.device, seed=0)
        parts, fp8 = build_step(
            model, plan, cfg.optim, muon=cfg.muon, log=lambda line: log(f"  {label}: {line}")
        )
        doc_ids = None
        if documents:  # (micro, seq): document i covers positions [i*seq/N, (i+1)*seq/N) of every row
            doc_ids = torch.arange(seq, device=hw.device).div(seq // documents, rounding_mode="floor")
            doc_ids = doc_ids.expand(micro, seq)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            batch = Batch(x, y, doc_ids)
            return train_step(parts, lambda micro: batch, grad_accum=grad_accum, lr=cfg.optim.lr).loss

        compiled = f"compile {plan.compile_mode}/{plan.compile_scope}" if plan.compile else "no compile"
        loss = "fused loss" if plan.fused_loss else "standard loss"
        clip = f"clip {cfg.optim.grad_clip:g}" if cfg.optim.grad_clip else "no clip"
        notes = [
            compiled,
            f"fp8 {fp8}",
            loss,
            plan.precision,
            clip,
            plan.optimizer,
            f"kernels {plan.kernels}",
        ]
        notes.append("fused projections" if plan.fused_projections else "separate projections")
        notes.append(plan.reasons.get("attention", "attention: ?").split(" (")[0])
        if documents:
            notes.append(f"{documents} documents a row ({plan.reasons.get('documents', 'document masks')})")
        return step, notes

    return Case(
        label, micro, build, seq_len=seq, grad_accum=grad_accum, documents=documents, model_cfg=model_cfg
    )


def hf_case(label: str, model_cfg: ModelConfig, hw: Hardware, micro: int, compiled: bool) -> Case:
    """transformers' LlamaForCausalLM with SDPA attention, fp32 master weights, bf16 autocast and gradient
    clipping at 1.0: what the HF Trainer runs with bf16=True (max_grad_norm's default)."""

    def build():
        transformers = require_transformers()
        torch.manual_seed(0)
        with torch.device(hw.device):
            model = transformers.AutoModelForCausalLM.from_config(
                llama_config(model_cfg), attn_implementation="sdpa"
            )
        if compiled:
            model.compile()
        cuda = hw.device.type == "cuda"
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), fused=cuda)
        dtype = torch.bfloat16 if cuda and hw.bf16 else (torch.float16 if cuda else None)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with torch.autocast(hw.device.type, dtype=dtype, enabled=dtype is not None):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        notes = ["compile default" if compiled else "no compile", "sdpa", str(dtype).removeprefix("torch.")]
        return step, notes + ["clip 1"]

    return Case(label, micro, build)


def parse_variant(text: str) -> tuple[str, dict]:
    """'NAME:key=value,key=value' -> (NAME, overrides), e.g. 'scope-model:compile_scope=model'; keys are
    train.* fields, optim.FIELD, muon.FIELD, schedule.FIELD, grad_accum or documents (hopperlm_case's
    arguments)."""
    import yaml

    name, _, pairs = text.partition(":")
    overrides = {}
    for pair in filter(None, pairs.split(",")):
        key, eq, value = pair.partition("=")
        if not eq:
            raise ConfigError(
                f"--variant {text!r}: write NAME:key=value[,key=value], e.g. mb32:micro_batch=32"
            )
        overrides[key.strip()] = yaml.safe_load(value)
    if not name or not overrides:
        raise ConfigError(f"--variant {text!r}: write NAME:key=value[,key=value], e.g. mb32:micro_batch=32")
    return name, overrides


def cases_for(
    model_cfg: ModelConfig,
    hw: Hardware,
    micro: int,
    seq: int,
    hf: bool,
    log,
    *,
    variants: list[str] = (),
    hf_compile: bool = True,
    only: list[str] | None = None,
) -> list[Case]:
    """The rows of one preset; `only`: keep just these configs (a name before ' (' counts: 'hopperlm fp8')."""
    cuda = hw.device.type == "cuda"
    cases = [
        hopperlm_case("eager", model_cfg, hw, micro, seq, log, compile=False, fp8="off", fused_loss=False),
        hopperlm_case("hopperlm", model_cfg, hw, micro, seq, log, fp8="off"),
        hopperlm_case("hopperlm muon", model_cfg, hw, micro, seq, log, MUON, fp8="off"),
    ]
    for text in variants:  # extra hopperlm rows with train.* / optim.* overrides (micro_batch included)
        name, overrides = parse_variant(text)
        settings = {"fp8": "off", **overrides}
        sections = {
            section: {
                k.removeprefix(f"{section}."): settings.pop(k)
                for k in list(settings)
                if k.startswith(f"{section}.")
            }
            for section in VARIANT_SECTIONS
        }
        shape = {k.removeprefix("model."): settings.pop(k) for k in list(settings) if k.startswith("model.")}
        row_micro, row_seq = settings.pop("micro_batch", micro), settings.pop("seq_len", seq)
        row_model = dataclasses.replace(model_cfg, **shape) if shape else model_cfg
        cases.append(
            hopperlm_case(f"hopperlm {name}", row_model, hw, row_micro, row_seq, log, sections, **settings)
        )
    if cuda and hw.fp8:
        backend = "tensorwise" if torchao_available() else "native"
        cases.append(hopperlm_case(f"hopperlm fp8 ({backend})", model_cfg, hw, micro, seq, log, fp8=backend))
    if hf:
        cases.append(hf_case("hf", model_cfg, hw, micro, compiled=False))
        if cuda and hf_compile:  # inductor on a CPU spends minutes compiling a baseline nobody runs there
            cases.append(hf_case("hf+compile", model_cfg, hw, micro, compiled=True))
    if only is not None:
        cases = [c for c in cases if c.config in only or c.config.split(" (")[0] in only]
    return cases


ROW_NAMES = (
    "eager",
    "hopperlm",
    "hopperlm muon",
    "hopperlm fp8",
    "hf",
    "hf+compile",
)  # what --rows may name (and variants)
