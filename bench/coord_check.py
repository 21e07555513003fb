"""The coordinate check (Yang et al. 2022; Microsoft's `mup` package made it the test of a parametrization): train
the same model at widths 64 to 1024 for a few steps at one learning rate and measure, after them, the RMS of the
last block's output (activations), of its attention logits and of the output logits. Under μP every curve is
flat in width; under the standard parametrization they grow, which is why the best LR moves as a model widens.
With --depth, the same across depth (CompleteP's Figure 7): width 128 under μP at its base width, 2 to 32 blocks,
model.depth_parametrization standard against completep (base_depth 2), and also the RMS of the training's change
of the last block's output (activation updates): under completep flat in depth, under standard growing.

    python3 bench/coord_check.py --out bench/results/DATE-coord-check.png [--save FILE.json]
    python3 bench/coord_check.py --depth --out bench/results/DATE-coord-check-depth.png [--save FILE.json]
    python3 bench/coord_check.py --depth --smoke --out /tmp/coord-depth.png     # seconds: CI runs it

Width grows by heads of 32 (head_dim fixed), 2 blocks, a 512-token vocabulary, random tokens (the same batch at
every width), AdamW and Muon, model.base_dim 64. tests/test_mup.py runs `coordinates` at three widths,
tests/test_completep.py at three depths.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hopperlm.config import ModelConfig, OptimConfig, ParamGroupConfig
from hopperlm.model.transformer import build_model
from hopperlm.train.optim import build_optimizer, set_lr

WIDTHS = (64, 128, 256, 512, 1024)
HEAD_DIM, BASE_DIM, VOCAB, SEQ, BATCH = 32, 64, 512, 64, 8
QUANTITIES = ("activations", "attention logits", "output logits", "activation updates")
DEPTHS, DEPTH_WIDTH, BASE_DEPTH = (2, 4, 8, 16, 32), 128, 2
SMOKE_DEPTHS = (2, 4)


def rms(t: torch.Tensor) -> float:
    return t.float().pow(2).mean().sqrt().item()


def coordinates(
    parametrization: str,
    width: int,
    *,
    optimizer: str = "adamw",
    lr: float = 3e-3,
    steps: int = 5,
    depth: int = 2,
    depth_parametrization: str = "standard",
    base_dim: int = BASE_DIM,
    group_lrs: tuple[float, float] | None = None,
) -> dict:
    """RMS of the last block's output, its attention logits and the output logits after `steps` steps, and of the
    change of the last block's output over them (on the same batch). `group_lrs`: the embedding and the head
    at these multiples of `lr` (rows of optim.groups)."""
    completep = depth_parametrization == "completep"
    cfg = ModelConfig(
        dim=width,
        n_layers=depth,
        n_heads=width // HEAD_DIM,
        vocab_size=VOCAB,
        max_seq_len=SEQ,
        parametrization=parametrization,
        base_dim=base_dim if parametrization == "mup" else None,
        depth_parametrization=depth_parametrization,
        base_depth=BASE_DEPTH if completep else None,
    )
    model = build_model(cfg, seed=0)
    groups = [] if group_lrs is None else [ParamGroupConfig("embed.weight", lr=group_lrs[0]),
                                           ParamGroupConfig("lm_head.weight", lr=group_lrs[1])]  # fmt: skip
    opt = build_optimizer(
        model, OptimConfig(lr=lr, weight_decay=0.0, groups=groups), fused=False, name=optimizer
    )
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    seen = {}
    last = model.layers[-1]
    last.attn.q_proj.register_forward_hook(lambda m, i, out: seen.__setitem__("q", out))
    last.attn.k_proj.register_forward_hook(lambda m, i, out: seen.__setitem__("k", out))
    last.register_forward_hook(lambda m, i, out: seen.__setitem__("x", out))
    with torch.no_grad():
        model(tokens[:, :-1])
        before = seen["x"]  # (B, T, d)
    for _ in range(steps):
        set_lr(opt, lr)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = model(tokens[:, :-1])  # (B, T, V)
        q = seen["q"].view(BATCH, SEQ, -1, HEAD_DIM).transpose(1, 2)  # (B, nh, T, hd), before RoPE
        k = seen["k"].view(BATCH, SEQ, -1, HEAD_DIM).transpose(1, 2)
        attention = q @ k.transpose(-1, -2) / HEAD_DIM**0.5  # (B, nh, T, T)
    return {
        "activations": rms(seen["x"]),
        "attention logits": rms(attention),
        "output logits": rms(logits),
        "activation updates": rms(seen["x"] - before),
    }


def measure(depth_mode: bool, lr: float, smoke: bool) -> list[dict]:
    """Every (optimizer, parametrization, size) row: across width (mup against standard) or, `depth_mode`,
    across depth (completep against standard, under μP at its base width)."""
    rows = []
    for optimizer in ("adamw", "muon"):
        if depth_mode:
            for depth_parametrization in ("standard", "completep"):
                for depth in SMOKE_DEPTHS if smoke else DEPTHS:
                    row = coordinates("mup", DEPTH_WIDTH, optimizer=optimizer, lr=lr, depth=depth,
                                      depth_parametrization=depth_parametrization, base_dim=DEPTH_WIDTH)  # fmt: skip
                    rows.append({"optimizer": optimizer, "parametrization": depth_parametrization,
                                 "n_layers": depth, **row})  # fmt: skip
                    print(json.dumps(rows[-1]), flush=True)
            continue
        for parametrization in ("standard", "mup"):
            for width in WIDTHS[:2] if smoke else WIDTHS:
                row = coordinates(parametrization, width, optimizer=optimizer, lr=lr)
                rows.append(
                    {"optimizer": optimizer, "parametrization": parametrization, "width": width, **row}
                )
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the plot (PNG)")
    p.add_argument("--save", help="the numbers (JSON)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--depth", action="store_true", help="across depth 2-32: completep against standard")
    p.add_argument("--smoke", action="store_true", help="two sizes only: a test of this script")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = measure(args.depth, args.lr, args.smoke)
    axis = "n_layers" if args.depth else "width"
    kinds = ("standard", "completep") if args.depth else ("standard", "mup")
    shown = ("activations", "activation updates", "output logits") if args.depth else QUANTITIES[:3]
    fig, axes = plt.subplots(2, 3, figsize=(13, 7), sharex=True)
    for r, optimizer in enumerate(("adamw", "muon")):
        for c, quantity in enumerate(shown):
            ax = axes[r][c]
            for kind, style in zip(kinds, ("o-", "s-"), strict=True):
                sel = [x for x in rows if x["optimizer"] == optimizer and x["parametrization"] == kind]
                ax.plot([x[axis] for x in sel], [x[quantity] for x in sel], style, label=kind)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{optimizer}: {quantity} RMS")
            ax.set_xlabel("depth (blocks)" if args.depth else "width")
            ax.legend()
    base = f"width {DEPTH_WIDTH} under mup, base_depth {BASE_DEPTH}" if args.depth else f"base_dim {BASE_DIM}"
    fig.suptitle(f"coordinate check after 5 steps at lr {args.lr:g} ({base}): flat = {axis}-independent")
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=90)
    if args.save:
        from hopperlm.provenance import save_result

        setting = (
            {"width": DEPTH_WIDTH, "base_dim": DEPTH_WIDTH, "base_depth": BASE_DEPTH} if args.depth else {}
        )
        save_result({"lr": args.lr, "steps": 5, "base_dim": BASE_DIM, **setting, "rows": rows}, args.save)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
