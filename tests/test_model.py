"""Model shapes, causality, RoPE, grouped-query attention, KV-cache decoding and exact parameter counts."""

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hopperlm.config import ModelConfig
from hopperlm.config.presets import PRESETS, get_preset
from hopperlm.model.generate import generate
from hopperlm.model.transformer import (
    Transformer,
    apply_rope,
    build_model,
    count_params,
    flops_per_token,
    rope_tables,
)

REPO = Path(__file__).resolve().parents[1]


def tiny(**kw) -> ModelConfig:
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=97, max_seq_len=64)
    return ModelConfig(**{**base, **kw})


def test_shapes_and_loss():
    model = build_model(tiny(), seed=0)
    x = torch.randint(0, 97, (3, 20))
    assert model(x).shape == (3, 20, 97)
    loss = model(x, x)
    # an untrained model is close to uniform over the vocabulary
    assert abs(loss.item() - torch.log(torch.tensor(97.0)).item()) < 0.5


def test_causality_token_never_sees_future():
    model = build_model(tiny(), seed=0).eval()
    x = torch.randint(0, 97, (2, 32))
    y = x.clone()
    y[:, 20:] = torch.randint(0, 97, (2, 12))  # change only the future of position 19
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    hd = 16
    cos, sin = rope_tables(64, hd, 10000.0)
    q, k = torch.randn(hd), torch.randn(hd)

    def score(m, n):
        qm = apply_rope(q.view(1, 1, 1, hd).expand(1, 1, 64, hd), cos, sin)[0, 0, m]
        kn = apply_rope(k.view(1, 1, 1, hd).expand(1, 1, 64, hd), cos, sin)[0, 0, n]
        return (qm @ kn).item()

    assert score(10, 3) == pytest.approx(score(40, 33), abs=1e-4)
    assert score(5, 5) == pytest.approx((q @ k).item(), abs=1e-4)  # zero offset: rotation cancels
    assert score(10, 3) != pytest.approx(score(10, 4), abs=1e-3)
    # a rotation preserves the norm of every vector
    rotated = apply_rope(q.view(1, 1, 1, hd).expand(1, 1, 64, hd), cos, sin)
    torch.testing.assert_close(rotated.norm(dim=-1), q.norm().expand(1, 1, 64))


def test_rope_matches_complex_rotation_reference():
    """Rotate-half RoPE equals multiplying (x_i, x_{i+hd/2}) as a complex number by e^{i*pos*theta_i}."""
    torch.manual_seed(1)
    hd, T = 8, 12
    x = torch.randn(1, 1, T, hd)
    cos, sin = rope_tables(T, hd, 500.0)
    ours = apply_rope(x, cos, sin)
    freqs = 1.0 / (500.0 ** (torch.arange(0, hd, 2).float() / hd))
    angle = torch.arange(T).float()[:, None] * freqs[None]
    z = torch.complex(x[..., : hd // 2], x[..., hd // 2 :]) * torch.polar(torch.ones_like(angle), angle)
    torch.testing.assert_close(ours, torch.cat([z.real, z.imag], dim=-1))


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = build_model(tiny(n_kv_heads=2), seed=0).eval()
    mha = build_model(tiny(n_kv_heads=4), seed=1).eval()
    state = gqa.state_dict()
    hd, groups = 16, 2
    for key, value in state.items():
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            # (kv*hd, d) -> each kv head serves `groups` consecutive query heads
            value = value.view(2, hd, -1).repeat_interleave(groups, dim=0).reshape(4 * hd, -1)
        mha.state_dict()[key].copy_(value)
    x = torch.randint(0, 97, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(gqa(x), mha(x), rtol=1e-5, atol=1e-5)


def causal_softmax_attention(attn, q, k, x):
    """The attention layer's output written out: causal softmax(q k^T / sqrt(16)) v over 4 heads x 16, then
    o_proj (x: (1, 10, 64); q, k: (1, 4, 10, 16) after RoPE)."""
    v = attn.v_proj(x).view(1, 10, 4, 16).transpose(1, 2)
    scores = (q @ k.transpose(-1, -2)) / 4.0
    scores = scores.masked_fill(~torch.ones(10, 10, dtype=torch.bool).tril(), float("-inf"))
    return attn.o_proj((F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(1, 10, 64))


def test_attention_matches_explicit_softmax_reference():
    model = build_model(tiny(n_kv_heads=4, n_layers=1), seed=0).eval()
    attn = model.layers[0].attn
    x = torch.randn(1, 10, 64)
    cos, sin = model.rope_cos[:10], model.rope_sin[:10]
    q = apply_rope(attn.q_proj(x).view(1, 10, 4, 16).transpose(1, 2), cos, sin)
    k = apply_rope(attn.k_proj(x).view(1, 10, 4, 16).transpose(1, 2), cos, sin)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, cos, sin), causal_softmax_attention(attn, q, k, x))


def greedy_without_cache(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens, each from a full forward over everything so far (no KV cache)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt) :]


def test_kv_cache_decoding_matches_full_forward():
    model = build_model(tiny(max_seq_len=48), seed=0).eval()
    prompt = [5, 9, 1, 33]
    assert generate(model, prompt, 30, temperature=0.0) == greedy_without_cache(model, prompt, 30)
    # past the context the cache is rebuilt and generation goes on
    assert len(generate(model, prompt, 80, temperature=1.0, top_k=5, seed=0)) == 80


def test_tied_embeddings_share_storage_and_count_once():
    cfg = tiny(tie_embeddings=True)
    model = build_model(cfg, seed=0)
    assert model.lm_head.weight.data_ptr() == model.embed.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg)["total"]


@pytest.mark.parametrize("name", [n for n in PRESETS if PRESETS[n].vocab_size])
def test_preset_param_counts_match_modules(name):
    cfg = get_preset(name)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg)["total"]


def test_exact_preset_sizes():
    # h100-350m: 24 blocks, d=1024, 16 heads x 64, SwiGLU 2816, 32K vocab, untied head
    assert count_params(get_preset("h100-350m"))["total"] == 373_867_520
    h350 = get_preset("h100-350m")
    assert (h350.n_layers, h350.dim, h350.n_heads, h350.head_dim) == (24, 1024, 16, 64)
    # TinyLlama-1.1B and Llama-3-8B: the parameter counts their model cards give
    assert count_params(get_preset("tinyllama-1.1b"))["total"] == 1_100_048_384
    assert count_params(get_preset("llama3-8b"))["total"] == 8_030_261_248
    # FLOPs/token of the 350M model at T=1024 by 6N + 12LdT (PaLM appendix B, nanoGPT's estimate_mfu): about
    # 2.35 GFLOP (2.4-2.5 with a larger vocabulary)
    assert 2.3e9 < flops_per_token(h350, 1024) < 2.4e9


def test_meta_construction_is_instant_for_8b():
    start = time.perf_counter()
    with torch.device("meta"):
        model = Transformer(get_preset("llama3-8b"))
    assert time.perf_counter() - start < 5.0
    assert all(p.is_meta for p in model.parameters())


def test_loading_a_model_for_inference_does_not_import_dynamo():
    """`generate`, `eval` and `export` build an empty model and load weights: nothing there needs torch._dynamo,
    whose import is 1.2 s of their start-up (nn.Embedding's own normal_ and the RoPE tables' arange on the meta
    device imported it). A fresh process, since this one has imported it already."""
    code = (
        "import sys, torch\n"
        "from hopperlm.config import ModelConfig\n"
        "from hopperlm.model.transformer import build_empty\n"
        "model = build_empty(ModelConfig(dim=64, n_layers=2, n_heads=4, vocab_size=256, max_seq_len=32), 'cpu')\n"
        "model(torch.zeros(1, 8, dtype=torch.long))\n"
        "assert 'torch._dynamo' not in sys.modules, 'build_empty imported torch._dynamo'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]


def test_init_scales_residual_projections():
    cfg = dataclasses.replace(tiny(), n_layers=8, dim=128, n_heads=4, n_kv_heads=4, ffn_dim=256)
    model = build_model(cfg, seed=0)
    assert model.layers[0].attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert model.layers[0].attn.o_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.1)
    assert torch.all(model.norm.weight == 1)


def test_qk_norm_normalises_each_heads_queries_and_keys_before_rope():
    cfg = tiny(n_kv_heads=4, n_layers=1, qk_norm=True)
    model = build_model(cfg, seed=0).eval()
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg)["total"]
    attn = model.layers[0].attn
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 1.5)  # a trained gain, so the reference must apply it too
        attn.k_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(1, 10, 64)
    cos, sin = model.rope_cos[:10], model.rope_sin[:10]

    def rms(t, w):  # RMSNorm over head_dim, eps 1e-5
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    q = apply_rope(rms(attn.q_proj(x).view(1, 10, 4, 16), attn.q_norm.weight).transpose(1, 2), cos, sin)
    k = apply_rope(rms(attn.k_proj(x).view(1, 10, 4, 16), attn.k_norm.weight).transpose(1, 2), cos, sin)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, cos, sin), causal_softmax_attention(attn, q, k, x))
    # scaling a query projection's weights does not change the (normalised) attention
    with torch.no_grad():
        before = attn(x, cos, sin)
        attn.q_proj.weight.mul_(7.0)
        torch.testing.assert_close(attn(x, cos, sin), before, rtol=1e-4, atol=1e-5)
    # the KV cache path normalises too
    assert generate(model, [5, 9, 1, 33], 10, temperature=0.0) == greedy_without_cache(
        model, [5, 9, 1, 33], 10
    )


def test_zero_init_output_starts_every_block_as_the_identity():
    model = build_model(tiny(zero_init_output=True), seed=0)
    for layer in model.layers:
        assert torch.all(layer.attn.o_proj.weight == 0) and torch.all(layer.mlp.down_proj.weight == 0)
        assert layer.attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.2)
    x = torch.randint(0, 97, (2, 12))
    with torch.no_grad():  # blocks add nothing: logits = head(norm(embedding))
        torch.testing.assert_close(model(x), model.lm_head(model.norm(model.embed(x))))
    loss = model(x, x)  # and still learn: the zero matrices get gradients
    loss.backward()
    assert model.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0
