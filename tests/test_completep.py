"""CompleteP (model.depth_parametrization: completep): standard exactly at base_depth; the residual multiplier,
init and AdamW epsilon of the paper's depth rules elsewhere, and μP's learning rates and weight decay untouched;
exports that fold the multiplier into o_proj and down_proj (transformers' and llama.cpp's logits are hopperlm's);
bad configs refused in one line."""

import sys
from pathlib import Path

import pytest
import torch

from hopperlm.config import ModelConfig, MuonConfig, OptimConfig
from hopperlm.errors import ConfigError
from hopperlm.model.completep import describe, residual_multiplier
from hopperlm.model.transformer import build_model
from hopperlm.train.optim import build_optimizer, set_lr

REPO = Path(__file__).resolve().parents[1]


def model_cfg(n_layers: int, depth: str = "completep", base_depth: int | None = 2, **kw) -> ModelConfig:
    shape = dict(dim=64, n_heads=2, vocab_size=512, max_seq_len=64, parametrization="mup", base_dim=64)
    return ModelConfig(
        n_layers=n_layers, depth_parametrization=depth, base_depth=base_depth, **{**shape, **kw}
    )


def train_steps(cfg: ModelConfig, optimizer: str, steps: int = 3) -> tuple[list[float], torch.Tensor]:
    tokens = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(0))
    model = build_model(cfg, seed=0)
    opt = build_optimizer(
        model, OptimConfig(lr=3e-3), fused=False, name=optimizer, muon=MuonConfig(lr_adjust="spectral")
    )
    losses = []
    for _ in range(steps):
        set_lr(opt, 3e-3)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        return losses, model(tokens[:, :-1])


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_completep_at_its_base_depth_is_standard_bit_for_bit(optimizer):
    """So a recipe can turn completep on at its own depth and train exactly as before, while a shallower proxy's
    LR now transfers to it."""
    standard = train_steps(model_cfg(3, "standard", None), optimizer)
    completep = train_steps(model_cfg(3, "completep", 3), optimizer)
    assert completep[0] == standard[0]  # every step's loss
    assert torch.equal(completep[1], standard[1])  # the logits after them


def test_deeper_than_base_scales_branches_init_and_epsilon_but_not_learning_rates():
    deep = model_cfg(8, base_depth=2)  # m_L = 4
    model = build_model(deep, seed=0)
    assert all(block.residual_mult == 0.25 for block in model.layers) and residual_multiplier(deep) == 0.25
    # init: the output projections at init_std / sqrt(2 x base_depth), not / sqrt(2 x n_layers)
    o = torch.cat([b.attn.o_proj.weight.flatten() for b in model.layers])
    assert o.std().item() == pytest.approx(0.02 / 2, rel=0.05)
    # the forward: each branch's output times 1/4 before the residual add
    x = torch.randn(2, 8, 64)
    block = model.layers[0]
    cos, sin = model.rope_cos[:8], model.rope_sin[:8]
    h = x + 0.25 * block.attn(block.attn_norm(x), cos, sin)
    torch.testing.assert_close(block(x, cos, sin), h + 0.25 * block.mlp(block.mlp_norm(h)))

    opt = build_optimizer(model, OptimConfig(lr=1e-3, eps=1e-8, weight_decay=0.1), fused=False)
    set_lr(opt, 1e-3)
    same_depth_standard = build_model(model_cfg(8, "standard", None), seed=0)
    reference = build_optimizer(
        same_depth_standard, OptimConfig(lr=1e-3, eps=1e-8, weight_decay=0.1), fused=False
    )
    set_lr(reference, 1e-3)

    def per_param(optimizer, m):
        groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        return {name: groups[id(p)] for name, p in m.named_parameters()}

    ours, theirs = per_param(opt, model), per_param(reference, same_depth_standard)
    for name, group in ours.items():
        assert group["lr"] == theirs[name]["lr"], name  # learning rates: μP's (alpha = 1)
        assert group["weight_decay"] == theirs[name]["weight_decay"], name
        expected = 1e-8 / 4 if name.startswith("layers.") else 1e-8  # epsilon: the blocks' x L0/L
        assert group.get("eps", opt.defaults["eps"]) == pytest.approx(expected), name


def test_muons_adamw_half_takes_the_blocks_epsilon_and_muons_groups_keep_theirs():
    model = build_model(model_cfg(4, base_depth=2), seed=0)
    pair = build_optimizer(model, OptimConfig(lr=1e-3, eps=1e-8), fused=False, name="muon")
    muon, adamw = pair.optimizers
    # Muon's own eps (Newton-Schulz's clamp) untouched
    assert all(g["eps"] == muon.defaults["eps"] for g in muon.param_groups)
    norms = {id(b.attn_norm.weight) for b in model.layers}
    eps = {id(p): g["eps"] for g in adamw.param_groups for p in g["params"]}
    assert all(eps[i] == pytest.approx(0.5e-8) for i in norms)
    assert eps[id(model.embed.weight)] == 1e-8 and eps[id(model.lm_head.weight)] == 1e-8


def test_bad_completep_configs_are_one_line_each(capsys):
    from hopperlm.cli import main

    with pytest.raises(ConfigError, match=r"model.base_depth=0 must be positive"):
        model_cfg(4, base_depth=0)
    with pytest.raises(ConfigError, match="completep needs model.parametrization mup"):
        ModelConfig(depth_parametrization="completep", base_depth=2)
    with pytest.raises(ConfigError, match="completep needs model.base_depth"):
        model_cfg(4, base_depth=None)
    for args, message in (
        (["--model.base_depth", "-1"], "model.base_depth=-1 must be positive"),
        (["--model.depth_parametrization", "completep", "--model.base_depth", "2"], "needs model.parametrization mup"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            main(["train", "debug", *args, "--print-config"])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


def test_the_banner_line_says_what_is_in_effect():
    assert "completep (base_depth 2, depth x4)" in describe(model_cfg(8))
    assert "x0.25 before the residual add" in describe(model_cfg(8))
    assert describe(model_cfg(8, "standard", None)).startswith("depth: standard")


def test_an_hf_checkpoint_keeps_standard_depth(tinyllama_hf):
    from hopperlm.config import config_from_dict
    from hopperlm.interop.init_from import resolve_init_from

    model = {"init_from": str(tinyllama_hf), "depth_parametrization": "completep", "base_depth": 1}
    cfg = config_from_dict({"model": model, "train": {"max_steps": 1, "seq_len": 32}})
    with pytest.raises(ConfigError, match="depth_parametrization"):
        resolve_init_from(cfg)


def strong_branches(cfg: ModelConfig, seed: int = 0):
    """A model whose residual branches matter to the logits (init_std 0.2): a multiplier left out of an export
    changes them well past the tolerance."""
    import dataclasses

    return build_model(dataclasses.replace(cfg, init_std=0.2), seed=seed).eval()


def test_an_hf_export_folds_the_residual_multiplier_into_o_and_down_proj(tmp_path):
    """transformers computes the logits hopperlm computes for a CompleteP model 4x its base depth (and 2x its
    base width: μP's head multiplier folds too)."""
    import transformers

    from hopperlm.checkpoint.layout import write_model
    from hopperlm.interop.hf_convert import export_hf

    cfg = model_cfg(4, base_depth=1, dim=128, n_heads=4)
    model = strong_branches(cfg)
    write_model(tmp_path / "model", model, cfg, tokenizer_dir=None)
    out = export_hf(tmp_path / "model", tmp_path / "hf", log=lambda line: None)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        ours = model(x)
        torch.testing.assert_close(theirs(x).logits, ours, rtol=1e-4, atol=1e-4)
        for block in model.layers:  # the same weights without the multiplier compute something else
            block.residual_mult = 1.0
        assert (model(x) - ours).abs().max() > 1e-2


@pytest.fixture(scope="module")
def completep_folder(data_dir, tmp_path_factory) -> Path:
    """A CompleteP model (4 blocks, base_depth 2) with TinyLlama's tokenizer, as a hopperlm model folder."""
    from hopperlm.checkpoint.layout import write_model

    source = data_dir / "tokenizers" / "tinyllama-1.1b-chat-v1.0"
    work = tmp_path_factory.mktemp("completep")
    tokenizer = work / "tokenizer"
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        (tokenizer / name).write_bytes((source / name).read_bytes())
    cfg = model_cfg(4, base_depth=2, vocab_size=32000, max_seq_len=128)
    write_model(work / "model", strong_branches(cfg), cfg, tokenizer_dir=tokenizer)
    return work / "model"


def test_a_gguf_export_holds_the_folded_projections(completep_folder, tmp_path):
    gguf = pytest.importorskip("gguf")
    from hopperlm.interop.gguf import export_gguf
    from hopperlm.interop.tensors import iter_model_tensors

    out = export_gguf(completep_folder, tmp_path / "m.gguf", "f32", log=lambda line: None)
    tensors = {t.name: t.data for t in gguf.GGUFReader(out).tensors}
    ours = dict(iter_model_tensors(completep_folder))
    for i in range(4):
        for gguf_name, name in (("attn_output", "attn.o_proj"), ("ffn_down", "mlp.down_proj")):
            expected = ours[f"layers.{i}.{name}.weight"].numpy() * 0.5
            assert (tensors[f"blk.{i}.{gguf_name}.weight"] == expected).all(), (i, name)
        assert (tensors[f"blk.{i}.ffn_gate.weight"] == ours[f"layers.{i}.mlp.gate_proj.weight"].numpy()).all()


def test_peft_adapters_on_a_completep_base_give_hopperlm_logits(completep_folder, data_dir, tmp_path):
    """A LoRA fine-tune of a CompleteP model (multiplier 0.5), its adapters exported for PEFT and put on the
    base's Hugging Face export: transformers + peft compute the fine-tuned model's logits. lora_B of o_proj and
    down_proj must carry the multiplier the base's weights carry; without it the logits differ (checked)."""
    peft = pytest.importorskip("peft")
    import transformers
    from hf_tiny import finetune_config

    from hopperlm.interop.hf_convert import export_hf
    from hopperlm.interop.inference import load_for_inference
    from hopperlm.interop.peft import export_peft
    from hopperlm.train.loop import train

    run = tmp_path / "run"
    lora = ["--lora.rank", "4", "--lora.targets", "all-linear", "--sft.max_examples", "16",
            "--train.max_steps", "3", "--optim.lr", "5e-2", "--schedule.warmup_steps", "0"]  # fmt: skip
    train(finetune_config(completep_folder, data_dir, run, *lora), log=lambda line: None)
    merged, tokenizer = load_for_inference(run)
    base = transformers.AutoModelForCausalLM.from_pretrained(
        export_hf(completep_folder, tmp_path / "hf", log=lambda line: None)
    )
    adapters = export_peft(run, tmp_path / "peft")
    ids = torch.tensor([tokenizer.encode("Give three tips for staying healthy.")])
    with torch.no_grad():
        before = base(ids).logits
        theirs = peft.PeftModel.from_pretrained(base, adapters).eval()
        assert (merged(ids) - before).abs().max() > 1e-2  # the adapters change the logits
        torch.testing.assert_close(theirs(ids).logits, merged(ids), rtol=1e-4, atol=1e-4)
        for (
            name,
            module,
        ) in theirs.named_modules():  # the same adapters without the fold compute something else
            if name.endswith(("o_proj", "down_proj")) and hasattr(module, "lora_B"):
                module.lora_B["default"].weight.mul_(2.0)
        assert (theirs(ids).logits - merged(ids)).abs().max() > 1e-3


@pytest.mark.slow
def test_llama_cpp_continues_a_completep_export_as_hopperlm(completep_folder, tmp_path):
    """llama.cpp itself, where bench/llamacpp_check.py has built it: llama-simple's greedy continuation of the
    f32 GGUF equals `hopperlm generate --temperature 0`'s, and the same weights without the multiplier
    continue differently (so the comparison can see a missing fold)."""
    import json
    import shutil

    from llamacpp_cases import hopperlm_greedy, llama_greedy
    from llamacpp_check import built_bin_dir

    bin_dir = built_bin_dir()
    if bin_dir is None:
        pytest.skip("llama.cpp is not built on this machine: python3 bench/llamacpp_check.py --build-only")
    from hopperlm.interop.gguf import export_gguf

    out = export_gguf(completep_folder, tmp_path / "m.gguf", "f32", log=lambda line: None)
    prompt = "ROMEO: What light through yonder window breaks?"
    ours = hopperlm_greedy(completep_folder, prompt, 12)
    assert llama_greedy(bin_dir, out, prompt, 12) == ours
    unfolded = tmp_path / "unfolded"
    shutil.copytree(completep_folder, unfolded)
    config = json.loads((unfolded / "config.json").read_text())
    config["model"]["depth_parametrization"], config["model"]["base_depth"] = "standard", None
    (unfolded / "config.json").write_text(json.dumps(config))
    assert hopperlm_greedy(unfolded, prompt, 12) != ours


@pytest.mark.slow
def test_depth_coordinate_check_is_flat_under_completep_and_grows_under_standard():
    from coord_check import DEPTH_WIDTH, coordinates

    depths = (2, 8, 16)
    for optimizer in ("adamw", "muon"):
        got = {
            (kind, d): coordinates(
                "mup",
                DEPTH_WIDTH,
                optimizer=optimizer,
                depth=d,
                depth_parametrization=kind,
                base_dim=DEPTH_WIDTH,
            )
            for kind in ("standard", "completep")
            for d in depths
        }
        for quantity in ("activations", "activation updates", "output logits"):
            flat = [got["completep", d][quantity] for d in depths]
            assert max(flat) / min(flat) < 1.3, (optimizer, quantity, flat)
        for quantity in ("activations", "activation updates"):
            # measured at 5 steps: x28 and x32 with AdamW, x1.7 and x2.0 with Muon from 2 to 16 blocks
            grows = [got["standard", d][quantity] for d in depths]
            assert grows[-1] / grows[0] > 1.5, (optimizer, quantity, grows)


@pytest.mark.slow
def test_the_depth_coordinate_check_runs_in_smoke_mode(tmp_path):
    import json
    import subprocess

    out, saved = tmp_path / "coord.png", tmp_path / "coord.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "coord_check.py"), "--depth", "--smoke", "--out", str(out),
         "--save", str(saved)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(saved.read_text())["rows"]
    assert out.is_file() and len(rows) == 2 * 2 * 2  # optimizers x depth parametrizations x depths
    assert {r["n_layers"] for r in rows} == {2, 4} and all(r["activation updates"] > 0 for r in rows)


@pytest.mark.slow
def test_the_depth_transfer_benchmark_runs_in_smoke_mode(tmp_path):
    import json
    import subprocess

    out = tmp_path / "transfer-depth.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "transfer.py"), "--depth", "--smoke", "--work", str(tmp_path / "w"),
         "--save", str(out)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert len(record["rows"]) == 2 * 2 * 2 * 2  # depth parametrizations x optimizers x depths x LRs
    keys = {
        "depth_parametrization",
        "optimizer",
        "n_layers",
        "width",
        "lr",
        "seed",
        "steps",
        "final_val_loss",
    }
    assert all(keys <= set(r) and r["final_val_loss"] is not None for r in record["rows"])
    assert set(record["summary"]) == {"standard/adamw", "standard/muon", "completep/adamw", "completep/muon"}
    assert not out.with_suffix(".partial.json").exists()


@pytest.mark.slow
def test_the_proxy_cost_benchmark_runs_in_smoke_mode(tmp_path):
    import json
    import subprocess

    out = tmp_path / "cost.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "proxy_cost.py"), "--smoke", "--save", str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["dim"], r["n_layers"]) for r in rows] == [(64, 2), (32, 2), (32, 1)]
    assert rows[0]["flops_per_token"] > rows[1]["flops_per_token"] > rows[2]["flops_per_token"]
    assert all(r["step_ms"] > 0 for r in rows)
