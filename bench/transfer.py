"""Does the best learning rate transfer across width? The same model at widths 64, 128, 256 and 512 (the same
depth, data and steps), an LR grid a factor of 2 apart, 2 seeds, under model.parametrization standard and mup,
with AdamW and with Muon (muon.lr_adjust as --muon-adjust says), each run a real `hopperlm` training run.
With --depth, across depth instead: 2, 4, 8 and 16 blocks at width 64 (μP at its base width), 200 steps,
model.depth_parametrization standard against completep (base_depth 2), each optimizer on its own LR grid.

    python3 bench/transfer.py --save bench/results/DATE-transfer-cpu.json        # ~40 min on 2 cores
    python3 bench/transfer.py --smoke --save /tmp/transfer-smoke.json             # seconds: CI runs it
    python3 bench/transfer.py --depth --save bench/results/DATE-transfer-depth-cpu.json [--resume]
    python3 bench/transfer.py --depth --smoke --save /tmp/transfer-depth-smoke.json

Reports, per (parametrization, optimizer): the best LR at each width (lowest final validation loss, mean over
seeds), how many grid points it moves from width 64 to 512, and the loss at width 512 with width 64's best LR
against width 512's own best. Targets (issue 39): under mup the best LR moves at most one grid point and the
transferred LR is within 0.5% of the best loss; standard's drift is shown beside it. The JSON's `rows` hold
{parametrization, optimizer, width, params, lr, seed, steps, final_val_loss} for every run, so anyone can recompute it;
--depth's {depth_parametrization, optimizer, n_layers, width, params, lr, seed, steps, final_val_loss}, the same
summary from 2 to 16 blocks (targets, issue 51: at most one grid point, within 1%). Every finished run is kept in
SAVE.partial.json as it ends; --resume skips the runs found there (or, where there is none, in SAVE itself: a
benchmark run in parts keeps every part's rows).
Data: Gutenberg books from ../shared/data tokenized with a 1,024-piece BPE learned on them (prepared once in
--work). Runs go two at a time, one thread each.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from harness import DATA, at_grid_edge, run_config, save_result, train_here
from harness import prepare_data as prepare_shards

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
# across depth: one width (μP at its base width: only depth changes), an LR grid per optimizer around its optimum
DEPTH_FULL = {
    "depths": (2, 4, 8, 16),
    "lrs": {"adamw": tuple(1e-3 * 2**k for k in range(7)), "muon": tuple(2e-3 * 2**k for k in range(7))},
    "seeds": (1, 2),
    "steps": 200,
}
DEPTH_SMOKE = {
    "depths": (1, 2),
    "lrs": {"adamw": (2e-3, 8e-3), "muon": (4e-3, 1.6e-2)},
    "seeds": (1,),
    "steps": 3,
}
DEPTH_WIDTH, BASE_DEPTH = 64, 2
RUN_KEYS = {"width": ("parametrization", "optimizer", "width", "lr", "seed", "steps"),
            "n_layers": ("depth_parametrization", "optimizer", "n_layers", "width", "lr", "seed", "steps")}  # fmt: skip


def prepare_data(work: Path, smoke: bool) -> Path:
    """A 1,024-piece BPE learned on the books, and the books prepared with it (once per --work)."""
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
    return prepare_shards(out, books, tokenizer=str(work / "tok"))


def run_one(spec: dict) -> dict:
    """One training run (in a worker process, one thread): its final validation loss."""
    from hopperlm.config import config_from_dict
    from hopperlm.model.transformer import count_params

    width, mup = spec["width"], spec["parametrization"] == "mup"
    depth = spec.get("depth_parametrization", "standard")
    model = {"dim": width, "n_layers": spec.get("n_layers", LAYERS), "n_heads": width // HEAD_DIM,
             "max_seq_len": SEQ, "parametrization": spec["parametrization"],
             **({"base_dim": spec.get("base_dim", BASE_DIM)} if mup else {}), "depth_parametrization": depth,
             **({"base_depth": BASE_DEPTH} if depth == "completep" else {})}  # fmt: skip
    cfg = run_config(
        model=model,
        data=spec["data"],
        optim={"name": spec["optimizer"], "lr": spec["lr"], "weight_decay": 0.0, **group_lrs(spec)},
        muon={"lr_adjust": spec["muon_adjust"]} if spec["optimizer"] == "muon" else None,
        schedule={"warmup_steps": max(1, spec["steps"] // 10), "name": "cosine", "min_lr_ratio": 0.0},
        train={
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
        quiet=True,
        out_dir=spec["out_dir"],
    )
    shutil.rmtree(spec["out_dir"], ignore_errors=True)  # a run of an earlier, interrupted benchmark
    t0 = time.monotonic()
    keys = RUN_KEYS["n_layers" if "n_layers" in spec else "width"]
    row = {**{k: spec[k] for k in keys}, "params": count_params(config_from_dict(cfg).model)["total"]}
    try:
        result = train_here(cfg)
    except Exception as e:  # one failed run is a row without a loss, not the end of the benchmark
        return {**row, "final_val_loss": None, "error": f"{type(e).__name__}: {e}"[:300]}
    loss = result.val_loss if result.val_loss is not None and math.isfinite(result.val_loss) else None
    return {**row, "final_val_loss": loss, "seconds": round(time.monotonic() - t0, 1)}


def analyse(rows: list[dict], widths, axis: str = "width") -> dict:
    """Best LR per width (per depth with axis "n_layers"), its drift in grid points from the narrowest to the
    widest, and the transfer gap. Each (parametrization, optimizer)'s grid is the LRs its runs trained with."""
    out = {}
    kind = "parametrization" if axis == "width" else "depth_parametrization"
    for key in sorted({(r[kind], r["optimizer"]) for r in rows}):
        sel = [r for r in rows if (r[kind], r["optimizer"]) == key]
        grid = sorted({r["lr"] for r in sel})

        def mean(width, lr, sel=sel):
            v = [r["final_val_loss"] for r in sel if r[axis] == width and r["lr"] == lr]
            return statistics.fmean(v) if v and all(x is not None for x in v) else math.inf

        best = {w: min(grid, key=lambda lr, w=w: mean(w, lr)) for w in widths}
        narrow, wide = widths[0], widths[-1]
        own, moved = mean(wide, best[wide]), mean(wide, best[narrow])
        out["/".join(key)] = {
            "best_lr": {str(w): best[w] for w in widths},
            # a best LR on the grid's edge may not be the optimum: the grid needs extending there (--lrs)
            "at_grid_edge": [w for w in widths if at_grid_edge(grid, best[w])],
            "drift_grid_points": round(math.log2(best[wide] / best[narrow])),
            "wide_loss_own_best": own,
            "wide_loss_transferred": moved,
            "transfer_gap": moved / own - 1 if math.isfinite(own) and math.isfinite(moved) else None,
        }
    return out


def table(summary: dict, widths, axis: str = "width") -> list[str]:
    head = "parametrization/optimizer" if axis == "width" else "depth parametrization/optim."
    unit = "" if axis == "width" else "L"
    lines = [f"{head:<28}" + "".join(f"{'best@' + unit + str(w):>11}" for w in widths)
             + f"{'drift':>7}{'loss@' + unit + str(widths[-1]) + ' own':>15}{'transferred':>13}{'gap':>8}"]  # fmt: skip
    for key, s in summary.items():
        gap = f"{100 * s['transfer_gap']:+.2f}%" if s["transfer_gap"] is not None else "n/a"
        lines.append(
            f"{key:<28}"
            + "".join(f"{s['best_lr'][str(w)]:>10.2g}" + ("*" if w in s.get("at_grid_edge", ()) else " ") for w in widths)
            + f"{s['drift_grid_points']:>+7d}{s['wide_loss_own_best']:>15.4f}{s['wide_loss_transferred']:>13.4f}{gap:>8}"
        )  # fmt: skip
    if any(s.get("at_grid_edge") for s in summary.values()):
        lines.append("* the best LR is on the grid's edge: the optimum may lie beyond it")
    return lines


def group_lrs(spec: dict) -> dict:
    """The embedding and the head at the spec's multiples of its LR (--group-lrs) as rows of optim.groups, else
    nothing. (Each multiple is written as its absolute LR over the LR, as the runs before optim.groups set it,
    so the rows files stay comparable bit for bit.)"""
    ratios, lr = spec.get("group_lrs"), spec["lr"]
    if not ratios:
        return {}
    return {"groups": [{"pattern": "embed.weight", "lr": ratios[0] * lr / lr},
                       {"pattern": "lm_head.weight", "lr": ratios[1] * lr / lr}]}  # fmt: skip


def run_specs(args, data: Path, work: Path) -> tuple[list[dict], dict]:
    """Every run of the benchmark (width or depth), and its grid."""
    if args.depth:
        grid = dict(DEPTH_SMOKE if args.smoke else DEPTH_FULL)
        if args.steps is not None:
            grid["steps"] = args.steps
        if args.lrs:
            grid["lrs"] = {opt: tuple(args.lrs) for opt in grid["lrs"]}
        specs = [
            {"parametrization": "mup", "base_dim": DEPTH_WIDTH, "depth_parametrization": par, "optimizer": opt,
             "n_layers": depth, "width": DEPTH_WIDTH, "lr": lr, "seed": seed, "steps": grid["steps"], "data": str(data),
             "muon_adjust": args.muon_adjust,
             "out_dir": str(work / "runs" / f"depth-{par}-{opt}-L{depth}-lr{lr:.3g}-s{seed}-{grid['steps']}")}
            for par in ("standard", "completep")
            for opt in args.optimizers.split(",")
            for depth in grid["depths"]
            for lr in grid["lrs"][opt]
            for seed in grid["seeds"]
        ]  # fmt: skip
        return specs, grid
    grid = dict(SMOKE if args.smoke else FULL)
    if args.steps is not None:  # a longer horizon: 40 steps show the optimum's position, not its value
        grid["steps"] = args.steps
    if args.lrs:
        grid["lrs"] = tuple(args.lrs)
    groups = "" if not args.group_lrs else "-g{:g}x{:g}".format(*args.group_lrs)
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
            "group_lrs": args.group_lrs,
            "out_dir": str(
                work
                / "runs"
                / f"{par}-{opt}-{args.muon_adjust}{groups}-w{w}-lr{lr:.3g}-s{seed}-{grid['steps']}"
            ),
        }  # fmt: skip
        for par in args.parametrizations.split(",")
        for opt in args.optimizers.split(",")
        for w in grid["widths"]
        for lr in grid["lrs"]
        for seed in grid["seeds"]
    ]
    return specs, grid


def read_earlier(path: str, depth: bool) -> dict:
    """An earlier result to print beside this one: it must be the same benchmark (width or depth)."""
    try:
        earlier = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(
            f"transfer.py: --compare {path}: cannot read it ({e}); give a JSON this script saved"
        ) from None
    if "summary" not in earlier or ("depths" in earlier.get("grid", {})) != depth:
        what = "across depth (--depth)" if depth else "across width"
        raise SystemExit(
            f"transfer.py: --compare {path} is not a transfer result {what}; give one saved by the same mode"
        )
    return earlier


def side_by_side(earlier: dict, now: dict, axis: str) -> list[str]:
    """Drift and transfer gap at the earlier horizon next to this one's, per (parametrization, optimizer)."""
    a, b = earlier["grid"]["steps"], now["grid"]["steps"]
    lines = [
        "",
        f"{'horizon':<28}{'best@narrow':>12}{'best@wide':>12}{'drift':>7}{'gap':>9}   ({a} steps, then {b})",
    ]
    for key in sorted(set(earlier["summary"]) | set(now["summary"])):
        for steps, summary in ((a, earlier["summary"]), (b, now["summary"])):
            s = summary.get(key)
            if s is None:
                lines.append(f"{key + f' @{steps}':<28}{'not run':>12}")
                continue
            best = list(s["best_lr"].values())  # narrowest (shallowest) first, as analyse() writes them
            gap = f"{100 * s['transfer_gap']:+.2f}%" if s["transfer_gap"] is not None else "n/a"
            lines.append(f"{key + f' @{steps}':<28}{best[0]:>12.2g}{best[-1]:>12.2g}"
                         f"{s['drift_grid_points']:>+7d}{gap:>9}")  # fmt: skip
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save", help="write the rows and the summary as JSON here")
    p.add_argument(
        "--smoke", action="store_true", help="2 tiny widths, 3 LRs, 3 steps: a test of this script"
    )
    p.add_argument("--depth", action="store_true", help="across depth (2-16 blocks) instead of width")
    p.add_argument(
        "--resume", action="store_true", help="skip the runs SAVE.partial.json (or SAVE) already holds"
    )
    p.add_argument("--work", default="/tmp/hopperlm-transfer", help="data and runs (kept for a rerun)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--muon-adjust", default="match_rms_adamw", choices=("match_rms_adamw", "spectral"))
    p.add_argument("--optimizers", default="adamw,muon")
    p.add_argument(
        "--group-lrs", type=lambda t: tuple(float(x) for x in t.split(",")), metavar="EMBED,HEAD",
        help="train the embedding and the head at these multiples of each run's LR (rows of optim.groups)",
    )  # fmt: skip
    p.add_argument(
        "--parametrizations",
        default="standard,mup",
        help="across width: which of standard,mup to run (under standard the two Muon rules are the same runs)",
    )
    p.add_argument("--steps", type=int, help="steps per run (default: 40 across width, 200 across depth)")
    p.add_argument(
        "--lrs",
        type=lambda text: sorted(float(v) for v in text.split(",")),
        help="the LR grid, comma-separated (default: 5e-4 ... 3.2e-2 across width; per optimizer across depth)",
    )
    p.add_argument(
        "--compare",
        metavar="EARLIER.json",
        help="an earlier result of the same grid at another horizon: its table is printed and kept beside this one",
    )
    args = p.parse_args()
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps {args.steps}: give at least 1 step")
    earlier = read_earlier(args.compare, args.depth) if args.compare else None
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = prepare_data(work, args.smoke)
    specs, grid = run_specs(args, data, work)
    axis = "n_layers" if args.depth else "width"
    keys = RUN_KEYS[axis]
    partial = Path(args.save).with_suffix(".partial.json") if args.save else None
    rows = []
    # what an earlier invocation finished: its partial file, else the result it saved (a benchmark run in parts,
    # each part naming other parametrizations, optimizers or LRs, ends with every part's rows in SAVE)
    earlier_rows = next((f for f in (partial, Path(args.save or "")) if f is not None and f.is_file()), None)
    if args.resume and earlier_rows is not None:
        rows = json.loads(earlier_rows.read_text())["rows"]
        done = {tuple(r[k] for k in keys) for r in rows}
        specs = [s for s in specs if tuple(s[k] for k in keys) not in done]
    print(f"transfer: {len(specs)} runs ({len(rows)} kept from before), {args.jobs} at a time", flush=True)
    t0 = time.monotonic()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for future in as_completed([pool.submit(run_one, spec) for spec in specs]):
            rows.append(future.result())
            print(json.dumps(rows[-1]), flush=True)
            if partial is not None:  # every finished run kept, should the benchmark be cut short
                from hopperlm.files import write_atomic

                write_atomic(partial, json.dumps({"rows": rows}, indent=1))
    sizes = grid["depths"] if args.depth else grid["widths"]
    rows.sort(key=lambda r: tuple(r[k] for k in keys))
    summary = analyse(rows, sizes, axis)
    lines = table(summary, sizes, axis)
    setting = ({"width": DEPTH_WIDTH, "base_dim": DEPTH_WIDTH, "base_depth": BASE_DEPTH} if args.depth
               else {"layers": LAYERS, "base_dim": BASE_DIM})  # fmt: skip
    record = {"smoke": args.smoke, "grid": json.loads(json.dumps(grid)), "muon_lr_adjust": args.muon_adjust,
              **setting, "seq_len": SEQ, "micro_batch": MICRO, "books": list(BOOKS),
              "minutes": round((time.monotonic() - t0) / 60, 1), "rows": rows, "summary": summary, "table": lines}  # fmt: skip
    if earlier is not None:
        lines += side_by_side(earlier, record, axis)
        record["compared_with"] = {"file": args.compare, "steps": earlier["grid"]["steps"]}
        record["table"] = lines
    if args.save:
        save_result(record, args.save)
        partial.unlink(missing_ok=True)
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
