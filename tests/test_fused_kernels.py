"""Fewer elementwise kernels in the step: fused q/k/v and gate/up GEMMs, RoPE without rotated copies, Liger's
kernels behind train.kernels, and the plan's reasons for each (CPU; the real Liger kernels in a gpu test)."""

import copy
import dataclasses
import re
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from hopperlm.config import LoRAConfig, ModelConfig, config_from_dict
from hopperlm.hardware import simulated
from hopperlm.model.attention import positions_from_doc_ids
from hopperlm.model.lora import apply_lora
from hopperlm.model.loss import IGNORE_INDEX
from hopperlm.model.transformer import apply_rope, build_model, rope_qk, rope_tables
from hopperlm.plan import make_plan
from hopperlm.plan.choices import FUSED_PROJECTIONS_AUTO, FUSED_PROJECTIONS_ON
from hopperlm.plan.float8_payoff import torchao_available
from hopperlm.speed import apply_speedups
from hopperlm.speed.float8 import apply_fp8
from hopperlm.speed.fused_projections import ALL_FUSED, apply_fused_projections
from hopperlm.speed.liger import apply_liger

# grouped-query attention with q/k/v biases (Qwen2's shape), two blocks
CFG = ModelConfig(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=97, max_seq_len=32, qkv_bias=True
)


def model_pair(cfg=CFG):
    """Two identical models, biases non-zero so the fused bias is checked too."""
    model = build_model(cfg, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model, copy.deepcopy(model)


def loss_logits_grads(model, x, y, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = model(x, y, **kwargs)
    loss.backward()
    with torch.no_grad():
        logits = model(x, **kwargs)
    return (
        loss.detach(),
        logits,
        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
    )


def assert_same(a, b, atol=1e-6):
    (loss_a, logits_a, grads_a), (loss_b, logits_b, grads_b) = a, b
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=atol)
    torch.testing.assert_close(logits_a, logits_b, rtol=0, atol=atol)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=0, atol=atol, msg=name)


def batch(T=24):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 97, (2, T), generator=g), torch.randint(0, 97, (2, T), generator=g)
    y[0, :3] = IGNORE_INDEX
    doc_ids = torch.tensor([[0] * 10 + [1] * 14, [0] * 5 + [1] * 5 + [2] * 14])
    return x, y, doc_ids


# ---- fused projections -----------------------------------------------------------------------------------
def test_fused_projections_equal_separate_ones_with_gqa_and_bias():
    separate, fused = model_pair()
    line = apply_fused_projections(fused)
    assert line == ALL_FUSED
    assert all(b.attn.fused_qkv and b.mlp.fused_gate_up for b in fused.layers)
    assert fused.state_dict().keys() == separate.state_dict().keys()  # parameters untouched
    x, y, doc_ids = batch()
    assert_same(loss_logits_grads(separate, x, y), loss_logits_grads(fused, x, y))
    # packed documents: per-row RoPE positions and the document mask
    assert_same(
        loss_logits_grads(separate, x, y, doc_ids=doc_ids), loss_logits_grads(fused, x, y, doc_ids=doc_ids)
    )


def test_fused_projections_decode_with_the_kv_cache():
    separate, fused = model_pair()
    apply_fused_projections(fused)
    prompt = torch.tensor([[5, 9, 2, 7]])
    outs = []
    for model in (separate, fused):
        model.eval().setup_cache(1, 16)
        with torch.no_grad():
            steps = [model(prompt)[:, -1]] + [model(torch.tensor([[t]]), pos=4 + t) for t in range(3)]
        model.clear_cache()
        outs.append(torch.cat([s.reshape(1, -1) for s in steps]))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-6)


def test_fused_projections_stay_off_for_lora_and_float8():
    model = build_model(CFG, seed=0)
    apply_lora(model, LoRAConfig(rank=4, targets="q,v"))
    line = apply_fused_projections(model)
    # k_proj and gate/up are plain layers still: only the attention groups with an adapter stay separate
    assert "2 of 4 groups fused" in line and "layers.0.attn (LoRALinear, not nn.Linear)" in line
    assert not any(b.attn.fused_qkv for b in model.layers) and all(b.mlp.fused_gate_up for b in model.layers)

    for backend in ("native", "tensorwise") if torchao_available() else ("native",):
        model = build_model(dataclasses.replace(CFG, qkv_bias=False), seed=0)
        apply_fp8(model, backend, only_if_pays=False)
        line = apply_fused_projections(model)
        name = "Float8NativeLinear" if backend == "native" else "Float8Linear"
        assert f"0 of 4 groups fused; kept separate: layers.0.attn ({name}, not nn.Linear)" in line
        assert not any(b.attn.fused_qkv or b.mlp.fused_gate_up for b in model.layers)


def test_apply_speedups_fuses_as_the_plan_says_and_logs_only_a_fallback():
    raw = {"model": {"preset": "debug"}, "train": {"max_steps": 1, "seq_len": 64, "fused_projections": True}}
    cfg = config_from_dict(raw)
    plan = make_plan(cfg, CFG, simulated("CPU"))
    assert plan.fused_projections and plan.kernels == "compiler" and not plan.compile
    model, lines = build_model(CFG, seed=0), []
    apply_speedups(model, plan, lines.append)
    assert all(b.attn.fused_qkv and b.mlp.fused_gate_up for b in model.layers) and lines == []
    model, lines = build_model(CFG, seed=0), []
    apply_lora(model, LoRAConfig(rank=4))  # a plan replaced by hand: the layer check still holds
    apply_speedups(model, plan, lines.append)
    assert lines == [
        "fused projections: 0 of 4 groups fused; kept separate: layers.0.attn (LoRALinear, "
        "not nn.Linear) and 3 more"
    ]


# ---- RoPE ------------------------------------------------------------------------------------------------
def old_apply_rope(x, cos, sin):
    """apply_rope before issue 47: x (B, H, T, hd) and a rotated copy cat([-x2, x1])."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).type_as(x)


def test_rope_equals_the_old_formula_and_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    B, T, hd = 2, 24, 16
    cos, sin = rope_tables(T, hd, 10000.0)
    q, k = torch.randn(B, T, 4, hd), torch.randn(B, T, 2, hd)  # (B, T, H, hd): the projections' layout
    ours_q, ours_k = rope_qk(q, k, cos, sin)
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, hd)
    torch.testing.assert_close(ours_q.transpose(1, 2), old_apply_rope(qt, cos, sin), rtol=0, atol=0)
    torch.testing.assert_close(apply_rope(qt, cos, sin), old_apply_rope(qt, cos, sin), rtol=0, atol=0)
    hf_q, hf_k = apply_rotary_pos_emb(qt, kt, cos[None], sin[None])  # HF's (1, T, hd) tables
    torch.testing.assert_close(ours_q.transpose(1, 2), hf_q, rtol=0, atol=0)
    torch.testing.assert_close(ours_k.transpose(1, 2), hf_k, rtol=0, atol=0)
    # per-row positions (packed documents): tables (B, T, hd)
    positions = positions_from_doc_ids(batch(T)[2])
    row_cos, row_sin = cos[positions], sin[positions]
    ours_q, ours_k = rope_qk(q, k, row_cos, row_sin)
    hf_q, hf_k = apply_rotary_pos_emb(qt, kt, row_cos, row_sin)
    torch.testing.assert_close(ours_q.transpose(1, 2), hf_q, rtol=0, atol=0)
    torch.testing.assert_close(ours_k.transpose(1, 2), hf_k, rtol=0, atol=0)


@pytest.mark.slow  # inductor's C++ build: ~10 s cold
def test_rope_is_one_kernel_forward_and_one_backward_under_inductor():
    """Measured on CPU (torch 2.13): the old formula and this one each fuse into one kernel per pass in
    isolation; in a compiled Attention (fp32, forward + backward) the old one took 1 + 5 kernels, this one
    1 + 4, and with fused projections 2 + 2 (the extra forward kernel is the weight concatenation)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    q = torch.randn(2, 8, 4, 16, requires_grad=True)
    k = torch.randn(2, 8, 2, 16, requires_grad=True)
    cos, sin = rope_tables(8, 16, 10000.0)
    compiled = torch.compile(rope_qk)

    def step():
        a, b = compiled(q, k, cos, sin)
        (a.sum() + b.sum()).backward()

    _, codes = run_and_get_code(step)
    kernels = [set(re.findall(r"(cpp_fused_\w+|triton_\w+)\s*=\s*async_compile", code)) for code in codes]
    assert [len(k) for k in kernels] == [1, 1], kernels


# ---- Liger-Kernel, wired with plain-torch stand-ins --------------------------------------------------------
def fake_liger(monkeypatch, calls):
    """sys.modules entries for the four liger_kernel imports speed/liger.py makes, computing in plain torch and
    recording the layouts they are called with."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    class RMSNormFunction:
        @staticmethod
        def apply(x, weight, eps, offset, casting_mode, in_place):
            calls.append(("rms_norm", casting_mode, offset, in_place))
            return F.rms_norm(x, (x.shape[-1],), weight, eps)

    class SiLUMulFunction:
        @staticmethod
        def apply(a, b):
            calls.append(("silu_mul", a.shape == b.shape))
            return F.silu(a) * b

    def liger_rotary_pos_emb(q, k, cos, sin):
        B, H, T, hd = q.shape
        assert cos.shape in ((1, T, hd), (B, T, hd)) and cos.shape == sin.shape  # HF's layout
        assert k.shape[:1] + k.shape[2:] == (B, T, hd)
        calls.append(("rope", tuple(q.shape), tuple(cos.shape)))
        return apply_rotary_pos_emb(q, k, cos, sin)

    class FusedLinearCrossEntropyLoss(torch.nn.Module):
        def __init__(self, ignore_index):
            super().__init__()
            self.ignore_index = ignore_index

        def forward(self, weight, hidden, target):
            assert hidden.dim() == 2 and target.dim() == 1 and weight.shape[1] == hidden.shape[1]
            calls.append(("flce", tuple(hidden.shape)))
            logits = (hidden @ weight.t()).float()
            return F.cross_entropy(logits, target, ignore_index=self.ignore_index)

    contents = {
        "liger_kernel": {},
        "liger_kernel.ops": {},
        "liger_kernel.ops.rms_norm": {"LigerRMSNormFunction": RMSNormFunction},
        "liger_kernel.ops.swiglu": {"LigerSiLUMulFunction": SiLUMulFunction},
        "liger_kernel.transformers": {},
        "liger_kernel.transformers.rope": {"liger_rotary_pos_emb": liger_rotary_pos_emb},
        "liger_kernel.transformers.fused_linear_cross_entropy": {
            "LigerFusedLinearCrossEntropyLoss": FusedLinearCrossEntropyLoss
        },
    }
    for name, attrs in contents.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)


def test_liger_wiring_calls_each_kernel_in_its_layout_and_matches_the_compiler_path(monkeypatch):
    calls = []
    fake_liger(monkeypatch, calls)
    compiler, liger = model_pair(dataclasses.replace(CFG, qk_norm=True))
    line = apply_liger(liger)
    assert line.startswith("kernels: Liger-Kernel's RMSNorm (9 norms)")  # 2 x (2 + q/k) + the final norm
    assert liger.state_dict().keys() == compiler.state_dict().keys()
    x, y, doc_ids = batch()
    assert_same(loss_logits_grads(compiler, x, y), loss_logits_grads(liger, x, y))
    B, T, H, hd = 2, 24, 4, 16
    assert ("rope", (B, H, T, hd), (1, T, hd)) in calls
    assert ("flce", (B * T, 64)) in calls and ("silu_mul", True) in calls
    assert ("rms_norm", "llama", 0.0, False) in calls
    calls.clear()
    assert_same(
        loss_logits_grads(compiler, x, y, doc_ids=doc_ids), loss_logits_grads(liger, x, y, doc_ids=doc_ids)
    )
    assert ("rope", (B, H, T, hd), (B, T, hd)) in calls  # per-row tables


def test_liger_not_installed_falls_back_with_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import fails as when not installed
    model = build_model(CFG, seed=0)
    line = apply_liger(model)
    assert line.startswith("kernels: compiler fusion (liger-kernel not installed: pip install liger-kernel")
    assert model.head_loss is None and type(model.norm) is torch.nn.RMSNorm


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Liger's Triton kernels need a CUDA GPU")
def test_liger_kernels_match_the_compiler_path_on_cuda():
    pytest.importorskip("liger_kernel", reason="pip install liger-kernel")
    cfg = ModelConfig(
        dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=1000, max_seq_len=128
    )
    compiler = build_model(cfg, "cuda", seed=0)
    liger = copy.deepcopy(compiler)
    assert apply_liger(liger).startswith("kernels: Liger-Kernel's")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randint(0, 1000, (4, 128), device="cuda", generator=g)
    doc_ids = (torch.arange(128, device="cuda") // 40).expand(4, 128)
    for kwargs in ({}, {"doc_ids": doc_ids}):
        results = []
        for model in (compiler, liger):
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, x, **kwargs)
            loss.backward()
            results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        (loss_c, grads_c), (loss_l, grads_l) = results
        torch.testing.assert_close(loss_l, loss_c, rtol=2e-3, atol=2e-3)
        for name, grad in grads_c.items():
            cos = F.cosine_similarity(grad.flatten().float(), grads_l[name].flatten().float(), dim=0)
            assert cos > 0.999, (name, cos.item())


# ---- the plan ---------------------------------------------------------------------------------------------
def plan(gpu="H100 80GB", lora=None, **train):
    raw = {"model": {"preset": "h100-350m"}, "train": {"max_steps": 100, "seq_len": 1024, **train}}
    if lora:
        raw["lora"] = lora
    cfg = config_from_dict(raw)
    return make_plan(cfg, cfg.model, simulated(gpu))


def test_plan_reasons_for_fused_projections_and_kernels(monkeypatch):
    auto = plan()  # unmeasured on a GPU: off, saying so in the user's words
    assert not auto.fused_projections and auto.reasons["fused_projections"] == FUSED_PROJECTIONS_AUTO
    on = plan(fused_projections=True)
    assert on.fused_projections
    assert on.reasons["fused_projections"] == FUSED_PROJECTIONS_ON + " (set by train.fused_projections)"
    assert (
        on.kernels == "compiler"
        and "Liger-Kernel off: not measured faster on a GPU yet" in on.reasons["kernels"]
    )
    lora = plan(lora={"rank": 8}, fused_projections=True)
    assert not lora.fused_projections
    assert lora.reasons["fused_projections"] == (
        "off: LoRA adapts q/k/v and gate/up separately, as peft does (train.fused_projections true asked for it)"
    )
    fp8 = plan(fp8="native", fused_projections=True)
    assert not fp8.fused_projections and fp8.reasons["fused_projections"].startswith("off: float8 (native)")
    off = plan(fused_projections=False)
    assert (
        not off.fused_projections
        and off.reasons["fused_projections"] == "off (set by train.fused_projections)"
    )

    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # find_spec then reports it missing
    missing = plan(kernels="liger")
    assert missing.kernels == "compiler"
    assert (
        missing.reasons["kernels"] == "compiler fusion (liger-kernel not installed: pip install liger-kernel)"
    )
    cpu = plan(gpu="cpu", kernels="liger")
    assert cpu.kernels == "compiler" and "need CUDA, this is cpu" in cpu.reasons["kernels"]
    fake_liger(monkeypatch, [])
    monkeypatch.setattr(sys.modules["liger_kernel"], "__spec__", object())
    liger = plan(kernels="liger")
    assert liger.kernels == "liger" and not liger.fused_projections
    assert "copy the fused GEMM's column slices" in liger.reasons["fused_projections"]
