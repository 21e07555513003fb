"""Sampling with a KV cache: one prefill of the prompt, then one token per forward pass.

The next token is chosen as transformers' `generate` chooses it, processors in its order: repetition penalty
(greedy too), then, when sampling, temperature, top-k, top-p; then argmax (temperature 0) or a draw.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from hopperlm.model.transformer import Transformer

SAMPLING_DEFAULTS = {"temperature": 0.8, "top_k": 200, "top_p": 1.0, "repetition_penalty": 1.0}
"""How `hopperlm generate` samples a model that has no generation_config.json (a run hopperlm trained)."""
MAX_NEW_TOKENS = 200


def sampling_generation_config() -> dict:
    """generation_config.json fields under which transformers samples as `hopperlm generate` samples a model
    without one: what an export of a hopperlm-trained run should carry, so the export samples as the run did."""
    return {
        "do_sample": True,
        "temperature": SAMPLING_DEFAULTS["temperature"],
        "top_k": SAMPLING_DEFAULTS["top_k"],
    }


@dataclass(frozen=True)
class GenerationDefaults:
    """A model's generation_config.json as transformers reads it: unset fields take transformers' defaults."""

    temperature: float
    """0 when do_sample is false (greedy), else the sampling temperature."""
    top_k: int
    """0 = off."""
    top_p: float
    repetition_penalty: float
    max_new_tokens: int | None
    """None when the file sets none (the caller's default applies)."""
    eos_ids: list[int] | None
    """eos_token_id (an id or a list of ids); None when the file names none (the tokenizer's EOS applies)."""


def generation_defaults(config: dict) -> GenerationDefaults:
    """GenerationDefaults from the parsed generation_config.json (transformers' GenerationConfig defaults for
    what it leaves out: do_sample false, temperature 1.0, top_k 50, top_p 1.0, repetition_penalty 1.0)."""

    def value(key: str, default):
        return default if config.get(key) is None else config[key]

    eos = config.get("eos_token_id")
    eos_ids = None if eos is None else [int(i) for i in (eos if isinstance(eos, list) else [eos])]
    return GenerationDefaults(
        temperature=float(value("temperature", 1.0)) if value("do_sample", False) else 0.0,
        top_k=int(value("top_k", 50)),
        top_p=float(value("top_p", 1.0)),
        repetition_penalty=float(value("repetition_penalty", 1.0)),
        max_new_tokens=config.get("max_new_tokens"),
        eos_ids=eos_ids or None,
    )


def process_logits(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int | None = None,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits (B, V) -> fp32 scores (B, V) as transformers' processors leave them, in the same order:
    RepetitionPenaltyLogitsProcessor (ids marked in `seen`, a (B, V) bool mask: a positive score divided by
    the penalty, a negative one multiplied), then only when sampling (temperature > 0) TemperatureLogitsWarper,
    TopKLogitsWarper (top_k None or 0 = off) and TopPLogitsWarper (the smallest set of most likely tokens
    whose probability reaches top_p; at least one). Removed tokens score -inf."""
    scores = logits.float()
    if repetition_penalty != 1.0 and seen is not None:
        penalised = torch.where(scores < 0, scores * repetition_penalty, scores / repetition_penalty)
        scores = torch.where(seen, penalised, scores)
    if temperature <= 0:
        return scores
    if temperature != 1.0:
        scores = scores / temperature
    if top_k:
        kth = torch.topk(scores, min(top_k, scores.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)  # (B, V), least likely first
        remove = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        remove[:, -1:] = False  # keep the most likely token whatever top_p is
        scores = scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    return scores


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    generator=None,
    *,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits (B, V) -> next ids (B, 1). temperature 0 means greedy (after the repetition penalty)."""
    scores = process_logits(
        logits,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        repetition_penalty=repetition_penalty,
        seen=seen,
    )
    if temperature <= 0:
        return scores.argmax(dim=-1, keepdim=True)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    eos_id: int | Iterable[int] | None = None,
    seed: int | None = None,
    *,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    stop: Callable[[list[int]], bool] | None = None,
) -> list[int]:
    """Continue `prompt` by up to max_new_tokens ids; stops after any id of eos_id (one id or several, as a
    generation_config.json's eos_token_id list), which is returned with the rest, or once `stop(new ids)` is
    true (a stop string appeared: lm-eval's tasks). When the context is full the cache is rebuilt from the
    last half-context of tokens, so generation may run past max_seq_len."""
    if not prompt:
        raise ValueError("generate needs at least one prompt token")
    stop_ids = set() if eos_id is None else {eos_id} if isinstance(eos_id, int) else set(eos_id)
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
        logits = model(torch.tensor([window], device=device))[:, -1]  # (1, V)
        seen = None
        if repetition_penalty != 1.0:  # every id of the prompt and the output so far, as transformers counts
            seen = torch.zeros(logits.shape, dtype=torch.bool, device=device)
            seen[0, torch.tensor([t for t in tokens if t < logits.shape[-1]], dtype=torch.long)] = True
        pos = len(window)
        for _ in range(max_new_tokens):
            nxt = sample_next(
                logits,
                temperature,
                top_k,
                generator,
                top_p=top_p,
                repetition_penalty=repetition_penalty,
                seen=seen,
            )
            tokens.append(int(nxt))
            if tokens[-1] in stop_ids or (stop is not None and stop(tokens[len(prompt) :])):
                break
            if seen is not None:
                seen[0, tokens[-1]] = True
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
