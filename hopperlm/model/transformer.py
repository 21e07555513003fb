"""LLaMA-style decoder: RMSNorm, RoPE, grouped-query attention through SDPA, SwiGLU (or ReLU²), tied or untied
head; optionally QK-norm (Qwen3) and a logit softcap.

Module names follow the Hugging Face Llama layout (q_proj ... down_proj) so conversion and LoRA targets read
the same. RoPE uses the "rotate half" convention of HF Llama checkpoints.

Seams the speed-ups set (hopperlm/speed/), none of which touches a parameter or a state-dict key:
  Attention.fused_qkv, SwiGLU.fused_gate_up  one GEMM over the projections' weights concatenated at compute time
                                             (speed/fused_projections.py)
  Attention.rope, SwiGLU.act, Transformer.head_loss
                                             the RoPE, SiLU-mul and LM-head-loss functions (speed/liger.py swaps
                                             in Liger-Kernel's)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from hopperlm.config import ModelConfig
from hopperlm.model.attention import DocumentMask, document_mask, masked_attention, positions_from_doc_ids
from hopperlm.model.completep import residual_init_std, residual_multiplier
from hopperlm.model.loss import linear_cross_entropy, softcapped, standard_cross_entropy
from hopperlm.model.mup import base_config, matrix_multipliers, output_multiplier
from hopperlm.model.rope import scale_inv_freq


def rope_tables(
    seq_len: int,
    head_dim: int,
    theta: float,
    device: torch.device | None = None,
    scaling: dict[str, float] | None = None,
):
    """cos/sin tables, each (seq_len, head_dim), in fp32: frequency i repeats in both halves (rotate-half).
    `scaling`: the long-context frequency scaling of some checkpoints (model/rope.py)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    inv_freq = scale_inv_freq(inv_freq, scaling)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates pairs (i, i + hd/2) of x (..., hd) by position-dependent angles; cos/sin are full-width tables
    (rope_tables) shaped to broadcast against x: (T, hd) for x (B, H, T, hd), (T, 1, hd) or (B, T, 1, hd) for
    x (B, T, H, hd). In fp32, returned in x's dtype.

    Each half is written from the two halves directly (x1*cos - x2*sin, x2*cos + x1*sin) instead of
    x*cos + cat([-x2, x1])*sin: eager, no negated or rotated copy of x is materialised; equal to HF's
    apply_rotary_pos_emb in fp32 (a + (-b)*s == a - b*s exactly, and the tables' halves are equal). Compiled
    alone, inductor fuses either form into one kernel forward and one backward (CPU, torch 2.13,
    tests/test_fused_kernels.py); inside a compiled Attention (CPU, fp32, in the (B, T, H, hd) layout) the
    backward took 4 kernels where the old form on (B, H, T, hd) took 5."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[..., :half], sin[..., :half]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).type_as(x)


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q (B, T, nh, hd) and k (B, T, nkv, hd), straight out of the projections; cos/sin (T, hd), or
    (B, T, hd) for per-row positions (packed documents). The default `Attention.rope`."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over the heads
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: silu(gate) * up. The default `SwiGLU.act`."""
    return F.silu(gate) * up


def fused_linear(x: torch.Tensor, layers: Sequence[nn.Linear]) -> tuple[torch.Tensor, ...]:
    """layer(x) for each layer, as one GEMM over their weights concatenated now; the outputs are views (column
    slices) of that GEMM's result. The backward's input gradient is then one GEMM, not one per layer plus the
    adds that sum them. The concatenation is a copy of the weights per call: for h100-350m (d=1024, MHA,
    ffn 2816) 3.1M elements for q/k/v and 5.8M for gate/up per block, 6% of the 143M elements that those GEMMs
    write for one 16 x 1024-token micro-batch; under bf16 autocast it replaces the per-layer casts to bf16 the
    separate layers do anyway (compiled: one kernel does both), and autograd saves that one bf16 copy in
    place of the three per-layer ones. (fp32 without autocast saves the fp32 copy, 36 MB per block at that size: CPU runs.)"""
    weight = torch.cat([layer.weight for layer in layers])
    bias = None if layers[0].bias is None else torch.cat([layer.bias for layer in layers])
    return F.linear(x, weight, bias).split([layer.out_features for layer in layers], dim=-1)


class KVCache(nn.Module):
    """Keys and values of the positions generated so far, for one batch of sequences."""

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (batch, kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = pos + k.shape[2]
        self.k[:, :, pos:end] = k
        self.v[:, :, pos:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # per-head RMSNorm of queries and keys (model.qk_norm), applied before RoPE as in Qwen3
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.dropout = cfg.dropout
        self.cache: KVCache | None = None
        # q/k/v as one GEMM (fused_linear); only for plain nn.Linear projections, which
        # speed/fused_projections.py checks once when it sets this
        self.fused_qkv = False
        self.rope: Callable = rope_qk  # (q, k, cos, sin) -> (q, k) in (B, T, H, hd); speed/liger.py swaps it

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        pos: int = 0,
        docs: DocumentMask | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        if self.fused_qkv:
            q, k, v = fused_linear(x, (self.q_proj, self.k_proj, self.v_proj))
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, self.n_heads, self.head_dim)  # (B, T, nh, hd)
        k = k.view(B, T, self.kv_heads, self.head_dim)  # (B, T, nkv, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # RoPE writes in the projections' own layout; SDPA takes transposed views (B, H, T, hd) of it (the last
        # dimension stays contiguous, as its kernels need)
        q, k = self.rope(q, k, cos, sin)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, nh, T, hd), (B, nkv, T, hd)
        v = v.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        if docs is not None:  # packed documents: attention stays inside each one (model/attention.py)
            dropout = self.dropout if self.training else 0.0
            y = masked_attention(q, k, v, docs, dropout, enable_gqa=self.kv_heads != self.n_heads)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
        mask, causal = None, True
        if self.cache is not None:
            k, v = self.cache.update(pos, k, v)  # (B, nkv, pos+T, hd)
            if pos > 0:
                # queries at pos..pos+T-1 see every cached key up to their own position
                causal = False
                mask = torch.ones(T, pos + T, dtype=torch.bool, device=x.device).tril(diagonal=pos)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=causal,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.kv_heads != self.n_heads,
        )  # (B, nh, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.down_proj = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        self.fused_gate_up = False  # gate/up as one GEMM (fused_linear), as Attention.fused_qkv
        self.act: Callable = silu_mul  # (gate, up) -> hidden; speed/liger.py swaps it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up:
            gate, up = fused_linear(x, (self.gate_proj, self.up_proj))
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate, up))


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """ReLU², relu(x)^2 (Primer, So et al. 2021): transformers' "relu2" activation."""
    return F.relu(x).square()


class ReLU2MLP(nn.Module):
    """The non-gated MLP of modded-nanogpt and nanochat (model.mlp relu2): down(relu(up(x))^2). Named as
    transformers' ArceeMLP (up_proj, down_proj), which exports it."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.down_proj = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu_squared(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = ReLU2MLP(cfg) if cfg.mlp == "relu2" else SwiGLU(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        # CompleteP's (base_depth / n_layers) on both branches' outputs (model/completep.py); 1 otherwise
        self.residual_mult = residual_multiplier(cfg)
        # recompute(fn, *args) runs fn while saving less for the backward
        # (speed/activation_checkpointing.py sets it)
        self.recompute: Callable | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        pos: int = 0,
        docs: DocumentMask | None = None,
    ) -> torch.Tensor:
        if self.recompute is not None and torch.is_grad_enabled():
            return self.recompute(self._forward, x, cos, sin, pos, docs)
        return self._forward(x, cos, sin, pos, docs)

    def _forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: int, docs: DocumentMask | None
    ) -> torch.Tensor:
        x = x + self.branch(self.attn(self.attn_norm(x), cos, sin, pos, docs))
        return x + self.branch(self.mlp(self.mlp_norm(x)))

    def branch(self, y: torch.Tensor) -> torch.Tensor:
        """A branch's output as it joins the residual stream: dropout, times CompleteP's multiplier (none at 1, so
        standard and completep at base_depth compute the same bits)."""
        y = self.drop(y)
        return y * self.residual_mult if self.residual_mult != 1.0 else y


class Transformer(nn.Module):
    """Build on the meta device and call `init_weights()` after `to_empty()`; `build_model` does both (weights
    and RoPE tables are allocated here, never filled: `build_empty` fills only the tables)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError(
                "ModelConfig.vocab_size must be resolved (from the data) before building a model"
            )
        self.cfg = cfg
        self.fused_loss = False  # chunked linear cross-entropy (model/loss.py), set from the plan
        # (h (B, T, d), head weight (V, d), targets (B, T)) -> mean loss, replacing both losses above when set
        # (speed/liger.py: Liger's fused linear cross-entropy)
        self.head_loss: Callable | None = None
        # the table without nn.Embedding's own random init, which init_weights() replaces anyway: normal_ on the
        # meta device runs torch's Python reference, whose first call imports torch._dynamo (1.2 s of every
        # `generate`, `eval` and `export` start, where no optimizer imports it; tests/test_model.py)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim, _weight=torch.empty(cfg.vocab_size, cfg.dim))
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.output_mult = output_multiplier(cfg)  # μP's base_dim / dim on the head's input; 1 otherwise
        # the RoPE tables' room: init_buffers() fills them once the model is on its device (arange on the meta
        # device would import torch._dynamo, as normal_ would above)
        table = (cfg.max_seq_len, cfg.head_dim)
        self.register_buffer("rope_cos", torch.empty(table, dtype=torch.float32), persistent=False)
        self.register_buffer("rope_sin", torch.empty(table, dtype=torch.float32), persistent=False)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """What to_empty() leaves undefined besides the weights: the tie and the RoPE tables."""
        cfg = self.cfg
        if cfg.tie_embeddings:  # to_empty() gives each module its own tensor; tie again
            self.lm_head.weight = self.embed.weight
        device = self.rope_cos.device
        cos, sin = rope_tables(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta, device, cfg.rope_scaling)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, init_std) for every matrix; residual output projections scaled by 1/sqrt(2*n_layers)
        (GPT-2) so the residual stream's variance does not grow with depth (under CompleteP 1/sqrt(2*base_depth):
        its multiplier does that, model/completep.py), or zero with model.zero_init_output; under μP the blocks'
        matrices further by m^-1/2 (model/mup.py); norms to one, biases to zero."""
        cfg = self.cfg
        self.init_buffers()
        residual_std = residual_init_std(cfg)
        width = {}
        if cfg.parametrization == "mup":
            width = matrix_multipliers(parameter_shapes(cfg), parameter_shapes(base_config(cfg)))
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                residual = name.endswith(("o_proj", "down_proj"))
                std = (residual_std if residual else cfg.init_std) * width.get(f"{name}.weight", 1.0) ** -0.5
                if residual and cfg.zero_init_output:
                    nn.init.zeros_(module.weight)
                else:
                    nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=cfg.init_std)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        pos: int = 0,
        doc_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, V), or the mean cross-entropy when targets (B, T) are given.
        `pos` is the position of tokens[:, 0]; nonzero only when decoding with a KV cache.
        `doc_ids` (B, T): packed documents; attention stays within each and RoPE `positions` (B, T; by default
        derived from doc_ids) restart per document."""
        T = tokens.shape[1]
        cos, sin = self.rope_cos[pos : pos + T], self.rope_sin[pos : pos + T]  # (T, hd)
        docs = None
        if doc_ids is not None:
            positions = positions_from_doc_ids(doc_ids) if positions is None else positions
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # (B, T, hd)
            docs = document_mask(doc_ids, self.cfg.dropout if self.training else 0.0)
        x = self.drop(self.embed(tokens))  # (B, T, d)
        for layer in self.layers:
            x = layer(x, cos, sin, pos, docs)
        if targets is None:
            return softcapped(self.lm_head(self.head_input(x)), self.cfg.logit_softcap)  # (B, T, V)
        return self.output_loss(x, targets)

    def head_input(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm, times μP's output multiplier ((x * s) W^T = s * logits, so the fused loss gets it too)."""
        h = self.norm(x)
        return h * self.output_mult if self.output_mult != 1.0 else h

    def output_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Final norm, LM head and mean cross-entropy: its own method so it can be compiled as one region."""
        h = self.head_input(x)  # (B, T, d)
        cap = self.cfg.logit_softcap
        if self.head_loss is not None:
            return self.head_loss(h, self.lm_head.weight, targets)
        if self.fused_loss:
            return linear_cross_entropy(h, self.lm_head.weight, targets, softcap=cap)
        return standard_cross_entropy(softcapped(self.lm_head(h), cap), targets)

    def setup_cache(self, batch: int, max_len: int | None = None) -> None:
        """Give every attention layer a KV cache for generation (`clear_cache` removes them)."""
        ref = self.embed.weight
        max_len = max_len or self.cfg.max_seq_len
        for layer in self.layers:
            attn = layer.attn
            attn.cache = KVCache(batch, attn.kv_heads, max_len, attn.head_dim, ref.dtype, ref.device)

    def clear_cache(self) -> None:
        for layer in self.layers:
            layer.attn.cache = None


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu", seed: int | None = None) -> Transformer:
    """Construct on the meta device (instant, no memory even for 8B), then allocate on `device` and initialise."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    if seed is not None:
        torch.manual_seed(seed)
    model.init_weights()
    return model


def build_empty(cfg: ModelConfig, device: torch.device | str) -> Transformer:
    """A model whose weights are about to be loaded: allocated, RoPE tables set and tied weights tied, no
    random initialisation."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.init_buffers()
    return model


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape by name, from the config (built on the meta device: no memory)."""
    with torch.device("meta"):
        return {name: tuple(p.shape) for name, p in Transformer(cfg).named_parameters()}


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter counts from the config alone (no model needed; matches the built module)."""
    d, hd, L, V = cfg.dim, cfg.head_dim, cfg.n_layers, cfg.vocab_size or 0
    attn = d * cfg.n_heads * hd * 2 + d * cfg.kv_heads * hd * 2
    if cfg.qkv_bias:
        attn += (cfg.n_heads + 2 * cfg.kv_heads) * hd
    if cfg.qk_norm:
        attn += 2 * hd
    mlp = (2 if cfg.mlp == "relu2" else 3) * d * cfg.hidden_dim
    per_block = attn + mlp + 2 * d
    embedding = V * d
    head = 0 if cfg.tie_embeddings else V * d
    blocks = L * per_block
    total = embedding + blocks + d + head
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding, "blocks": blocks}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward), PaLM appendix B as in nanoGPT's estimate_mfu:
    6*N + 12*L*d*T, with N = parameters excluding the input embedding but including the LM head matrix
    (counted even when tied: its matmul runs either way), L layers, d width, T context."""
    counts = count_params(cfg)
    n = counts["non_embedding"] + (counts["embedding"] if cfg.tie_embeddings else 0)
    return 6 * n + 12 * cfg.n_layers * cfg.dim * seq_len
