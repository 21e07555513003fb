"""Benchmark (not a test): run `hopperlm demo` as a user would, start-up included, and report the validation
loss reached and the wall time against the CPU targets (< 1.88 nats/char within 120 s).

    python bench/cpu_demo.py [--runs 1] [--save bench/results/cpu-demo.json] [-- extra demo overrides]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from harness import REPO, hopperlm, metrics, save_result, val_losses

TARGET_LOSS, TARGET_SECONDS = 1.88, 120.0


def one_run(extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "demo"
        start = time.perf_counter()
        stdout = hopperlm("demo", "--out", str(run_dir), "--samples", "1", *extra, cwd=REPO)
        wall = time.perf_counter() - start
        records = metrics(run_dir)
        vals = [r["val_loss"] for r in val_losses(run_dir)]
        sample = stdout.split("--- samples ---", 1)[-1].strip().splitlines()[:6]
        return {
            "wall_s": round(wall, 1),
            "train_s": round(records[-1]["elapsed_s"], 1),
            "steps": records[-1]["step"],
            "tokens": records[-1]["tokens"],
            "final_val_loss": round(vals[-1], 4),
            "best_val_loss": round(min(vals), 4),
            "tokens_per_s": round(sum(r["tokens_per_s"] for r in records) / len(records)),
            "sample": sample,
        }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--save", help="write the results as JSON here")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    results = [one_run(extra) for _ in range(args.runs)]
    report = {"runs": results}
    for r in results:
        print("\n".join(r["sample"]))
    print(
        f"\n{'run':>4} {'wall s':>8} {'train s':>8} {'steps':>6} {'tok/s':>8} {'val loss':>9} {'target':>14}"
    )
    for i, r in enumerate(results):
        ok = r["final_val_loss"] < TARGET_LOSS and r["wall_s"] < TARGET_SECONDS
        print(
            f"{i:>4} {r['wall_s']:>8} {r['train_s']:>8} {r['steps']:>6} {r['tokens_per_s']:>8} "
            f"{r['final_val_loss']:>9} {'met' if ok else 'MISSED':>14}"
        )
    print(f"target: val loss < {TARGET_LOSS} nats/char within {TARGET_SECONDS:.0f} s wall, start-up included")
    if args.save:
        save_result(report, args.save)


if __name__ == "__main__":
    main()
