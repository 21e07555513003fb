"""Preflight memory estimate: weights, gradients, optimizer state and activations per micro-batch.

The activation count follows what autograd saves for hopperlm's block (transformer.py), tensor by tensor, so
it tracks the code rather than a rule of thumb; tests compare it with the bytes autograd actually saves.
"""

from __future__ import annotations

from dataclasses import dataclass

from hopperlm.config import ModelConfig
from hopperlm.model.lora import adapted_targets, count_trainable, target_shapes
from hopperlm.model.loss import default_chunk_tokens
from hopperlm.model.qlora import nf4_bytes
from hopperlm.model.transformer import count_params

GB = 1e9


@dataclass
class MemoryEstimate:
    params: int
    weights: int  # bytes: fp32 master weights (autocast computes in 16-bit, the parameters stay fp32)
    grads: int  # bytes: fp32 gradients
    optimizer: int  # bytes: AdamW's two fp32 moments
    activations_per_seq: int  # bytes saved for backward per sequence of seq_len tokens
    logits_per_seq: int  # bytes of the logits, their fp32 copy and log-softmax per sequence
    shards: int = 1  # FSDP: weights, grads and optimizer state are split over this many ranks
    gathered: int = 0  # bytes: FSDP's unsharded working set (see estimate_memory)

    @property
    def static(self) -> int:
        return self.weights + self.grads + self.optimizer + self.gathered

    def total(self, micro_batch: int) -> int:
        return self.static + micro_batch * (self.activations_per_seq + self.logits_per_seq)

    def largest_micro_batch(self, budget_bytes: float) -> int:
        """The largest micro-batch whose estimate fits `budget_bytes` (0 when not even the weights fit)."""
        per_seq = self.activations_per_seq + self.logits_per_seq
        return max(0, int((budget_bytes - self.static) // per_seq))

    def describe(self, micro_batch: int) -> str:
        sharded = (
            f" (sharded over {self.shards}) + gathered {self.gathered / GB:.2f}" if self.shards > 1 else ""
        )
        return (
            f"{self.total(micro_batch) / GB:.2f} GB = weights {self.weights / GB:.2f} + grads "
            f"{self.grads / GB:.2f} + AdamW {self.optimizer / GB:.2f}{sharded} + activations "
            f"{micro_batch * (self.activations_per_seq + self.logits_per_seq) / GB:.2f} "
            f"({micro_batch} x {(self.activations_per_seq + self.logits_per_seq) / 1e6:.1f} MB)"
        )


def activation_bytes_per_token(
    cfg: ModelConfig, precision: str, checkpointing: str, fused_loss: bool = False, every: int = 2
) -> tuple[int, int]:
    """(bytes saved per token by all blocks + embedding + final norm, bytes for the logits path per token).

    Per block, with d = dim, kv = kv_heads * head_dim, h = ffn width, H = heads:
      fp32 (CPU): norm inputs 2*4d, normed outputs 2*4d (shared by the projections), q/out 2*4d, k/v 2*4kv,
                  o_proj input 4d, SwiGLU gate/silu/up/product 4*4h                 -> 28d + 8kv + 16h
      16-bit autocast: norm inputs stay fp32 (2*4d); every linear saves its own 16-bit cast of its input
                  (3*2d for q/k/v, 2*2d for gate/up), SDPA saves q, k, v, out (2*(2d + 2kv)) and a
                  fp32 log-sum-exp per head (4H), o_proj input 2d, SwiGLU 4*2h      -> 24d + 4kv + 8h + 4H
      selective-op keeps the block input (4d) and the outputs of the matmuls and attention, each e bytes
                  (e = 2 in 16-bit, 4 in fp32): q, k, v, attention out, o_proj, gate, up, down and the
                  log-sum-exp                                                     -> 4d + e(4d + 2kv + 2h) + 4H
      full activation checkpointing keeps only each block's fp32 input (4d) plus one block's worth, recomputed;
      selective-block does that for one block in `every` and keeps the others whole.
    The logits path: the logits and their fp32 log-softmax; with the fused loss none of it (its chunk
    workspace is counted once, in `fused_loss_workspace`), only the fp32 gradient of the hidden states.
    """
    d, kv, h, H, L, V = (
        cfg.dim,
        cfg.kv_heads * cfg.head_dim,
        cfg.hidden_dim,
        cfg.n_heads,
        cfg.n_layers,
        cfg.vocab_size or 0,
    )
    e = 4 if precision == "fp32" else 2
    if cfg.mlp == "relu2":  # up, its ReLU and the square (3h) where SwiGLU keeps gate, silu, up, product (4h)
        h = h * 3 // 4
    if precision == "fp32":
        block = 28 * d + 8 * kv + 16 * h
        head = 4 * d + 4 * d  # final norm input and its output (the LM head's input)
        logits = 4 * V + 4 * V  # log-softmax output kept for backward, and the logits gradient it makes
    else:
        block = 24 * d + 4 * kv + 8 * h + 4 * H
        head = 4 * d + 2 * d
        logits = 2 * V + 4 * V + 4 * V  # 16-bit logits, their fp32 copy, log-softmax output
    if fused_loss:
        logits = 4 * d  # the gradient of the hidden states, computed in the forward
    recomputed = -(-L // every) if checkpointing == "selective-block" else L
    if checkpointing in ("full", "selective-block"):
        blocks = 4 * d * recomputed + block * (L - recomputed) + block
    elif checkpointing == "selective-op":
        blocks = (4 * d + e * (4 * d + 2 * kv + 2 * h) + 4 * H) * L + block
    else:
        blocks = block * L
    return blocks + head + 4 * d, logits  # + the embedding output (fp32)


def optimizer_bytes(cfg: ModelConfig, optimizer: str, trainable: int | None = None) -> int:
    """Optimizer state: AdamW two fp32 moments; torchao's and bitsandbytes' 8-bit AdamW one byte each plus a
    fp32 scale per block of 256; Muon one fp32 momentum for the blocks' matrices and AdamW's two moments for
    the rest. `trainable`: only that many parameters learn (LoRA)."""
    n = count_params(cfg)["total"] if trainable is None else trainable
    if optimizer in ("adamw8bit", "paged_adamw8bit"):
        return 2 * n + 2 * 4 * -(-n // 256)
    if trainable is not None:
        return 8 * n  # LoRA adapters: AdamW moments (Muon's momentum on them: less)
    if optimizer == "muon":
        matrices = count_params(cfg)["blocks"] - cfg.n_layers * 2 * cfg.dim  # the norms are vectors
        return 4 * matrices + 8 * (n - matrices)
    return 8 * n


def fused_loss_workspace(cfg: ModelConfig) -> int:
    """The fused loss's fixed memory: the fp32 head-weight gradient it accumulates and one chunk of fp32
    logits with its softmax and 16-bit copy."""

    V = cfg.vocab_size or 0
    return 4 * V * cfg.dim + 10 * default_chunk_tokens(V) * V


def estimate_memory(
    cfg: ModelConfig,
    seq_len: int,
    precision: str,
    *,
    checkpointing: str = "none",
    fused_loss: bool = False,
    optimizer: str = "adamw",
    every: int = 2,
    shards: int = 1,
    lora=None,
) -> MemoryEstimate:
    """With FSDP (`shards` > 1) each rank keeps 1/shards of the weights, gradients and optimizer state, plus
    what is unsharded while it runs: the root's weights (embedding, head; gathered for the whole step) and two
    blocks' (the running one and the prefetched next) in the compute dtype, and the fp32 gradients of the
    largest of them before the reduce-scatter."""
    counts = count_params(cfg)
    n = counts["total"]
    acts, logits = activation_bytes_per_token(cfg, precision, checkpointing, fused_loss, every)
    if lora is not None and lora.enabled:
        return _lora_estimate(
            cfg, lora, n, precision, checkpointing, optimizer, seq_len, acts, logits, shards
        )
    gathered = 0
    if shards > 1:
        e = 4 if precision == "fp32" else 2
        block, root = counts["blocks"] // cfg.n_layers, n - counts["blocks"]
        gathered = e * (root + 2 * block) + 4 * max(block, root)
    return MemoryEstimate(
        params=n,
        weights=-(-4 * n // shards),
        grads=-(-4 * n // shards) + (fused_loss_workspace(cfg) if fused_loss else 0),
        optimizer=-(-optimizer_bytes(cfg, optimizer) // shards),
        activations_per_seq=acts * seq_len,
        logits_per_seq=logits * seq_len,
        shards=shards,
        gathered=gathered,
    )


def _lora_estimate(
    cfg, lora, n, precision, checkpointing, optimizer, seq_len, acts, logits, shards=1
) -> MemoryEstimate:
    """LoRA: the adapted matrices frozen in the compute dtype (NF4 with lora.quantize), the rest of the base
    fp32 and frozen, gradients and optimizer state for the adapters only; activations add each adapter's
    rank-r intermediate (the fused loss then needs no head-weight gradient: the head is frozen). With FSDP
    (`shards` > 1) every rank keeps 1/shards of the base, the adapters, their gradients and optimizer state,
    plus what is gathered while it runs: the root (embedding, head) in the compute dtype, two blocks (the
    running one and the prefetched next: NF4 data stays 4-bit, the rest in the compute dtype) and the fp32
    gradients of one block's adapters before their reduce-scatter."""

    targets = adapted_targets(cfg, lora)
    shapes = target_shapes(cfg)
    adapted = cfg.n_layers * sum(shapes[t][0] * shapes[t][1] for t in targets)
    frozen = nf4_bytes(adapted) if lora.quantize == "nf4" else adapted * (4 if precision == "fp32" else 2)
    trainable = count_trainable(cfg, lora)
    e = 4 if precision == "fp32" else 2
    kept = 1 if checkpointing in ("full", "selective-block") else cfg.n_layers
    adapter_acts = kept * e * lora.rank * len(targets)
    gathered = 0
    if shards > 1:
        L, blocks = cfg.n_layers, count_params(cfg)["blocks"]
        block = (frozen + e * (blocks - adapted) + e * trainable) / L
        gathered = int(e * (n - blocks) + 2 * block + 4 * trainable / L)
    return MemoryEstimate(
        params=n + trainable,
        weights=-(-(int(frozen) + 4 * (n - adapted) + 4 * trainable) // shards),
        grads=-(-4 * trainable // shards),
        optimizer=-(-optimizer_bytes(cfg, optimizer, trainable) // shards),
        activations_per_seq=(acts + adapter_acts) * seq_len,
        logits_per_seq=logits * seq_len,
        shards=shards,
        gathered=gathered,
    )
