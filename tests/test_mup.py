"""μP (model.parametrization: mup): the same per-parameter learning rates, weight decays and init multipliers as
Microsoft's `mup` package (MuAdamW after set_base_shapes) on the same shapes; standard at the base width; a
coordinate check that is flat in width under mup and grows under standard; exports that carry the output
multiplier; bad configs refused in one line."""

import sys
from pathlib import Path

import pytest
import torch
import yaml

from hopperlm.config import ModelConfig, MuonConfig, OptimConfig
from hopperlm.errors import ConfigError
from hopperlm.model.mup import base_config, matrix_multipliers
from hopperlm.model.transformer import Transformer, build_model, parameter_shapes
from hopperlm.train.optim import build_optimizer, set_lr

REPO = Path(__file__).resolve().parents[1]


def mup_cfg(dim: int, **kw) -> ModelConfig:
    return ModelConfig(
        dim=dim, n_layers=2, n_heads=dim // 32, vocab_size=512, max_seq_len=64, parametrization="mup",
        base_dim=64, **kw,
    )  # fmt: skip


def per_param(optimizer) -> dict[int, tuple[float, float]]:
    return {id(p): (g["lr"], g["weight_decay"]) for g in optimizer.param_groups for p in g["params"]}


@pytest.mark.parametrize("n_kv_heads", [None, 2])
def test_learning_rates_weight_decay_and_init_equal_microsoft_mups(n_kv_heads):
    import mup

    cfg = mup_cfg(256, n_kv_heads=n_kv_heads)
    model = build_model(cfg, seed=0)
    with torch.device("meta"):
        base = Transformer(base_config(cfg))
    # our lm_head plays mup's MuReadout (its output times base_dim/dim: model.output_mult, checked below)
    mup.set_base_shapes(model, base, rescale_params=False, do_assert=False)
    theirs = per_param(mup.MuAdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
    ours_opt = build_optimizer(model, OptimConfig(lr=1e-3, weight_decay=0.1), fused=False)
    set_lr(ours_opt, 1e-3)
    ours = per_param(ours_opt)
    widths = matrix_multipliers(parameter_shapes(cfg), parameter_shapes(base_config(cfg)))
    matrix_like = 0
    for name, p in model.named_parameters():
        assert ours[id(p)][0] == pytest.approx(theirs[id(p)][0]), name  # every learning rate
        if p.infshape.ninf() == 2:  # matrix-like: the weight decay and the init multiplier too
            matrix_like += 1
            assert ours[id(p)][1] == pytest.approx(theirs[id(p)][1]), name
            assert widths[name] == pytest.approx(p.infshape.width_mult()), name
        else:
            assert name not in widths, name
    assert matrix_like == 2 * 7  # q, k, v, o, gate, up, down in each block
    # the init: mup.init.normal_'s m^-1/2 on matrix-like weights (q_proj here: 0.02 / sqrt(4))
    q = model.layers[0].attn.q_proj.weight
    assert q.std().item() == pytest.approx(0.02 * 0.5, rel=0.05)
    assert model.embed.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.output_mult == pytest.approx(64 / 256)


@pytest.mark.parametrize("adjust", ["match_rms_adamw", "spectral"])
def test_mup_at_its_base_width_is_standard(adjust):
    """So a recipe can turn mup on at its own width (owt-350m-h100: base_dim 1024, spectral) and train exactly
    as before, while a narrower proxy's LR now transfers to it."""
    tokens = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(0))
    losses = {}
    for parametrization in ("standard", "mup"):
        cfg = ModelConfig(
            dim=64, n_layers=2, n_heads=2, vocab_size=512, max_seq_len=64, parametrization=parametrization,
            base_dim=64 if parametrization == "mup" else None,
        )  # fmt: skip
        model = build_model(cfg, seed=0)
        rule = adjust if parametrization == "mup" else "match_rms_adamw"
        opt = build_optimizer(
            model, OptimConfig(lr=3e-3), fused=False, name="muon", muon=MuonConfig(lr_adjust=rule)
        )
        run = []
        for _ in range(3):
            set_lr(opt, 3e-3)
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses[parametrization] = run
    assert losses["mup"] == losses["standard"]


@pytest.mark.slow
@pytest.mark.parametrize("group_lrs", [None, (10.0, 0.5)], ids=["one-lr", "embed-10x-head-0.5x"])
def test_coordinate_check_is_flat_under_mup_and_grows_under_standard(group_lrs):
    """Also with the embedding and the head at their own LRs (rows of optim.groups: nanochat's ratios to the
    blocks' are ~10x and ~0.5x): each group keeps its own μP rule, so the curves stay flat."""
    from coord_check import QUANTITIES, coordinates

    # widest: 1024 for AdamW with one LR, 512 otherwise (8x the base width: the standard parametrization's growth
    # is 4x there, against the 2x asked), which keeps the check at ~20 s on 2 cores rather than ~90 (the rule for
    # the groups and Muon's orthogonalisation are the same at every width)
    adamw_widest = 1024 if group_lrs is None else 512
    for optimizer, widths in (("adamw", (64, 256, adamw_widest)), ("muon", (64, 256, 512))):
        got = {
            (p, w): coordinates(p, w, optimizer=optimizer, steps=4, group_lrs=group_lrs)
            for p in ("standard", "mup")
            for w in widths
        }
        for quantity in QUANTITIES[:2]:  # activations and attention logits: flat
            mup = [got["mup", w][quantity] for w in widths]
            assert max(mup) / min(mup) < 1.5, (optimizer, quantity, mup)
        # output logits: no growth (their share from the initial head shrinks as 1/sqrt(width) under μP, which is
        # what the output multiplier is for); under standard they grow, as do the activations
        mup = [got["mup", w]["output logits"] for w in widths]
        assert mup[2] <= 1.2 * mup[0] and mup[1] <= 1.2 * mup[0], (optimizer, mup)
        for quantity in ("activations", "output logits"):
            standard = [got["standard", w][quantity] for w in widths]
            assert standard[2] / standard[0] > 2.0, (optimizer, quantity, standard)


def test_bad_mup_configs_are_one_line_each():
    with pytest.raises(ConfigError, match="needs model.base_dim"):
        ModelConfig(dim=256, n_heads=8, parametrization="mup")
    with pytest.raises(ConfigError, match="needs an untied head"):
        ModelConfig(dim=256, n_heads=8, parametrization="mup", base_dim=64, tie_embeddings=True)
    with pytest.raises(ConfigError, match="not a multiple of head_dim 32"):
        base_config(ModelConfig(dim=256, n_heads=8, parametrization="mup", base_dim=48))


def test_an_hf_checkpoint_keeps_standard(tinyllama_hf):
    from hopperlm.config import config_from_dict
    from hopperlm.interop.init_from import resolve_init_from

    model = {"init_from": str(tinyllama_hf), "parametrization": "mup", "base_dim": 32}
    cfg = config_from_dict({"model": model, "train": {"max_steps": 1, "seq_len": 32}})
    with pytest.raises(ConfigError, match="parametrization"):
        resolve_init_from(cfg)


def test_an_export_folds_the_output_multiplier_into_the_head(tmp_path):
    """transformers computes the logits hopperlm computes for a μP model: the multiplier lives in lm_head."""
    import transformers

    from hopperlm.checkpoint.layout import write_model
    from hopperlm.interop.hf_convert import export_hf

    cfg = mup_cfg(128)
    model = build_model(cfg, seed=0).eval()
    write_model(tmp_path / "model", model, cfg, tokenizer_dir=None)
    out = export_hf(tmp_path / "model", tmp_path / "hf", log=lambda line: None)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_the_transfer_benchmark_runs_in_smoke_mode(tmp_path):
    import json
    import subprocess

    out = tmp_path / "transfer.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "transfer.py"),
            "--smoke",
            "--work",
            str(tmp_path / "w"),
            "--save",
            str(out),
            "--group-lrs",
            "10,0.5",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    # the runs trained the embedding and the head at their own LRs (the width transfer covers the new groups)
    run = next((tmp_path / "w" / "runs").glob("mup-adamw-*-g10x0.5-*"))
    optim = yaml.safe_load((run / "config.yaml").read_text())["optim"]
    rows = {g["pattern"]: g["lr"] for g in optim["groups"]}  # multiples of optim.lr
    assert rows == {"embed.weight": pytest.approx(10), "lm_head.weight": pytest.approx(0.5)}
    assert len(record["rows"]) == 2 * 2 * 2 * 3  # parametrizations x optimizers x widths x LRs
    keys = {"parametrization", "optimizer", "width", "params", "lr", "seed", "final_val_loss"}
    assert all(keys <= set(r) and r["final_val_loss"] is not None for r in record["rows"])
    assert set(record["summary"]) == {"standard/adamw", "standard/muon", "mup/adamw", "mup/muon"}
    assert "drift" in record["table"][0]
