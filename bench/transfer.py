"""Does the best learning rate transfer across width? The same model at widths 64, 128, 256 and 512 (the same
depth, data and steps), an LR grid a factor of 2 apart, 2 seeds, under model.parametrization standard and mup,
with AdamW and with Muon (optim.muon_lr_adjust as --muon-adjust says), each run a real `hopperlm` training run.

    python3 bench/transfer.py --save bench/results/DATE-transfer-cpu.json        # ~40 min on 2 cores
    python3 bench/transfer.py --smoke --save /tmp/transfer-smoke.json             # seconds: CI runs it

Reports, per (parametrization, optimizer): the best LR at each width (lowest final validation loss, mean over
seeds), how many grid points it moves from width 64 to 512, and the loss at width 512 with width 64's best LR
against width 512's own best. Targets (issue 39): under mup the best LR moves at most one grid point and the
transferred LR is within 0.5% of the best loss; standard's drift is shown beside it. The JSON's `rows` hold
{parametrization, optimizer, width, params, lr, seed, final_val_loss} for every run, so anyone can recompute it.
Data: Gutenberg books from ../shared/data tokenized with a 1,024-piece BPE learned on them (prepared once in
--work). Runs go two at a time, one thread each.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("HOPPERLM_DATA_DIR") or REPO.parent / "shared" / "data")
BOOKS = (
    "pg01342_Pride_and_Prejudice.txt",
    "pg00036_The_War_of_the_Worlds.txt",
    "pg01661_The_Adventures_of_Sherlock_Holmes.txt",
)
FULL = {
    "widths": (64, 128, 256, 512),
    "lrs": tuple(5e-4 * 2**k for k in range(7)),  # 5e-4 ... 3.2e-2
    "seeds": (1, 2),
    "steps": 40,
}
SMOKE = {"widths": (32, 64), "lrs": (2e-3, 4e-3, 8e-3), "seeds": (1,), "steps": 3}
HEAD_DIM, BASE_DIM, LAYERS, SEQ, MICRO = 32, 64, 2, 64, 8


def prepare_data(work: Path, smoke: bool) -> Path:
    """A 1,024-piece BPE learned on the books, and the books prepared with it (once per --work)."""
    from hopperlm.data.prepare import PrepareOptions, prepare
    from hopperlm.data.tokenizer_train import corpus_texts, train_tokenizer

    out = work / ("data-smoke" if smoke else "data")
    if (out / "manifest.json").is_file():
        return out
    books = [DATA / "gutenberg" / b for b in BOOKS[: 1 if smoke else len(BOOKS)]]
    missing = [str(b) for b in books if not b.is_file()]
    if missing:
        raise SystemExit(f"transfer.py: missing {', '.join(missing)} (../shared/data/gutenberg)")
    tokenizer = train_tokenizer(corpus_texts(books), "bpe", 1024)
    tokenizer.save(work / "tok")
    prepare(books, out, PrepareOptions(tokenizer=str(work / "tok")), progress=False)
    return out


def run_one(spec: dict) -> dict:
    """One training run (in a worker process, one thread): its final validation loss."""
    import torch

    torch.set_num_threads(1)
    from hopperlm.config import config_from_dict
    from hopperlm.model.transformer import count_params
    from hopperlm.train.loop import train

    width, mup = spec["width"], spec["parametrization"] == "mup"
    model = {"dim": width, "n_layers": LAYERS, "n_heads": width // HEAD_DIM, "max_seq_len": SEQ,
             "parametrization": spec["parametrization"], **({"base_dim": BASE_DIM} if mup else {})}  # fmt: skip
    cfg = config_from_dict(
        {
            "model": model,
            "data": {"path": spec["data"]},
            "optim": {
                "name": spec["optimizer"],
                "lr": spec["lr"],
                "warmup_steps": max(1, spec["steps"] // 10),
                "schedule": "cosine",
                "min_lr_ratio": 0.0,
                "weight_decay": 0.0,
                "muon_lr_adjust": spec["muon_adjust"],
            },  # fmt: skip
            "train": {
                "seq_len": SEQ,
                "micro_batch": MICRO,
                "max_steps": spec["steps"],
                "seed": spec["seed"],
                "eval_every": 0,
                "eval_windows": 32,
                "log_every": spec["steps"],
                "device": "cpu",
                "compile": False,
            },  # fmt: skip
            "checkpoint": {"every": 0},
            "log": {"report": False, "tensorboard": False},
            "run": {"out_dir": spec["out_dir"]},
        }
    )
    t0 = time.monotonic()
    result = train(cfg, log=lambda line: None)
    loss = result.val_loss if result.val_loss is not None and math.isfinite(result.val_loss) else None
    keys = ("parametrization", "optimizer", "width", "lr", "seed")
    return {**{k: spec[k] for k in keys}, "params": count_params(cfg.model)["total"], "final_val_loss": loss,
            "seconds": round(time.monotonic() - t0, 1)}  # fmt: skip


def analyse(rows: list[dict], widths, lrs) -> dict:
    """Best LR per width, its drift in grid points from the narrowest to the widest, and the transfer gap."""
    out = {}
    for key in sorted({(r["parametrization"], r["optimizer"]) for r in rows}):
        sel = [r for r in rows if (r["parametrization"], r["optimizer"]) == key]

        def mean(width, lr, sel=sel):
            v = [r["final_val_loss"] for r in sel if r["width"] == width and r["lr"] == lr]
            return statistics.fmean(v) if v and all(x is not None for x in v) else math.inf

        best = {w: min(lrs, key=lambda lr, w=w: mean(w, lr)) for w in widths}
        narrow, wide = widths[0], widths[-1]
        own, moved = mean(wide, best[wide]), mean(wide, best[narrow])
        out["/".join(key)] = {
            "best_lr": {str(w): best[w] for w in widths},
            "drift_grid_points": round(math.log2(best[wide] / best[narrow])),
            "wide_loss_own_best": own,
            "wide_loss_transferred": moved,
            "transfer_gap": moved / own - 1 if math.isfinite(own) and math.isfinite(moved) else None,
        }
    return out


def table(summary: dict, widths) -> list[str]:
    lines = [f"{'parametrization/optimizer':<28}" + "".join(f"{'best@' + str(w):>11}" for w in widths)
             + f"{'drift':>7}{'loss@' + str(widths[-1]) + ' own':>15}{'transferred':>13}{'gap':>8}"]  # fmt: skip
    for key, s in summary.items():
        gap = f"{100 * s['transfer_gap']:+.2f}%" if s["transfer_gap"] is not None else "n/a"
        lines.append(
            f"{key:<28}" + "".join(f"{s['best_lr'][str(w)]:>11.2g}" for w in widths)
            + f"{s['drift_grid_points']:>+7d}{s['wide_loss_own_best']:>15.4f}{s['wide_loss_transferred']:>13.4f}{gap:>8}"
        )  # fmt: skip
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save", help="write the rows and the summary as JSON here")
    p.add_argument(
        "--smoke", action="store_true", help="2 tiny widths, 3 LRs, 3 steps: a test of this script"
    )
    p.add_argument("--work", default="/tmp/hopperlm-transfer", help="data and runs (kept for a rerun)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--muon-adjust", default="match_rms_adamw", choices=("match_rms_adamw", "spectral"))
    p.add_argument("--optimizers", default="adamw,muon")
    args = p.parse_args()
    grid = SMOKE if args.smoke else FULL
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = prepare_data(work, args.smoke)
    specs = [
        {
            "parametrization": par,
            "optimizer": opt,
            "width": w,
            "lr": lr,
            "seed": seed,
            "steps": grid["steps"],
            "data": str(data),
            "muon_adjust": args.muon_adjust,
            "out_dir": str(work / "runs" / f"{par}-{opt}-{args.muon_adjust}-w{w}-lr{lr:.3g}-s{seed}"),
        }  # fmt: skip
        for par in ("standard", "mup")
        for opt in args.optimizers.split(",")
        for w in grid["widths"]
        for lr in grid["lrs"]
        for seed in grid["seeds"]
    ]
    print(f"transfer: {len(specs)} runs, {args.jobs} at a time", flush=True)
    t0 = time.monotonic()
    rows = []
    partial = Path(args.save).with_suffix(".partial.json") if args.save else None
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for row in pool.map(run_one, specs):
            rows.append(row)
            print(json.dumps(row), flush=True)
            if partial is not None:  # every finished run kept, should the benchmark be cut short
                from hopperlm.files import write_atomic

                write_atomic(partial, json.dumps({"rows": rows}, indent=1))
    summary = analyse(rows, grid["widths"], grid["lrs"])
    lines = table(summary, grid["widths"])
    record = {"smoke": args.smoke, "grid": {k: list(v) if isinstance(v, tuple) else v for k, v in grid.items()},
              "muon_lr_adjust": args.muon_adjust, "layers": LAYERS, "seq_len": SEQ, "micro_batch": MICRO,
              "base_dim": BASE_DIM, "books": list(BOOKS), "minutes": round((time.monotonic() - t0) / 60, 1),
              "rows": rows, "summary": summary, "table": lines}  # fmt: skip
    if args.save:
        from hopperlm.provenance import save_result

        save_result(record, args.save)
        partial.unlink(missing_ok=True)
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
