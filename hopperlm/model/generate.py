"""Sampling with a KV cache: one prefill of the prompt, then one token per forward pass."""

from __future__ import annotations

import torch

from hopperlm.model.transformer import Transformer


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None, generator=None) -> torch.Tensor:
    """logits (B, V) -> next ids (B, 1). temperature 0 means greedy."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    eos_id: int | None = None,
    seed: int | None = None,
) -> list[int]:
    """Continue `prompt` by up to max_new_tokens ids (stops early at eos_id). When the context is full the
    cache is rebuilt from the last half-context of tokens, so generation may run past max_seq_len."""
    if not prompt:
        raise ValueError("generate needs at least one prompt token")
    device = model.embed.weight.device
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    ctx = model.cfg.max_seq_len
    was_training = model.training
    model.eval()
    tokens = list(prompt)
    try:
        model.setup_cache(batch=1, max_len=ctx)
        window = tokens[-ctx:]
        logits = model(torch.tensor([window], device=device))[:, -1]
        pos = len(window)
        for _ in range(max_new_tokens):
            nxt = sample_next(logits, temperature, top_k, generator)
            tokens.append(int(nxt))
            if eos_id is not None and tokens[-1] == eos_id:
                break
            if pos >= ctx:  # context full: re-prefill the most recent half of it
                window = tokens[-(ctx // 2) :]
                logits = model(torch.tensor([window], device=device))[:, -1]
                pos = len(window)
            else:
                logits = model(nxt.view(1, 1), pos=pos)[:, -1]
                pos += 1
    finally:
        model.clear_cache()
        model.train(was_training)
    return tokens[len(prompt) :]
