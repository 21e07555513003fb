"""`hopperlm bench`: warm training steps of hopperlm beside the baselines users would run instead, in one
process, on one device, on the same batch.

For each preset, every row trains the same architecture on the same micro-batch:
  eager            hopperlm's model in plain PyTorch: no compile, standard loss, bf16 autocast (fp32 on CPU)
  hopperlm         what `hopperlm train` runs: the plan for this device (compile, fused loss, ...), in bf16,
                   through `train_step` (train/step.py), the step training runs: clipping, finite check
  hopperlm fp8     the same with float8 linear layers (GPUs with fp8 tensor cores)
  hf               Hugging Face `transformers` LlamaForCausalLM, attn_implementation="sdpa", bf16 autocast,
                   clipping at 1.0 (the HF Trainer's default)
  hf+compile       the same under torch.compile
  hopperlm muon    the same step with optim.name muon (the race recipe's optimizer: Muon on the blocks'
                   matrices, AdamW for the rest), beside the AdamW row
Timing: warm-up steps first (compilation happens there and is reported apart), then `windows` timed windows
of `steps` optimizer steps each, the device synchronised at both ends; the median window counts, and its min
and max are kept beside it (a row is a median over >= 5 windows with its spread, never one window). Inputs
are random tokens (never zeros), y = x shifted by one. Each row reports tokens/s, MFU against the device's
dense 16-bit peak, peak memory, and ratios against the baselines measured in the same run.

--variant NAME:KEY=VALUE,... adds a hopperlm row: KEY a train.* field (attention=cudnn, compile_mode=...,
micro_batch=32, seq_len=512, grad_accum=8: micro-batches per optimizer step), optim.FIELD (optim.name=muon),
muon.FIELD and schedule.FIELD (muon.ns=polar_express),
model.FIELD (model.mlp=relu2,model.ffn_dim=4224: the row's model differs from the preset's; state its parameters),
or documents=N (each row packed from N equal documents: attention masked per document, FlexAttention on CUDA).
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hopperlm.config import ModelConfig, config_from_dict
from hopperlm.config.presets import get_preset
from hopperlm.data.loader import Batch, RandomWindows, TokenShards
from hopperlm.data.prepare import read_manifest
from hopperlm.errors import ConfigError, DataError, first_line
from hopperlm.hardware import Hardware
from hopperlm.interop.hf import llama_config, require_transformers
from hopperlm.model.transformer import build_model, flops_per_token
from hopperlm.plan import make_plan
from hopperlm.plan.attention_probe import measure_attention
from hopperlm.plan.float8_payoff import torchao_available
from hopperlm.train.step import build_step, train_step

DEFAULT_PRESETS = ("gpt2-124m", "h100-350m", "tinyllama-1.1b")
# (micro-batch, sequence length) per preset on a GPU: the same for every row of a preset
GPU_SHAPES = {
    "gpt2-124m": (16, 1024),
    "h100-350m": (16, 1024),
    "tinyllama-1.1b": (8, 2048),
    "llama3-8b": (1, 4096),
}
# --quick: each preset shrunk to 2 blocks of width <= 256 (head_dim 64, its kv-head ratio and ffn ratio kept)
# and an 8192 vocabulary, on 2 x 128 tokens: seconds on a CPU, the same code paths as the full size
QUICK_LAYERS, QUICK_DIM, QUICK_VOCAB, QUICK_SHAPE = 2, 256, 8192, (2, 128)


@dataclass
class Row:
    preset: str
    config: str
    micro_batch: int
    seq_len: int
    flops_per_token: int
    grad_accum: int = 1  # micro-batches per timed optimizer step
    tokens_per_s: float | None = None  # the median window's
    tokens_per_s_min: float | None = None  # the slowest window's
    tokens_per_s_max: float | None = None  # the fastest window's
    window_tokens_per_s: list[float] = field(default_factory=list)  # every timed window, in order
    mfu: float | None = None
    peak_mem_gb: float | None = None
    step_ms: float | None = None
    warmup_s: float | None = None
    final_loss: float | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    ratios: dict[str, float] = field(default_factory=dict)


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


# ---- measuring -------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(
    case: Case,
    row: Row,
    hw: Hardware,
    batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    warmup: int,
    windows: int,
    steps: int,
    loss_steps: int,
) -> None:
    """Fill `row` with the case's numbers; an out-of-memory error or a failure becomes `row.error`."""
    device = hw.device
    try:
        step, row.notes = case.build()
        start = time.perf_counter()
        micro = row.micro_batch
        losses = [step(*batches(i, micro, row.seq_len)) for i in range(max(warmup, loss_steps))]
        _sync(device)
        row.warmup_s = time.perf_counter() - start
        if loss_steps:  # the mean of the last tenth of a real-data run, the same data for every row
            tail = losses[-max(1, loss_steps // 10) :]
            row.final_loss = float(torch.stack(tail).float().mean())
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        x, y = batches(0, micro, row.seq_len)
        times = []
        for _ in range(windows):
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                step(x, y)
            _sync(device)
            times.append((time.perf_counter() - t0) / steps)
        tokens = row.micro_batch * row.seq_len * row.grad_accum  # per optimizer step
        seconds = statistics.median(times)
        row.step_ms = 1000 * seconds
        row.tokens_per_s = tokens / seconds
        row.window_tokens_per_s = [tokens / t for t in times]
        row.tokens_per_s_min, row.tokens_per_s_max = (
            min(row.window_tokens_per_s),
            max(row.window_tokens_per_s),
        )
        row.mfu = row.tokens_per_s * row.flops_per_token / hw.peak_16bit if hw.peak_16bit else None
        if device.type == "cuda":
            row.peak_mem_gb = torch.cuda.max_memory_allocated(device) / 1e9
    except torch.OutOfMemoryError:
        row.error = f"out of memory at micro-batch {row.micro_batch} x {row.seq_len}"
    except Exception as e:  # a baseline that cannot run here is a finding for the table, not a crash
        row.error = first_line(e)[:200]
    finally:
        step = None
        _release(device)


def add_ratios(rows: list[Row]) -> None:
    """Each row's tokens/s over each baseline's (eager, hf, hf+compile) of the same preset; safe to call again
    as rows are added (a row's ratios are recomputed from scratch)."""
    for row in rows:
        row.ratios = {}
        for other in rows:
            if (
                other.preset == row.preset
                and other.config in ("eager", "hf", "hf+compile")
                and other is not row
                and row.tokens_per_s
                and other.tokens_per_s
            ):
                row.ratios[f"vs {other.config}"] = row.tokens_per_s / other.tokens_per_s


def bench_model_config(preset: str, quick: bool) -> ModelConfig:
    cfg = get_preset(preset)
    if cfg.vocab_size is None:
        cfg = dataclasses.replace(cfg, vocab_size=32000)
    if quick:
        dim = min(cfg.dim, QUICK_DIM)
        heads = max(1, dim // 64)
        kv = max(1, heads * cfg.kv_heads // cfg.n_heads)
        ffn = 64 * max(1, round(cfg.hidden_dim * dim / cfg.dim / 64))
        cfg = dataclasses.replace(
            cfg,
            n_layers=QUICK_LAYERS,
            dim=dim,
            n_heads=heads,
            n_kv_heads=kv,
            ffn_dim=ffn,
            vocab_size=QUICK_VOCAB,
        )
    return cfg


def shape_for(preset: str, hw: Hardware, quick: bool, micro: int | None, seq: int | None) -> tuple[int, int]:
    default = QUICK_SHAPE if quick or hw.device.type != "cuda" else GPU_SHAPES.get(preset, (8, 1024))
    return micro or default[0], seq or default[1]


# ---- the run ---------------------------------------------------------------------------------------------
def batch_source(vocab: int, device: torch.device, data_dir=None):
    """batches(i, micro, seq) -> (x, y), y = x shifted by one: random tokens (one fixed batch per size), or
    real windows of a prepared data dir (step i of a seeded random-window stream)."""
    if data_dir is None:
        fixed = {}

        def random_batch(i, micro, seq):
            if (micro, seq) not in fixed:
                g = torch.Generator().manual_seed(micro)
                fixed[micro, seq] = torch.randint(0, vocab, (micro, seq + 1), generator=g).to(device)
            tokens = fixed[micro, seq]
            return tokens[:, :-1], tokens[:, 1:]

        return random_batch

    if read_manifest(data_dir)["vocab_size"] > vocab:
        raise DataError(
            f"{data_dir} has a larger vocabulary than the model's {vocab}; prepare it with a smaller one"
        )
    shards = TokenShards(data_dir, "train")

    def real_batch(i, micro, seq):
        x, y = RandomWindows(shards, seq, micro, seed=0).batch(i, 0)
        return x.to(device), y.to(device)

    return real_batch


def run_bench(
    presets: list[str],
    hw: Hardware,
    quick: bool = False,
    micro_batch: int | None = None,
    seq_len: int | None = None,
    steps: int = 10,
    windows: int = 5,
    warmup: int = 3,
    hf: bool = True,
    hf_compile: bool = True,
    loss_steps: int = 0,
    data_dir=None,
    variants: list[str] = (),
    only: list[str] | None = None,
    on_row: Callable[[list[Row]], None] | None = None,
    log: Callable[[str], None] = print,
) -> list[Row]:
    """Measure every row; `on_row(rows so far, ratios filled)` after each one, so a caller can save the table
    as it grows: a time-out or a kill half-way loses only the row in flight."""
    rows: list[Row] = []
    for preset in presets:
        model_cfg = bench_model_config(preset, quick)
        micro, seq = shape_for(preset, hw, quick, micro_batch, seq_len)
        if seq > model_cfg.max_seq_len:
            model_cfg = dataclasses.replace(model_cfg, max_seq_len=seq)
        batches = batch_source(model_cfg.vocab_size, hw.device, data_dir)
        cases = cases_for(
            model_cfg, hw, micro, seq, hf, log, variants=variants, hf_compile=hf_compile, only=only
        )
        for case in cases:
            row_seq = case.seq_len or seq
            fpt = flops_per_token(case.model_cfg or model_cfg, row_seq)
            row = Row(preset, case.config, case.micro_batch, row_seq, fpt, grad_accum=case.grad_accum)
            log(f"{preset}: {case.config} ...")
            on_hopperlm = case.config.startswith("hopperlm")
            measure(case, row, hw, batches, warmup, windows, steps, loss_steps if on_hopperlm else 0)
            if case.documents and row.mfu is not None:  # the FLOPs per token count whole-row attention
                row.mfu = None
                row.notes.append("MFU n/a: document masks skip attention blocks the FLOP count includes")
            log(f"{preset}: {case.config}: {describe(row)}")
            rows.append(row)
            add_ratios(rows)
            if on_row is not None:
                on_row(rows)
    return rows


def describe(row: Row) -> str:
    if row.error:
        return f"failed ({row.error})"
    mfu = "n/a" if row.mfu is None else f"{100 * row.mfu:.1f}%"
    spread = (
        f"{row.tokens_per_s_min:,.0f}-{row.tokens_per_s_max:,.0f} over {len(row.window_tokens_per_s)} windows"
    )
    return (
        f"{row.tokens_per_s:,.0f} tokens/s ({spread}), MFU {mfu}, {row.step_ms:.1f} ms/step, "
        f"warm-up {row.warmup_s:.1f} s"
    )


def format_table(rows: list[Row], hw: Hardware) -> list[str]:
    """The table printed last: one line per row (tokens/s the median window, with the slowest and fastest
    window beside it), and each preset's ceiling at 100% MFU."""
    lines = [
        f"{'preset':<16}{'config':<26}{'batch':>12}{'tokens/s':>12}{'min-max':>18}{'MFU':>7}{'mem GB':>8}"
        f"{'ms/step':>9}{'vs eager':>9}{'vs HF':>7}{'vs HF+c':>8}{'loss':>8}"
    ]
    for preset in dict.fromkeys(r.preset for r in rows):
        group = [r for r in rows if r.preset == preset]
        for r in group:
            batch = f"{r.micro_batch}x{r.seq_len}" + (f"x{r.grad_accum}" if r.grad_accum > 1 else "")
            if r.error:
                lines.append(f"{preset:<16}{r.config:<26}{batch:>12}  {r.error}")
                continue
            mfu = "n/a" if r.mfu is None else f"{100 * r.mfu:.1f}%"
            mem = "n/a" if r.peak_mem_gb is None else f"{r.peak_mem_gb:.1f}"
            spread = f"{r.tokens_per_s_min:,.0f}-{r.tokens_per_s_max:,.0f}"
            ratio = [r.ratios.get(k) for k in ("vs eager", "vs hf", "vs hf+compile")]
            ratio_s = "".join(
                f"{'' if x is None else f'{x:.2f}x':>{w}}" for x, w in zip(ratio, (9, 7, 8), strict=True)
            )
            loss = "" if r.final_loss is None else f"{r.final_loss:.4f}"
            lines.append(
                f"{preset:<16}{r.config:<26}{batch:>12}{r.tokens_per_s:>12,.0f}{spread:>18}{mfu:>7}{mem:>8}"
                f"{r.step_ms:>9.1f}{ratio_s}{loss:>8}"
            )
        if hw.peak_16bit:
            fpt = group[0].flops_per_token
            lines.append(
                f"{'':<16}ceiling: {hw.peak_16bit / fpt:,.0f} tokens/s at 100% of {hw.peak_16bit / 1e12:.0f} "
                f"TFLOP/s ({fpt / 1e9:.2f} GFLOP/token at seq {group[0].seq_len})"
            )
    windows = {len(r.window_tokens_per_s) for r in rows if r.window_tokens_per_s}
    if windows:
        lines.append(f"tokens/s: the median of {'/'.join(map(str, sorted(windows)))} timed windows; min-max: the "
                     "slowest and the fastest window")  # fmt: skip
    return lines
