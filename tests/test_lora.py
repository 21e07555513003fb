"""LoRA: exact trainable counts, identity at start, merge, PEFT round trip, small checkpoints, exact resume."""

import json
import subprocess
import sys

import pytest
import torch
from hf_tiny import REPO, finetune_config

from hopperlm.config import LoRAConfig, ModelConfig
from hopperlm.errors import ConfigError
from hopperlm.interop.peft import export_peft, read_peft
from hopperlm.model.lora import (
    LoRALinear,
    apply_lora,
    count_trainable,
    lora_modules,
    merge_lora,
)
from hopperlm.model.transformer import build_model
from hopperlm.observe.metrics import read_metrics
from hopperlm.train.loop import train

QUIET = lambda line: None  # noqa: E731
CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128, max_seq_len=64)


def randomize_adapters(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in lora_modules(model):
            m.lora_B.weight.copy_(0.05 * torch.randn(m.lora_B.weight.shape, generator=g))


@pytest.mark.parametrize(
    "targets, rank, expected",
    [
        # per block: q (64 out, 64 in), k/v (32, 64), o (64, 64), gate/up (96, 64), down (64, 96)
        ("q,v", 4, 2 * 4 * ((64 + 64) + (32 + 64))),
        ("all-linear", 8, 2 * 8 * (128 + 96 + 96 + 128 + 160 + 160 + 160)),
    ],
)
def test_trainable_parameter_count_is_exact(targets, rank, expected):
    model = build_model(CFG, seed=0)
    lora = LoRAConfig(rank=rank, targets=targets)
    wrapped = apply_lora(model, lora)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == expected == count_trainable(CFG, lora)
    assert wrapped == CFG.n_layers * len(targets.split(",") if targets != "all-linear" else range(7))
    assert not model.embed.weight.requires_grad and not model.lm_head.weight.requires_grad


def test_zero_b_is_the_identity_and_merge_equals_base_plus_adapter():
    x = torch.randint(0, 128, (2, 32))
    model = build_model(CFG, seed=0).eval()
    with torch.no_grad():
        before = model(x)
    apply_lora(model, LoRAConfig(rank=4, alpha=8, targets="all-linear"))
    with torch.no_grad():
        assert torch.equal(model(x), before)  # B = 0: exactly the base model
    randomize_adapters(model)
    with torch.no_grad():
        adapted = model(x)
        assert (adapted - before).abs().max() > 1e-3
        assert merge_lora(model) == 14 and not list(lora_modules(model))
        torch.testing.assert_close(model(x), adapted, rtol=1e-5, atol=1e-5)
    assert type(model.layers[0].attn.q_proj) is torch.nn.Linear


def test_rslora_scale_and_bad_targets():
    base = torch.nn.Linear(8, 8)
    assert LoRALinear(base, 16, 32.0).scale == 2.0
    assert LoRALinear(base, 16, 32.0, rslora=True).scale == 8.0
    with pytest.raises(ConfigError, match="unknown qq"):
        LoRAConfig(rank=4, targets="q,qq")
    with pytest.raises(ConfigError, match="needs adapters"):
        LoRAConfig(rank=0, quantize="nf4")


def test_lora_flops_skip_frozen_weight_gradients():
    from hopperlm.model.lora import training_flops_per_token
    from hopperlm.model.transformer import count_params, flops_per_token

    lora = LoRAConfig(rank=4, targets="all-linear")
    full = flops_per_token(CFG, 64)
    n = count_params(CFG)["non_embedding"]
    assert training_flops_per_token(CFG, 64, LoRAConfig()) == full
    assert training_flops_per_token(CFG, 64, lora) == full - 2 * n + 6 * count_trainable(CFG, lora)


def test_float8_leaves_the_frozen_base_alone():
    from hopperlm.speed.float8 import convertible

    model = build_model(CFG, seed=0)
    apply_lora(model, LoRAConfig(rank=16, targets="all-linear"))
    names = [n for n, _ in convertible(model, only_if_pays=False)]
    assert names and all(".lora_" in n for n in names)  # the adapters may convert, never the frozen base


def lora_config(tinyllama_hf, data_dir, run_dir, *extra):
    lora = [
        "--sft.max_examples",
        "120",
        "--lora.rank",
        "4",
        "--lora.targets",
        "all-linear",
        "--lora.dropout",
        "0.1",
    ]
    return finetune_config(tinyllama_hf, data_dir, run_dir, *lora, *extra)


@pytest.mark.slow
def test_lora_run_saves_adapters_resumes_exactly_and_round_trips_through_peft(
    tinyllama_hf, data_dir, tmp_path
):
    peft = pytest.importorskip("peft")
    import transformers

    from hopperlm.checkpoint.layout import list_checkpoints
    from hopperlm.interop.inference import load_for_inference

    args = [
        "--train.max_steps",
        "6",
        "--checkpoint.every",
        "3",
        "--train.log_every",
        "1",
        "--train.eval_every",
        "3",
    ]
    full = tmp_path / "full"
    train(lora_config(tinyllama_hf, data_dir, full, *args), log=QUIET)
    ckpts = list_checkpoints(full)
    assert [c.name for c in ckpts] == ["step_000003", "step_000006"]
    assert not (ckpts[-1] / "model.safetensors").exists()
    assert (
        ckpts[-1] / "adapter.safetensors"
    ).stat().st_size < 200_000  # adapters only: the base is init_from

    cut = tmp_path / "cut"  # the same run, killed after step 3, resumed
    train(lora_config(tinyllama_hf, data_dir, cut, *args, "--train.max_steps", "3"), log=QUIET)
    train(lora_config(tinyllama_hf, data_dir, cut, *args), resume=True, log=QUIET)
    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(cut / "metrics.jsonl")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r.get("val_loss") for r in a] == [r.get("val_loss") for r in b]

    # PEFT: the exported adapter on the transformers model gives hopperlm's logits
    merged, tokenizer = load_for_inference(full)  # adapters folded into the base
    out = export_peft(full, tmp_path / "peft")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    base = transformers.AutoModelForCausalLM.from_pretrained(tinyllama_hf)
    theirs = peft.PeftModel.from_pretrained(base, out).eval()
    ids = torch.tensor([tokenizer.encode("Give three tips for staying healthy.")])
    with torch.no_grad():
        assert (merged(ids) - theirs(ids).logits).abs().max().item() <= 1e-4
    # the adapters unmerged (the training model) vs `hopperlm merge`'s folder
    from hopperlm.checkpoint.layout import read_lora_config, read_model_config
    from hopperlm.checkpoint.single import load_checkpoint_weights
    from hopperlm.train.initial_model import build_lora_model

    model_cfg, adapters = read_model_config(ckpts[-1]), read_lora_config(ckpts[-1])
    unmerged = build_lora_model(model_cfg, adapters, "cpu", model_cfg.init_from, torch.float32, None, 0)
    load_checkpoint_weights(ckpts[-1], unmerged)
    done = subprocess.run(
        [sys.executable, "-m", "hopperlm", "merge", str(full), str(tmp_path / "merged")],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    folded, _ = load_for_inference(tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(folded(ids), unmerged.eval()(ids), rtol=1e-4, atol=1e-4)
    lora_cfg, tensors = read_peft(out)  # and back: the same adapters under hopperlm's names
    from safetensors.torch import load_file

    saved = load_file(str(ckpts[-1] / "adapter.safetensors"))
    assert lora_cfg.rank == 4 and set(tensors) == set(saved)
    assert all(torch.equal(tensors[k], saved[k]) for k in saved)
