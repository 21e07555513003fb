"""Profile warm training steps of a preset as `hopperlm train` runs them and print where the GPU time goes.

    python3 bench/gpu/profile_step.py h100-350m --micro-batch 16 --seq-len 1024 --steps 5 --trace OUT.json.gz

Top CUDA kernels by time with a category each (hopperlm.observe.kernels.classify, as `hopperlm profile`),
the share of each category, and GPU-busy time against the wall time of the profiled steps (the rest is idle:
launch gaps or host work). The Chrome trace opens in chrome://tracing or Perfetto.
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import time

import torch

from hopperlm.bench import batch_source, bench_model_config, hopperlm_case
from hopperlm.hardware import detect_for
from hopperlm.observe.kernels import classify as category


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("preset")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--trace")
    p.add_argument("--set", action="append", default=[], help="train.* override KEY=VALUE")
    args = p.parse_args()
    overrides = {k: __import__("yaml").safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}
    hw = detect_for("auto")
    cfg = bench_model_config(args.preset, quick=False)
    case = hopperlm_case(
        "hopperlm", cfg, hw, args.micro_batch, args.seq_len, print, **{"fp8": "off", **overrides}
    )
    step, notes = case.build()
    x, y = batch_source(cfg.vocab_size, args.seq_len, hw.device)(0, args.micro_batch)
    for _ in range(args.warmup):
        step(x, y)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            step(x, y)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total, count = kernels.get(event.name, (0.0, 0))
            kernels[event.name] = (total + event.device_time, count + 1)  # microseconds
    busy = sum(t for t, _ in kernels.values()) / 1e6
    print(
        f"{args.preset} {args.micro_batch}x{args.seq_len} ({', '.join(notes)}): {args.steps} steps in {wall:.3f} s; "
    )
    print(f"GPU busy {busy:.3f} s = {busy / wall:.0%} of the wall time (the rest: launch gaps and host work)")
    shares = {}
    for name, (t, _) in kernels.items():
        shares[category(name)] = shares.get(category(name), 0.0) + t
    print(
        "by category: "
        + ", ".join(f"{k} {v / 1e6 / wall:.0%}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1]))
        + f", idle {1 - busy / wall:.0%}"
    )
    print(f"{'share':>6} {'ms/step':>8} {'calls':>6}  {'category':<18} kernel")
    for name, (t, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:25]:
        print(
            f"{t / 1e6 / wall:>6.1%} {t / 1e3 / args.steps:>8.2f} {n // args.steps:>6}  {category(name):<18} {name[:110]}"
        )
    if args.trace:
        raw = args.trace.removesuffix(".gz")
        prof.export_chrome_trace(raw)
        if args.trace.endswith(".gz"):
            with open(raw, "rb") as src, gzip.open(args.trace, "wb") as dst:
                shutil.copyfileobj(src, dst)


if __name__ == "__main__":
    main()
