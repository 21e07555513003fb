"""`hopperlm bench`: warm training steps of hopperlm beside the baselines users would run instead, in one
process, on one device, on the same batch (the rows are built in bench_rows.py).

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

from hopperlm.bench_rows import Case, cases_for
from hopperlm.config import ModelConfig
from hopperlm.config.presets import get_preset
from hopperlm.data.loader import RandomWindows, TokenShards
from hopperlm.data.prepare import read_manifest
from hopperlm.errors import DataError, first_line
from hopperlm.hardware import Hardware
from hopperlm.model.transformer import flops_per_token

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
