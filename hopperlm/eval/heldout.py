"""Loss, perplexity and bits per byte of a model on held-out text, scored as the numbers it is compared with are.

Context: `--seq-len`, else the context the model was trained at (a hopperlm run: its train.seq_len), else the
model's own (a Hugging Face folder: max_position_embeddings), capped so one window's logits fit in memory.

Sources and windows:
- text (a .txt file is one document; JSONL / TSV / Parquet / folders as `prepare` reads them): each document is
  encoded as transformers' `tokenizer(text)` encodes it (Tokenizer.encode_for_model: BOS first for Llama
  tokenizers), documents joined with EOS; windows of seq_len + 1 tokens at stride seq_len, so every token after
  the first is predicted exactly once (the last window may be shorter). The loss is what
  `model(window, labels=window).loss` gives in transformers, weighted by each window's predictions.
- a prepared data folder (its validation split, else its train split; its tokenizer must be the model's): the
  very windows training validates on (data/loader.py's eval_windows: seq_len + 1 tokens each, at stride
  seq_len + 1, at most `windows` of them evenly spaced; a run's own train.eval_windows and document masks
  when it packed), so the loss of a run on its own data equals the val_loss it logged.
Reported: nats per token, perplexity = exp(that), bits per byte = total nats / ln 2 / UTF-8 bytes of the
scored text (text: the source's bytes; prepared data: the scored tokens' bytes, counted exactly for the byte
tokenizer and from the decoded text otherwise), which unlike per-token numbers compares models with different
tokenizers (an extended tokenizer makes fewer, harder tokens).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from hopperlm.data.loader import TokenShards, eval_windows, read_batch
from hopperlm.data.shards import read_manifest
from hopperlm.data.tokenizer import Tokenizer
from hopperlm.data.tokenizer_train import corpus_texts
from hopperlm.errors import DataError
from hopperlm.model.loss import IGNORE_INDEX

CPU_LOGITS_BUDGET = 2 * 2**30  # bytes for one batch's logits on a CPU (on CUDA: a quarter of free memory)
LOGIT_BYTES = 12  # per logit: the fp32 logits, their log-softmax and slack


@dataclass
class HeldOut:
    name: str
    tokens: int  # predicted tokens
    nats_per_token: float
    bytes: int | None  # UTF-8 bytes those tokens cover
    seq_len: int = 0  # predictions per (full) window
    stride: int = 0  # tokens from one window's start to the next
    windows: int = 0

    @property
    def perplexity(self) -> float:
        return math.exp(self.nats_per_token)

    @property
    def bits_per_byte(self) -> float | None:
        if not self.bytes:
            return None
        return self.nats_per_token * self.tokens / math.log(2) / self.bytes

    @property
    def windowing(self) -> str:
        """The windows scored, in one line: length, stride, count, tokens scored."""
        return (
            f"windows of {self.seq_len + 1} tokens ({self.seq_len} predicted), stride {self.stride}, "
            f"{self.windows:,} windows, {self.tokens:,} tokens scored"
        )

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "tokens": self.tokens,
            "loss": self.nats_per_token,
            "perplexity": self.perplexity,
            "bits_per_byte": self.bits_per_byte,
            "bytes": self.bytes,
            "window": self.seq_len + 1,
            "stride": self.stride,
            "windows": self.windows,
        }


def logits_budget(device: torch.device) -> int:
    """Bytes one batch's logits may take on `device`."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 4
    return CPU_LOGITS_BUDGET


def default_context(model, trained_seq_len: int | None, requested: int | None) -> tuple[int, str]:
    """(seq_len, why) of held-out windows: --seq-len, else the run's train.seq_len, else the model's context
    capped so one window's logits fit in memory; never beyond the model's context."""
    ctx = model.cfg.max_seq_len
    if requested is not None:
        if requested > ctx:
            return ctx, f"--seq-len {requested} capped at the model's context {ctx}"
        return requested, "--seq-len"
    if trained_seq_len is not None:
        return min(trained_seq_len, ctx), "the run's train.seq_len"
    fits = logits_budget(model.embed.weight.device) // (model.cfg.vocab_size * LOGIT_BYTES)
    if fits < ctx:
        cap = max(64, fits // 64 * 64)
        return cap, f"the model's context {ctx} capped at {cap} so one window's logits fit in memory"
    return ctx, "the model's context (max_position_embeddings)"


def default_batch(model, seq_len: int) -> int:
    """Windows per forward when the run's micro-batch is not known: up to 8, as many as fit in memory."""
    per_window = seq_len * model.cfg.vocab_size * LOGIT_BYTES
    return max(1, min(8, logits_budget(model.embed.weight.device) // per_window))


def text_documents(path: Path, text_field: str = "text") -> list[str]:
    """A .txt file is one document; other inputs are read as `prepare` reads them."""
    if path.is_file() and path.suffix == ".txt":
        return [path.read_text(encoding="utf-8")]

    return list(corpus_texts([path], text_field))


def is_prepared(path: Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "manifest.json").is_file()


def prepared_split(path: Path, tokenizer: Tokenizer) -> TokenShards:
    """The validation split of a prepared folder (its train split when it has none), checked to have been
    prepared with `tokenizer`."""
    manifest = read_manifest(path)
    if manifest["tokenizer"]["sha256"] != tokenizer.sha256:
        raise DataError(
            f"{path} was prepared with another tokenizer than the model's ({manifest['tokenizer'].get('name')}); "
            "prepare it with the model's tokenizer or pass the text itself"
        )
    return TokenShards(path, "val" if manifest["tokens"].get("val", 0) > 0 else "train")


def token_stream(path: Path, tokenizer: Tokenizer, max_tokens: int | None) -> tuple[np.ndarray, int]:
    """(token ids, UTF-8 bytes they cover) of a text source: each document as transformers' tokenizer(doc)
    encodes it, documents joined with EOS; at most max_tokens + 1 ids (the bytes then prorated)."""
    docs = text_documents(path)
    ids: list[int] = []
    total_bytes = 0
    for doc in docs:
        if ids:
            ids.append(tokenizer.eos_id)
        ids += tokenizer.encode_for_model(doc)
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


def scored_bytes(tokenizer: Tokenizer, windows: np.ndarray) -> int:
    """UTF-8 bytes of the predicted tokens windows[:, 1:]: exact for the byte tokenizer (every id below 256 is
    one byte), else the decoded window less its decoded first token."""
    if tokenizer.kind == "byte":
        return int((windows[:, 1:] < 256).sum())
    total = 0
    for row in windows.tolist():
        total += len(tokenizer.decode(row).encode("utf-8")) - len(tokenizer.decode(row[:1]).encode("utf-8"))
    return total


def _nats(model, x: torch.Tensor, y: torch.Tensor, model_kwargs: dict, autocast: torch.dtype | None):
    """Summed next-token cross-entropy of the batch, as a 0-d tensor (no host sync)."""
    device = model.embed.weight.device
    amp = torch.autocast(device.type, dtype=autocast) if autocast else contextlib.nullcontext()
    with amp:
        logits = model(x, **model_kwargs)  # (B, T, V)
    return F.cross_entropy(
        logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


@torch.no_grad()
def heldout_loss(
    model,
    tokenizer: Tokenizer,
    path: Path,
    seq_len: int,
    batch: int = 8,
    max_tokens: int | None = None,
    *,
    windows: int | None = None,
    packing: bool = False,
    autocast: torch.dtype | None = None,
) -> HeldOut:
    """Mean next-token loss of a source in the windows the module doc describes. `windows`, `packing`: a
    prepared folder's validation windows (default every window); `autocast`: the dtype a run validated in."""
    path = Path(path)
    seq_len = min(seq_len, model.cfg.max_seq_len)
    model.eval()
    if is_prepared(path):
        return _prepared_loss(
            model, tokenizer, path, seq_len, batch, max_tokens, windows, packing=packing, autocast=autocast
        )
    device = model.embed.weight.device
    ids, nbytes = token_stream(path, tokenizer, max_tokens)
    starts = list(range(0, len(ids) - 1, seq_len))
    # every forward has one shape (B, T), so a compiled model compiles once: the last batch is padded with
    # rows and the last, shorter window with positions whose targets are ignored (causal attention keeps the
    # padding out of the real positions; token 0 is as good a filler as any)
    T, B = min(seq_len, len(ids) - 1), min(batch, len(starts))
    total = torch.zeros((), dtype=torch.float64, device=device)
    for i in range(0, len(starts), B):
        x = np.zeros((B, T), dtype=np.int64)
        y = np.full((B, T), IGNORE_INDEX, dtype=np.int64)
        for row, s in enumerate(starts[i : i + B]):
            n = min(T, len(ids) - 1 - s)
            x[row, :n], y[row, :n] = ids[s : s + n], ids[s + 1 : s + n + 1]
        total += _nats(model, torch.from_numpy(x).to(device), torch.from_numpy(y).to(device), {}, autocast)
    count = len(ids) - 1
    return HeldOut(str(path), count, total.item() / count, nbytes, seq_len, seq_len, len(starts))


def _prepared_loss(
    model,
    tokenizer: Tokenizer,
    path: Path,
    seq_len: int,
    batch: int,
    max_tokens: int | None,
    windows: int | None,
    *,
    packing: bool,
    autocast: torch.dtype | None,
) -> HeldOut:
    """A prepared split in training's validation windows (train/evaluate.py reads the same ones)."""
    shards = prepared_split(path, tokenizer)
    shards.check_window(seq_len)
    limit = len(shards) // (seq_len + 1) if windows is None else windows
    if max_tokens is not None:
        limit = min(limit, max(1, max_tokens // seq_len))
    starts = eval_windows(shards, seq_len, limit)
    device = model.embed.weight.device
    total = torch.zeros((), dtype=torch.float64, device=device)
    nbytes = 0
    B = max(1, min(batch, len(starts)))  # no more rows than windows
    for i in range(0, len(starts), B):
        rows = starts[i : i + B]
        b = read_batch(shards, rows + [rows[0]] * (B - len(rows)), seq_len, packing)  # one shape: B rows
        b.y[len(rows) :] = IGNORE_INDEX  # the padding rows add nothing
        nbytes += scored_bytes(tokenizer, torch.cat([b.x[:, :1], b.y], dim=1)[: len(rows)].numpy())
        b = b.to(device)
        total += _nats(model, b.x, b.y, b.model_kwargs, autocast)
    count = len(starts) * seq_len
    return HeldOut(str(path), count, total.item() / count, nbytes, seq_len, seq_len + 1, len(starts))
