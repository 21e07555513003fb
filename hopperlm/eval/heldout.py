"""Loss and perplexity of a model on held-out text.

Sources: a text file (one document), JSONL / TSV / Parquet / folders (documents as `prepare` reads them), or a
prepared data folder (its validation split, else its train split; its tokenizer must be the model's). Text is
tokenized with the model's tokenizer, documents joined with EOS as `prepare` does, and scored in windows of
seq_len predictions with stride seq_len, so every token after the first is predicted exactly once. Reported:
nats per token, perplexity = exp(that), and bits per byte (total nats / ln 2 / UTF-8 bytes), which unlike
per-token numbers compares models with different tokenizers (an extended tokenizer makes fewer, harder tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from hopperlm.data.loader import TokenShards
from hopperlm.data.shards import read_manifest
from hopperlm.data.tokenizer import Tokenizer
from hopperlm.data.tokenizer_train import corpus_texts
from hopperlm.errors import DataError


@dataclass
class HeldOut:
    name: str
    tokens: int  # predicted tokens
    nats_per_token: float
    bytes: int | None  # UTF-8 bytes those tokens cover (None for prepared shards: the text is not at hand)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nats_per_token)

    @property
    def bits_per_byte(self) -> float | None:
        if not self.bytes:
            return None
        return self.nats_per_token * self.tokens / math.log(2) / self.bytes

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "tokens": self.tokens,
            "loss": self.nats_per_token,
            "perplexity": self.perplexity,
            "bits_per_byte": self.bits_per_byte,
        }


def text_documents(path: Path, text_field: str = "text") -> list[str]:
    """A .txt file is one document; other inputs are read as `prepare` reads them."""
    if path.is_file() and path.suffix == ".txt":
        return [path.read_text(encoding="utf-8")]

    return list(corpus_texts([path], text_field))


def token_stream(path: Path, tokenizer: Tokenizer, max_tokens: int | None) -> tuple[np.ndarray, int | None]:
    """(token ids, UTF-8 bytes they cover) of a held-out source."""

    if path.is_dir() and (path / "manifest.json").is_file():
        manifest = read_manifest(path)
        if manifest["tokenizer"]["sha256"] != tokenizer.sha256:
            raise DataError(
                f"{path} was prepared with another tokenizer than the model's ({manifest['tokenizer'].get('name')}); "
                "prepare it with the model's tokenizer or pass the text itself"
            )
        split = "val" if manifest["tokens"].get("val", 0) > 0 else "train"
        shards = TokenShards(path, split)
        n = len(shards) if max_tokens is None else min(len(shards), max_tokens + 1)
        return shards.read(0, n), None
    docs = text_documents(path)
    ids: list[int] = []
    total_bytes = 0
    for doc in docs:
        ids += tokenizer.encode(doc) + [tokenizer.eos_id]
        total_bytes += len(doc.encode("utf-8"))
        if max_tokens is not None and len(ids) > max_tokens:
            break
    if len(ids) < 2:
        raise DataError(f"{path} holds too little text to evaluate")
    full = len(ids)
    if max_tokens is not None and full > max_tokens + 1:
        total_bytes = round(total_bytes * (max_tokens + 1) / full)  # prorated: the tail is not scored
        ids = ids[: max_tokens + 1]
    return np.asarray(ids, dtype=np.int64), total_bytes


@torch.no_grad()
def heldout_loss(
    model, tokenizer: Tokenizer, path: Path, seq_len: int, batch: int = 8, max_tokens: int | None = None
) -> HeldOut:
    """Mean next-token loss over the whole source (see the module doc)."""
    ids, nbytes = token_stream(Path(path), tokenizer, max_tokens)
    seq_len = min(seq_len, model.cfg.max_seq_len)
    device = model.embed.weight.device
    starts = list(range(0, len(ids) - 1, seq_len))
    total, count = 0.0, 0
    model.eval()
    for i in range(0, len(starts), batch):
        group = starts[i : i + batch]
        lengths = [min(seq_len, len(ids) - 1 - s) for s in group]
        # full windows batch together; the last, shorter one goes alone
        for length in sorted(set(lengths)):
            rows = [s for s, n in zip(group, lengths, strict=True) if n == length]
            x = torch.from_numpy(np.stack([ids[s : s + length] for s in rows])).to(device)
            y = torch.from_numpy(np.stack([ids[s + 1 : s + length + 1] for s in rows])).to(device)
            logits = model(x)
            total += F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum").item()
            count += y.numel()
    return HeldOut(str(path), count, total / count, nbytes)
