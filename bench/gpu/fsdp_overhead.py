"""What data parallelism costs per GPU: warm training steps of the same model unwrapped, under DDP and under
FSDP2, side by side, built as `hopperlm train` builds them (plan -> speed-ups -> parallelize -> optimizer).

One GPU (the overhead of the wrapping alone: FSDP's per-block hooks, casts and copies with nothing to talk to):
    python bench/gpu/fsdp_overhead.py --presets tinyllama-1.1b --out "$OUT/fsdp-overhead-1gpu.json"
Several (the scaling note's numbers, per GPU; the unwrapped row trains independent copies, the ceiling):
    torchrun --standalone --nproc-per-node 8 bench/gpu/fsdp_overhead.py --presets tinyllama-1.1b,llama3-8b
Rows that cannot run (llama3-8b unwrapped or under DDP does not fit 80 GB) report their error. Timing is
`hopperlm bench`'s: warm-up (compilation) apart, median of timed windows, synchronised, random tokens.
Rank 0 prints one table last: tokens/s per GPU, the run's total, MFU, peak memory, and the ratio to the
unwrapped row measured in the same process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from hopperlm.bench import Row, batch_source, bench_model_config, measure
from hopperlm.bench_rows import Case
from hopperlm.config import config_from_dict
from hopperlm.data.loader import Batch
from hopperlm.files import write_atomic
from hopperlm.hardware import detect, detect_for
from hopperlm.model.transformer import build_model, flops_per_token
from hopperlm.parallel.runtime import Runtime, read_env
from hopperlm.plan import (
    World,
    make_plan,
)
from hopperlm.provenance import provenance
from hopperlm.train.step import build_step, train_step

STRATEGIES = ("none", "ddp", "fsdp")


def case(strategy: str, model_cfg, hw, rt: Runtime, micro: int, seq: int, log) -> Case:
    def build():
        cfg = config_from_dict(
            {
                "model": {"preset": None, **dataclasses.asdict(model_cfg)},
                "train": {"seq_len": seq, "micro_batch": micro, "max_steps": 1000, "fp8": "off"},
                "parallel": {"strategy": strategy},
                "optim": {"lr": 3e-4},
                "schedule": {"warmup_steps": 0},
            }
        )
        world = rt.world if strategy != "none" else World()  # none: every rank trains its own copy
        plan = make_plan(cfg, model_cfg, hw, world=world)
        plan.apply_runtime_settings(log)
        model = build_model(model_cfg, hw.device, seed=0)
        parts, _ = build_step(model, plan, cfg.optim, log=lambda line: log(f"  {strategy}: {line}"), rt=rt)

        def step(x, y):  # `hopperlm train`'s step: clipping, the finite check, DDP/FSDP collectives
            batch = Batch(x, y)
            return train_step(parts, lambda micro: batch, grad_accum=1, lr=cfg.optim.lr).loss

        return step, [plan.strategy, f"compile {plan.compile_mode}" if plan.compile else "no compile"]

    return Case(strategy, micro, build)


def table(rows: list[Row], world_size: int) -> list[str]:
    """One line per row: tokens/s per GPU and for the run, MFU, memory, and the ratio to the unwrapped row."""
    lines = [
        f"{'preset':<16}{'strategy':<10}{'GPUs':>5}{'batch/GPU':>11}{'tok/s/GPU':>11}{'tok/s all':>12}{'MFU':>7}"
        f"{'mem GB':>8}{'ms/step':>9}{'vs none':>9}"
    ]
    for r in rows:
        if r.error:
            lines.append(f"{r.preset:<16}{r.config:<10}{world_size:>5}  {r.error}")
            continue
        base = next((b for b in rows if b.preset == r.preset and b.config == "none" and b.tokens_per_s), None)
        ratio = f"{r.tokens_per_s / base.tokens_per_s:.3f}" if base else ""
        mfu = "n/a" if r.mfu is None else f"{100 * r.mfu:.1f}%"
        lines.append(
            f"{r.preset:<16}{r.config:<10}{world_size:>5}{f'{r.micro_batch}x{r.seq_len}':>11}"
            f"{r.tokens_per_s:>11,.0f}{r.tokens_per_s * world_size:>12,.0f}{mfu:>7}"
            f"{r.peak_mem_gb or 0:>8.1f}{r.step_ms:>9.1f}{ratio:>9}"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tinyllama-1.1b")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="2-block models on the CPU: a smoke run of this script (CI runs it)",
    )
    ap.add_argument("--out", help="JSON results (rank 0)")
    args = ap.parse_args()

    rank, local_rank, world, launched = read_env()
    rt = Runtime(rank, local_rank, world, print, launched)
    rt.start("cpu" if args.quick else "cuda", timeout_s=900)  # (without torchrun: a group of one)
    hw = detect() if not args.quick else detect_for("cpu")
    log = rt.log
    rows = []
    for preset in args.presets.split(","):
        model_cfg = bench_model_config(preset, quick=args.quick)
        model_cfg = dataclasses.replace(model_cfg, max_seq_len=max(model_cfg.max_seq_len, args.seq_len))
        fpt = flops_per_token(model_cfg, args.seq_len)
        batches = batch_source(model_cfg.vocab_size, hw.device)
        for strategy in args.strategies.split(","):
            row = Row(preset, strategy, args.micro_batch, args.seq_len, fpt)
            log(f"{preset}: {strategy} on {rt.world_size} GPU(s) ...")
            measure(case(strategy, model_cfg, hw, rt, args.micro_batch, args.seq_len, log), row, hw, batches,
                    args.warmup, args.windows, args.steps, 0)  # fmt: skip
            # every rank measured its own steps; rank 0 reports the slowest (the run goes at its pace)
            slowest = torch.tensor([row.step_ms or float("inf")], device=hw.device)
            rt.all_reduce(slowest, "max")
            if row.step_ms:
                row.step_ms = float(slowest.item())
                row.tokens_per_s = args.micro_batch * args.seq_len / (row.step_ms / 1000)
                row.mfu = row.tokens_per_s * fpt / hw.peak_16bit if hw.peak_16bit else None
            log(f"{preset}: {strategy}: {row.error or f'{row.tokens_per_s:,.0f} tokens/s per GPU'}")
            rows.append(row)
            if rt.is_main and args.out:  # after every row: a time-out loses only the row in flight
                record = {**provenance(" ".join(sys.argv)), "device": hw.name, "smoke": args.quick,
                          "world_size": rt.world_size, "rows": [dataclasses.asdict(r) for r in rows],
                          "table": table(rows, rt.world_size)}  # fmt: skip
                write_atomic(args.out, json.dumps(record, indent=1))
    if rt.is_main:
        smoke = ["SMOKE (--quick: 2-block models on the CPU): not a measurement"] if args.quick else []
        print("\n".join(["", *smoke, *table(rows, rt.world_size)]))
    rt.close()


if __name__ == "__main__":
    main()
