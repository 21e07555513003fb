"""What a proxy of a recipe costs per step against the recipe: FLOPs per token (flops_per_token, 6N + 12LdT) and one
optimizer step timed here through the step training runs (hopperlm/bench_rows.py's hopperlm_case and bench.py's
measure, which call train/step.py's train_step), for the recipe, its width-D proxy at the recipe's depth (what μP
alone allows) and its width-D, L-block proxy (what CompleteP allows: `hopperlm sweep RECIPE --dim D --depth L`).

    python3 bench/proxy_cost.py --save bench/results/DATE-proxy-cost-cpu.json     # owt-350m-h100 at 256 x 4
    python3 bench/proxy_cost.py --smoke                                           # seconds: CI runs it

Every row is model.depth_parametrization completep with base_depth the recipe's n_layers (at its own depth the
recipe trains exactly as under standard; tests/test_completep.py), the recipe's context and vocabulary (--vocab:
the recipe's data is not prepared here; random tokens), one sequence a step on this machine: a CPU's time is its
own, not an H100's, and says how the proxies compare, not what they cost there. The optimizer is AdamW unless
--optimizer recipe: Muon's Newton-Schulz runs once a step whatever the batch, so at one sequence a step on a CPU
it would be most of the time (about 100 s a step for owt-350m's 168 matrices on one core, against about 10 s for
the forward and backward), where the recipe's 262K-token steps make it a small share.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from hopperlm.bench import Row, batch_source, measure
from hopperlm.bench_rows import hopperlm_case
from hopperlm.config import ModelConfig, load_config
from hopperlm.hardware import detect
from hopperlm.model.transformer import count_params, flops_per_token
from hopperlm.train.sweep import proxy_overrides

REPO = Path(__file__).resolve().parents[1]


def model_configs(
    recipe: Path, overrides: list[str], *, vocab: int, dim: int, depth: int
) -> list[tuple[str, ModelConfig]]:
    """(label, model section) of the recipe, its width-`dim` proxy and its width-`dim`, `depth`-block proxy."""
    base = load_config(recipe, overrides).model
    completep = [*overrides, "--model.vocab_size", str(vocab), "--model.depth_parametrization", "completep",
                 "--model.base_depth", str(base.n_layers)]  # fmt: skip
    target = load_config(recipe, completep).model
    out = [("recipe", target)]
    for label, proxy in ((f"{dim} x {base.n_layers}", proxy_overrides(target, dim)),
                         (f"{dim} x {depth}", proxy_overrides(target, dim, depth))):  # fmt: skip
        out.append((label, load_config(recipe, completep + proxy).model))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default=str(REPO / "configs" / "owt-350m-h100.yaml"))
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000, help="the recipe's vocabulary (its data's)")
    p.add_argument("--steps", type=int, default=1, help="optimizer steps per timed window")
    p.add_argument("--windows", type=int, default=3, help="timed windows; the median counts")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "recipe"), help="the timed optimizer")
    p.add_argument("--save", help="the rows as JSON")
    p.add_argument("--smoke", action="store_true", help="configs/debug.yaml at 32 x 1: a test of this script")
    args = p.parse_args()
    overrides = []
    if args.smoke:  # debug.yaml under μP (width 64 over base 32), its proxy 32 wide and 1 block deep
        args.recipe, args.dim, args.depth, args.vocab = str(REPO / "configs" / "debug.yaml"), 32, 1, 256
        args.windows, overrides = 1, ["--model.parametrization", "mup", "--model.base_dim", "32"]
    recipe = Path(args.recipe)
    cfg = load_config(recipe, overrides)
    seq, hw = cfg.train.seq_len, detect()
    name = cfg.optim.name if args.optimizer == "recipe" else "adamw"
    sections = {"optim": {"name": name, "lr": cfg.optim.lr}}
    if name == "muon":  # the recipe's Muon settings (its muon section is read only by Muon)
        sections["muon"] = dataclasses.asdict(cfg.muon)
    rows = []
    for label, model in model_configs(recipe, overrides, vocab=args.vocab, dim=args.dim, depth=args.depth):
        model = dataclasses.replace(model, max_seq_len=max(model.max_seq_len, seq))
        fpt = flops_per_token(model, seq)
        case = hopperlm_case(label, model, hw, 1, seq, lambda line: None, sections, compile=False)
        row = Row(recipe.stem, label, 1, seq, fpt)
        measure(case, row, hw, batch_source(args.vocab, hw.device), 1, args.windows, args.steps, 0)
        if row.error:
            raise SystemExit(f"proxy_cost.py: {label}: {row.error}")
        rows.append({"config": label, "dim": model.dim, "n_layers": model.n_layers,
                     "params": count_params(model)["total"], "flops_per_token": fpt, "step_ms": row.step_ms,
                     "tokens_per_s": row.tokens_per_s, "notes": row.notes})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    recipe_row = rows[0]
    lines = [f"{'config':<12}{'params':>13}{'GFLOP/token':>13}{'x recipe':>10}{'s/step':>9}{'x recipe':>10}"]
    for r in rows:
        r["flops_vs_recipe"] = r["flops_per_token"] / recipe_row["flops_per_token"]
        r["time_vs_recipe"] = r["step_ms"] / recipe_row["step_ms"]
        lines.append(f"{r['config']:<12}{r['params']:>13,}{r['flops_per_token'] / 1e9:>13.4f}"
                     f"{r['flops_vs_recipe']:>10.3f}{r['step_ms'] / 1000:>9.2f}{r['time_vs_recipe']:>10.3f}")  # fmt: skip
    print("\n".join(lines))
    if args.save:
        from hopperlm.provenance import save_result

        record = {"recipe": str(recipe), "seq_len": seq, "micro_batch": 1, "vocab": args.vocab,
                  "device": str(hw.device), "optimizer": sections, "rows": rows, "table": lines}  # fmt: skip
        save_result(record, args.save)


if __name__ == "__main__":
    main()
