"""Benchmark (not a test): a CPU run's speed with glibc's default malloc beside the plan's allocator choice
(hopperlm/cpu_allocator.py: freed blocks kept for reuse), side by side in one invocation.

Each row is `hopperlm train configs/debug.yaml` (4.2M parameters at a 32K vocabulary; 16 x 64 tokens a step) in
its own process, because the switch is process-wide: "glibc default" runs with MALLOC_TRIM_THRESHOLD_=131072
(glibc's own default, set in the environment, which the plan then leaves alone), "hopperlm" without it. The
two alternate, in swapped order each window, on the same prepared data: Tiny Shakespeare under TinyLlama's
tokenizer (32,000 pieces: the logits are 131 MB a step) and as bytes (a 264-piece vocabulary: the control,
where no tensor is large). Measured per run: tokens/s between the first log line and the last (start-up,
the first steps and the final evaluation excluded), the process's peak memory as metrics.jsonl records it,
and the final validation loss (which must be the same in both rows: the allocator changes no number).

    python bench/cpu_allocator.py [--windows 5] [--steps 30] [--save bench/results/<date>-cpu-allocator-cpu.json]
    python bench/cpu_allocator.py --smoke   # 1 window of 4 steps, 32K vocabulary only: the script runs (CI)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from harness import DATA, REPO, hopperlm, metrics, save_result

TEXT = DATA / "tinyshakespeare" / "input.txt"
TOKENIZER = DATA / "tokenizers" / "tinyllama-1.1b-chat-v1.0" / "tokenizer.json"
ROWS = {"glibc default": {"MALLOC_TRIM_THRESHOLD_": "131072"}, "hopperlm": {}}
PLAN_LINE = {"glibc default": "allocator: as MALLOC_TRIM_THRESHOLD_", "hopperlm": "allocator: glibc keeps"}


def prepare(work: Path, env: dict[str, str], smoke: bool) -> dict[str, Path]:
    data = {"32K vocabulary": work / "shakespeare-tinyllama"}
    hopperlm(
        "prepare",
        str(TEXT),
        "--tokenizer",
        str(TOKENIZER),
        "--out",
        str(data["32K vocabulary"]),
        cwd=REPO,
        env=env,
    )
    if not smoke:
        data["byte vocabulary"] = work / "shakespeare-byte"
        hopperlm("prepare", str(TEXT), "--out", str(data["byte vocabulary"]), cwd=REPO, env=env)
    return data


def one_run(data: Path, row: str, steps: int, out: Path, env: dict[str, str]) -> dict:
    args = ["train", "configs/debug.yaml", "--data.path", str(data), "--run.out_dir", str(out)]
    args += [
        "--train.max_steps",
        str(steps),
        "--train.eval_every",
        str(steps),
        "--checkpoint.every",
        str(steps),
    ]
    args += ["--train.log_every", "2", "--train.eval_windows", "16", "--log.report", "false"]
    stdout = hopperlm(*args, cwd=REPO, env={**env, **ROWS[row]})
    if PLAN_LINE[row] not in stdout:  # the row is what it says, or the comparison means nothing
        sys.exit(f"{row}: the plan did not print '{PLAN_LINE[row]}...':\n{stdout[:3000]}")
    records = metrics(out)
    logged = [r for r in records if "tokens_per_s" in r]
    first, last = logged[0], logged[-1]
    return {
        "tokens_per_s": (last["tokens"] - first["tokens"]) / (last["elapsed_s"] - first["elapsed_s"]),
        "peak_mem_gb": max(r["peak_mem_gb"] for r in logged),
        "val_loss": [r["val_loss"] for r in records if "val_loss" in r][-1],
    }


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--windows", type=int, default=5, help="runs of each row per vocabulary (>= 5 for a claim)"
    )
    parser.add_argument("--steps", type=int, default=30, help="training steps of each run")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="1 window of 4 steps, the 32K vocabulary only: the script runs (CI)",
    )
    parser.add_argument("--save", help="write the rows and their provenance as JSON here")
    args = parser.parse_args()
    windows, steps = (1, 4) if args.smoke else (args.windows, args.steps)
    for path in (TEXT, TOKENIZER):
        if not path.is_file():
            sys.exit(f"{path} is missing: set HOPPERLM_DATA_DIR to the shared data folder")
    # one torch thread, as CI's test workers run: the rows compare allocators, not thread counts
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for name in ROWS["glibc default"]:
        env.pop(name, None)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for vocab, data in prepare(work, env, args.smoke).items():
            runs = {row: [] for row in ROWS}
            for window in range(windows):
                order = list(ROWS) if window % 2 == 0 else list(reversed(ROWS))
                for row in order:
                    runs[row].append(one_run(data, row, steps, work / f"{vocab}-{row}-{window}", env))
            for row, results in runs.items():
                rows.append(
                    {
                        "vocabulary": vocab,
                        "row": row,
                        "windows": len(results),
                        "steps": steps,
                        "tokens_per_s": spread([r["tokens_per_s"] for r in results]),
                        "peak_mem_gb": spread([r["peak_mem_gb"] for r in results]),
                        "val_loss": sorted({round(r["val_loss"], 6) for r in results}),
                    }
                )
    print(f"{'vocabulary':<16} {'row':<14} {'tokens/s median [min, max]':<30} {'peak GB':>8}  val loss")
    for r in rows:
        t, m = r["tokens_per_s"], r["peak_mem_gb"]
        line = f"{t['median']:,.0f} [{t['min']:,.0f}, {t['max']:,.0f}]"
        print(f"{r['vocabulary']:<16} {r['row']:<14} {line:<30} {m['median']:>8.2f}  {r['val_loss']}")
    ratios = {}
    for vocab in {r["vocabulary"]: None for r in rows}:
        by_row = {r["row"]: r for r in rows if r["vocabulary"] == vocab}
        ours, base = by_row["hopperlm"], by_row["glibc default"]
        ratios[vocab] = ours["tokens_per_s"]["median"] / base["tokens_per_s"]["median"]
        same = ours["val_loss"] == base["val_loss"]
        print(f"{vocab}: hopperlm / glibc default = {ratios[vocab]:.2f}x, same validation loss: {same}")
        if not same:
            sys.exit(
                f"{vocab}: the rows' validation losses differ ({ours['val_loss']} vs {base['val_loss']})"
            )
    if args.save:
        result = {"benchmark": "cpu_allocator", "smoke": args.smoke, "rows": rows, "ratios": ratios}
        save_result({**result, "command": " ".join(["python", *sys.argv])}, args.save)
        print(f"saved {args.save}")


if __name__ == "__main__":
    main()
