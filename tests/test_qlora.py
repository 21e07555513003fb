"""QLoRA: NF4 frozen base (bitsandbytes, whose CPU backend runs these checks), exact adapter counts, the memory
estimate of the 4-bit weights; the training path on CUDA (skipped without a GPU)."""

import importlib.util

import pytest
import torch
from hf_tiny import save_hf, tiny_hf_model

from hopperlm.config import LoRAConfig, ModelConfig
from hopperlm.interop import hf
from hopperlm.model.lora import count_trainable, lora_modules
from hopperlm.model.transformer import build_empty
from hopperlm.train.initial_model import build_lora_model

needs_bnb = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed"
)
QUIET = lambda line: None  # noqa: E731


@needs_bnb
def test_nf4_base_matches_its_dequantized_weights_and_trains_only_adapters(tmp_path):
    from hopperlm.interop.tensors import load_weights
    from hopperlm.model.qlora import dequantized_weight, is_quantized, nf4_bytes

    # q/k/v biases ride along with the 4-bit weights; widths that are multiples of 64 (bitsandbytes CPU layout)
    src = save_hf(tiny_hf_model("qwen2", intermediate_size=128), tmp_path / "hf")
    cfg = ModelConfig(**hf.model_values(src))
    lora = LoRAConfig(rank=4, alpha=8, targets="all-linear", quantize="nf4")
    model = build_lora_model(cfg, lora, "cpu", str(src), "nf4", torch.bfloat16, seed=0)
    wrapped = dict(lora_modules(model))
    assert len(wrapped) == 14 and all(is_quantized(m.base) for m in wrapped.values())
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == count_trainable(cfg, lora)

    # the reference: the same model with each frozen matrix replaced by what NF4 stores, dequantized
    ref = build_empty(cfg, "cpu")
    load_weights(ref, src)
    stored = 0
    with torch.no_grad():
        for name, module in wrapped.items():
            ref.get_submodule(name).weight.copy_(dequantized_weight(module.base).float())
            stored += module.base.weight.numel() + sum(
                t.numel() * t.element_size() for t in quant_tensors(module.base)
            )
    adapted = sum(m.in_features * m.out_features for m in wrapped.values())
    assert abs(stored - nf4_bytes(adapted)) / nf4_bytes(adapted) < 0.1  # the estimate the plan uses
    x = torch.randint(0, 256, (2, 24))
    with torch.autocast(
        "cpu", dtype=torch.bfloat16
    ):  # (bitsandbytes' CPU backend repacks for eval: train first)
        model(x, x).backward()
    grads = [n for n, p in model.named_parameters() if p.grad is not None]
    assert grads and all(".lora_" in n for n in grads)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ours, theirs = model.eval()(x).float(), ref.eval()(x).float()
    assert (ours - theirs).abs().max().item() < 0.1 * theirs.abs().max().item()  # bf16 compute on both sides


def quant_tensors(layer):
    state = layer.weight.quant_state
    tensors = [state.absmax]
    if state.state2 is not None:
        tensors.append(state.state2.absmax)
    return tensors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="QLoRA training needs a CUDA GPU")
@needs_bnb
def test_qlora_trains_on_cuda_with_paged_8bit_adamw(tinyllama_hf, data_dir, tmp_path):
    from pathlib import Path

    from hopperlm.config import load_config
    from hopperlm.interop.init_from import resolve_init_from
    from hopperlm.observe.metrics import read_metrics
    from hopperlm.train.loop import train

    cfg = load_config(
        Path(__file__).resolve().parents[1] / "configs" / "debug.yaml",
        [
            "--model.preset", "null", "--model.init_from", str(tinyllama_hf),
            "--sft.path", str(data_dir / "alpaca_gpt4_demo" / "alpaca_en_demo.json"), "--sft.max_examples", "200",
            "--lora.rank", "16", "--lora.targets", "all-linear", "--lora.quantize", "nf4",
            "--optim.name", "paged_adamw8bit", "--optim.lr", "3e-3", "--train.seq_len", "256",
            "--train.micro_batch", "4", "--train.max_steps", "30", "--train.log_every", "10",
            "--run.out_dir", str(tmp_path / "q"),
        ],
    )  # fmt: skip
    lines = []
    train(resolve_init_from(cfg), log=lines.append)
    losses = [r["loss"] for r in read_metrics(tmp_path / "q" / "metrics.jsonl")]
    assert all(x == x for x in losses) and losses[-1] < losses[0]  # finite, and falling
    assert any("NF4 + double quantisation" in line for line in lines)
