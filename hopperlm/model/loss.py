"""Cross-entropy of the LM head without the full [tokens, vocab] logits in memory.

The standard path (`lm_head` then `F.cross_entropy(logits.float())`) keeps the logits, their fp32 copy and the
log-softmax for the backward: for 32 sequences of 1024 tokens and a 32K vocabulary that is about 10 GB. The fused
linear cross-entropy here (the idea of Liger-Kernel's FusedLinearCrossEntropy, written in plain PyTorch so
that torch.compile can fuse it further) walks over chunks of tokens: for each chunk it computes the logits,
the loss and, when gradients are needed, the gradients with respect to the hidden states and the head weight
right away, then drops the logits. The backward only scales the stored gradients, so no matmul is repeated:
the FLOPs equal the standard path's and the peak holds one chunk of logits instead of all of them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
CHUNK_ELEMENTS = 1 << 26  # one chunk of fp32 logits stays under 256 MiB whatever the vocabulary


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk: a power of two with chunk x vocab <= CHUNK_ELEMENTS, between 256 and 16384."""
    return max(256, min(16384, 2 ** int(math.log2(max(1, CHUNK_ELEMENTS // vocab_size)))))


def softcapped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap): logits bounded smoothly at +-cap (model.logit_softcap); as they are for None."""
    return logits if cap is None else cap * torch.tanh(logits / cap)


def _chunked(hidden, weight, targets, chunk_tokens, compute_dtype, need_h, need_w, cap=None):
    """(mean loss, d loss/d hidden or None, d loss/d weight or None), one chunk of logits at a time.
    hidden (N, d), weight (V, d), targets (N,) with IGNORE_INDEX where no loss is taken; `cap`: the logits'
    softcap (model.logit_softcap), whose derivative 1 - tanh^2 joins the gradient before its matmuls."""
    n_valid = (targets != IGNORE_INDEX).sum().clamp(min=1)
    w = weight.to(compute_dtype)
    loss = torch.zeros((), device=hidden.device, dtype=torch.float32)
    grad_hidden = torch.empty_like(hidden) if need_h else None
    grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
    for start in range(0, hidden.shape[0], chunk_tokens):
        h = hidden[start : start + chunk_tokens].to(compute_dtype)  # (c, d)
        t = targets[start : start + chunk_tokens]  # (c,)
        logits = (h @ w.t()).float()  # (c, V)
        if cap is not None:
            squashed = torch.tanh(logits / cap)
            logits = cap * squashed
        valid = t != IGNORE_INDEX
        safe_t = torch.where(valid, t, 0)
        lse = torch.logsumexp(logits, dim=-1)  # (c,)
        picked = logits.gather(1, safe_t[:, None]).squeeze(1)
        loss = loss + torch.where(valid, lse - picked, 0.0).sum()
        if need_h or need_w:
            # d(mean loss)/d(logits) = (softmax - onehot) / n_valid on the rows that count
            grad = torch.exp(logits - lse[:, None])
            grad.scatter_add_(1, safe_t[:, None], torch.full_like(lse[:, None], -1.0))
            grad = grad * (valid.float() / n_valid)[:, None]
            if cap is not None:  # d(cap tanh(z / cap))/dz = 1 - tanh^2
                grad = grad * (1 - squashed.square())
            grad = grad.to(compute_dtype)
            if need_h:
                grad_hidden[start : start + chunk_tokens] = (grad @ w).to(hidden.dtype)
            if need_w:
                grad_weight += (grad.t() @ h).float()
    return loss / n_valid, grad_hidden, grad_weight


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens, compute_dtype, cap):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, grad_hidden, grad_weight = _chunked(
            hidden, weight, targets, chunk_tokens, compute_dtype, need_h, need_w, cap
        )
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        dh = grad_hidden * grad_loss.to(grad_hidden.dtype) if grad_hidden is not None else None
        dw = grad_weight * grad_loss if grad_weight is not None else None
        return dh, dw, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` (softcapped at `softcap`, when given) against `targets`, chunk
    by chunk.

    hidden (..., d), weight (V, d), targets (...) with IGNORE_INDEX (-100) for positions without a loss.
    Under autocast the matmuls run in the autocast dtype and the softmax in fp32, as on the standard path.
    """
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = weight.dtype
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    args = (hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), chunk, compute_dtype)
    with torch.autocast(device_type, enabled=False):  # the dtypes are chosen explicitly inside
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            return _LinearCrossEntropy.apply(*args, softcap)
        return _chunked(*args, need_h=False, need_w=False, cap=softcap)[0]  # evaluation: the loss alone


def standard_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of full logits (..., V) in fp32: the reference the fused path must match."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE_INDEX)
