"""Instruction and chat data for `hopperlm finetune`: records -> conversations -> token rows with loss masks.

Formats (sft.format, detected from the first record when auto):
  alpaca      {"instruction", "input"?, "output", "system"?, "history"?: [[q, a], ...]}
  sharegpt    {"conversations": [{"from": "human"|"gpt"|"system", "value"}], "system"?}
  messages    {"messages": [{"role": "system"|"user"|"assistant", "content"}]} (OpenAI)
  completion  {"text"} (loss on all of it) or {"prompt", "completion"} (loss on the completion)
Conversations go through a chat template (data/chat.py); the loss is taken only on assistant replies, EOS
included (targets are -100 elsewhere; sft.train_on_prompt keeps the prompt too). Completions are encoded as
the tokenizer's `tokenizer(text)` encodes them (BOS in front for Llama tokenizers, nothing for GPT-2), then
EOS; a built-in template starts the same way (chat.py), the tokenizer's own renders exactly as transformers.

Rows: with sft.packing whole examples are packed greedily into rows of train.seq_len tokens; each example
gets its own document number, so attention never crosses examples and RoPE positions restart at each
(the document masks of model/attention.py); the rest of a row is padding without loss. No example is
split; one longer than a row is cut to it. The rows of an epoch follow a shuffle seeded by (seed, epoch),
so the batch of a step is a pure function of (seed, step): nothing to save for an exact resume.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hopperlm.config import SFTConfig, TrainConfig
from hopperlm.data.batches import BatchLayout
from hopperlm.data.chat import ChatTemplate, chat_encoder, choose_template
from hopperlm.data.loader import Batch
from hopperlm.data.tokenizer import HFTokenizer, load_tokenizer
from hopperlm.data.train_data import Dataset, ValSet
from hopperlm.errors import ConfigError, DataError
from hopperlm.model.attention import describe_backend
from hopperlm.model.loss import IGNORE_INDEX

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
}
SHAREGPT_ROLES |= {"bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}
ROLES = ("system", "user", "assistant")


@dataclass
class Example:
    """A conversation (messages) or a raw completion (prompt + completion, no template)."""

    messages: list[dict] | None = None
    prompt: str = ""
    completion: str = ""


# ---- reading -----------------------------------------------------------------------------------------------
def read_records(path: Path) -> list[tuple[str, dict]]:
    """(where, record) of every record in a .json (a list, or {"data": [...]}) / .jsonl file or a folder."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".json", ".jsonl"))
        if not files:
            raise DataError(f"sft.path={path} holds no .json or .jsonl files")
    elif path.is_file():
        files = [path]
    else:
        raise DataError(
            f"sft.path={path} does not exist; point it at a .json/.jsonl file or a folder of them"
        )
    records = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
            if f.suffix == ".jsonl":
                rows = [json.loads(line) for line in text.splitlines() if line.strip()]
            else:
                rows = json.loads(text)
                rows = rows.get("data", rows) if isinstance(rows, dict) else rows
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise DataError(f"{f} is not readable JSON/JSONL ({e})") from None
        if not isinstance(rows, list):
            raise DataError(f"{f} holds no list of records")
        records += [(f"{f}:{i + 1}", r) for i, r in enumerate(rows)]
    if not records:
        raise DataError(f"sft.path={path} holds no records")
    return records


TRUNCATION_WARNING = 0.2  # a share of examples cut short above this is a warning, not a statistic


def detect_format(record: dict, where: str) -> str:
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object")
    if "conversations" in record:
        return "sharegpt"
    if "messages" in record:
        return "messages"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if "text" in record or ("prompt" in record and "completion" in record):
        return "completion"
    raise DataError(
        f"{where}: cannot tell the format from keys {sorted(record)[:6]}; expected instruction/output, "
        "conversations, messages, text or prompt/completion (or set sft.format)"
    )


def _text(value, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts
        parts = [p.get("text") for p in value if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) == len(value):
            return "".join(parts)
    raise DataError(f"{where}: message content must be text")


def to_example(record: dict, fmt: str, system_prompt: str | None, where: str) -> Example:
    try:
        if fmt == "completion":
            if "text" in record:
                return Example(completion=str(record["text"]))
            return Example(prompt=str(record["prompt"]), completion=str(record["completion"]))
        if fmt == "alpaca":
            messages = [{"role": "system", "content": record["system"]}] if record.get("system") else []
            for q, a in record.get("history") or []:
                messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            prompt = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
            messages += [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": record["output"]},
            ]
        elif fmt == "sharegpt":
            messages = [{"role": "system", "content": record["system"]}] if record.get("system") else []
            for turn in record["conversations"]:
                role = SHAREGPT_ROLES.get(turn["from"])
                if role is None:
                    raise DataError(f"{where}: unknown speaker {turn['from']!r} (expected human/gpt/system)")
                messages.append({"role": role, "content": _text(turn["value"], where)})
        else:
            messages = [
                {"role": m["role"], "content": _text(m["content"], where)} for m in record["messages"]
            ]
    except (KeyError, TypeError) as e:
        raise DataError(f"{where}: not a valid {fmt} record (missing or malformed {e})") from None
    bad = [m["role"] for m in messages if m["role"] not in ROLES]
    if bad:
        raise DataError(f"{where}: role {bad[0]!r} is not one of {', '.join(ROLES)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the conversation has no assistant reply to learn")
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return Example(messages=messages)


# ---- tokens and loss masks -------------------------------------------------------------------------------
def tokenize(
    example: Example, tokenizer: HFTokenizer, template: ChatTemplate, train_on_prompt: bool
) -> tuple[np.ndarray, np.ndarray]:
    """(ids, labels) int64: labels[t] = ids[t] where token t is learned, IGNORE_INDEX elsewhere."""
    if example.messages is not None:
        text, spans = template.reply_spans(example.messages)
        ids, offsets = tokenizer.encode_with_offsets(text)
    else:
        text = example.prompt + example.completion
        spans = [(len(example.prompt), len(text))]
        ids, offsets = tokenizer.encode_with_offsets(text)
        # as tokenizer(text) gives them (BOS first for Llama tokenizers), then EOS once: generation stops there
        prefix, suffix = list(tokenizer.special_prefix_ids), list(tokenizer.special_suffix_ids)
        suffix += [tokenizer.eos_id] if suffix[-1:] != [tokenizer.eos_id] else []
        ids = [*prefix, *ids, *suffix]
        offsets = [(0, 0)] * len(prefix) + list(offsets) + [(len(text), len(text))] * len(suffix)
    ids = np.asarray(ids, dtype=np.int64)
    if train_on_prompt:
        return ids, ids.copy()
    starts = np.asarray([s for s, _ in offsets], dtype=np.int64)
    learn = np.zeros(len(ids), dtype=bool)
    for lo, hi in spans:
        learn |= (starts >= lo) & (starts < hi)
    if example.messages is None:  # EOS sits at len(text): part of the completion
        learn[-1] = True
    return ids, np.where(learn, ids, IGNORE_INDEX)


class Rows:
    """Tokenized examples laid out as rows of seq_len (input, target, document) positions."""

    def __init__(
        self, examples: list[tuple[np.ndarray, np.ndarray]], seq_len: int, packing: bool, pad_id: int
    ):
        self.examples, self.seq_len, self.packing, self.pad_id = examples, seq_len, packing, pad_id
        self.lengths = [len(ids) - 1 for ids, _ in examples]  # positions each contributes
        self.learned = [int((labels[1:] != IGNORE_INDEX).sum()) for _, labels in examples]  # in the loss

    def plan(self, order) -> list[list[int]]:
        """Example indices per row, greedily in `order` (one per row without packing)."""
        rows, current, used = [], [], 0
        for i in order:
            n = self.lengths[i]
            if current and (not self.packing or used + n > self.seq_len):
                rows.append(current)
                current, used = [], 0
            current.append(int(i))
            used += n
        if current:
            rows.append(current)
        return rows

    def learned_tokens(self, row: list[int]) -> int:
        return sum(self.learned[i] for i in row)

    def batch(self, rows: list[list[int]]) -> Batch:
        T = self.seq_len
        x = np.full((len(rows), T), self.pad_id, dtype=np.int64)
        y = np.full((len(rows), T), IGNORE_INDEX, dtype=np.int64)
        docs = np.zeros((len(rows), T), dtype=np.int64)
        for r, row in enumerate(rows):
            at = 0
            for doc, i in enumerate(row):
                ids, labels = self.examples[i]
                n = len(ids) - 1
                x[r, at : at + n], y[r, at : at + n], docs[r, at : at + n] = ids[:-1], labels[1:], doc
                at += n
            docs[r, at:] = len(row)  # padding is a document of its own
        doc_ids = torch.from_numpy(docs) if self.packing else None
        return Batch(torch.from_numpy(x), torch.from_numpy(y), doc_ids)


class ValRows:
    """Held-out examples in file order; `read_rows(indices)` is what evaluation reads."""

    def __init__(self, rows: Rows) -> None:
        self.rows = rows
        self.layout = rows.plan(range(len(rows.examples)))

    def read_rows(self, indices) -> Batch:
        return self.rows.batch([self.layout[i] for i in indices])


class SFTBatches:
    """The loop's micro-batches of instruction rows (data/batches.py's `BatchSource`): epochs of shuffled,
    packed rows, the batch of (step, micro) a pure function of the seed. Rank r reads its block of every
    global micro-batch of micro_batch * world_size rows, so the rows of a step do not depend on the ranks,
    and each micro-batch carries its share of the step's learned tokens (Batch.loss_share), so neither does
    the gradient."""

    def __init__(self, rows: Rows, *, layout: BatchLayout, seed: int) -> None:
        self.rows, self.seed = rows, seed
        self.micro_batch, self.grad_accum = layout.micro_batch, layout.grad_accum
        self.rank, self.world_size = layout.rank, layout.world_size
        self._plans: dict[int, list[list[int]]] = {}
        self._ends: list[int] = []  # cumulative row counts of epochs 0, 1, ...
        self._step_tokens: tuple[int, int] = (-1, 0)  # (step, learned tokens of all its rows)

    def epoch_plan(self, epoch: int) -> list[list[int]]:
        if epoch not in self._plans:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.rows.examples))
            self._plans = {k: v for k, v in self._plans.items() if k >= epoch - 1}  # keep two epochs
            self._plans[epoch] = self.rows.plan(order)
        return self._plans[epoch]

    def _row(self, g: int) -> list[int]:
        while not self._ends or self._ends[-1] <= g:
            count = len(self.epoch_plan(len(self._ends)))
            self._ends.append((self._ends[-1] if self._ends else 0) + count)
        epoch = int(np.searchsorted(self._ends, g, side="right"))
        start = self._ends[epoch - 1] if epoch else 0
        return self.epoch_plan(epoch)[g - start]

    def next(self, step: int, micro: int) -> Batch:
        global_micro = step * self.grad_accum + micro
        first = (global_micro * self.world_size + self.rank) * self.micro_batch
        rows = [self._row(g) for g in range(first, first + self.micro_batch)]
        batch = self.rows.batch(rows)
        batch.loss_share = sum(map(self.rows.learned_tokens, rows)) / self.step_tokens(step)
        return batch

    def step_tokens(self, step: int) -> int:
        """Learned tokens in all rows of `step` (every rank's, every micro-batch's): computed by each rank from
        the seed alone, no collective needed."""
        if self._step_tokens[0] != step:
            per_step = self.micro_batch * self.grad_accum * self.world_size
            rows = range(step * per_step, (step + 1) * per_step)
            self._step_tokens = (step, sum(self.rows.learned_tokens(self._row(g)) for g in rows))
        return self._step_tokens[1]

    def rows_per_epoch(self) -> int:
        return len(self.epoch_plan(0))

    def state_dict(self) -> None:
        return None  # stateless: the step is the position

    def load_state_dict(self, state) -> None:
        pass

    def set_micro_batch(self, micro_batch: int, grad_accum: int) -> None:
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        self._step_tokens = (-1, 0)

    def close(self) -> None:
        pass


def describe(sc, device: torch.device, dropout: float) -> str:
    """The plan's data line for instruction data."""
    how = "whole examples packed per row" if sc.packing else "one example per row, padded"
    if sc.packing:
        how += f", {describe_backend(device, dropout)}"
    return f"instruction examples from {sc.path}: {how}; loss on {'all tokens' if sc.train_on_prompt else 'replies'}"


# ---- what the loop opens -------------------------------------------------------------------------------------
def sft_tokenizer(path: Path) -> HFTokenizer:
    """The tokenizer at `path` (interop/inference.py's sft_tokenizer_path finds a run's), which must be a
    Hugging Face one."""
    tok = load_tokenizer(path)
    if not isinstance(tok, HFTokenizer):
        raise ConfigError(
            f"sft: the tokenizer at {path} is {tok.kind}; instruction data needs a tokenizer.json (Hugging Face "
            "tokenizers), which marks special tokens in text and gives character offsets"
        )
    return tok


@dataclass
class SFTData:
    datasets: list[Dataset]  # one entry: the run's tokenizer folder and a manifest-like summary
    val_sets: list[ValSet]
    train: Rows
    seq_len: int
    tokenizer: HFTokenizer  # what RUN_DIR/tokenizer holds (written by one rank: the others use this)

    def batches(self, layout: BatchLayout, *, seed: int) -> SFTBatches:
        return SFTBatches(self.train, layout=layout, seed=seed)


def _held_out(where_record: tuple[str, dict], fraction: float) -> bool:
    digest = hashlib.sha256(json.dumps(where_record[1], sort_keys=True).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def open_sft_data(
    sc: SFTConfig,
    tc: TrainConfig,
    run_dir: Path,
    log: Callable[[str], None],
    *,
    tokenizer_path: Path,
    save_tokenizer: bool = True,
) -> SFTData:
    """Read, template, tokenize and lay out sft.path with the tokenizer at `tokenizer_path` (where
    interop/inference.py's sft_tokenizer_path finds it), in rows of train.seq_len, and train.eval_windows
    validation rows; save the tokenizer (with the chat template used) to RUN_DIR/tokenizer, so checkpoints,
    exports and `generate --chat` render prompts the same way (`save_tokenizer`: one rank of several writes
    it)."""
    T = tc.seq_len
    tokenizer = sft_tokenizer(tokenizer_path)
    eos, bos = tokenizer.id_to_piece(tokenizer.eos_id), None
    if tokenizer.bos_id is not None:
        bos = tokenizer.id_to_piece(tokenizer.bos_id)
    prefix = "".join(tokenizer.id_to_piece(i) or "" for i in tokenizer.special_prefix_ids)
    template = choose_template(sc.template, tokenizer.config, eos, bos, prefix=prefix)
    encoder = chat_encoder(tokenizer)  # rendered chat text is encoded as transformers encodes it when serving
    records = read_records(Path(sc.path))[: sc.max_examples]
    fmt = sc.format if sc.format != "auto" else detect_format(records[0][1], records[0][0])
    examples: dict[bool, list] = {False: [], True: []}
    cut = dropped = longest = 0
    longest_at = ""
    for where, record in records:
        example = to_example(record, fmt, sc.system_prompt, where)
        ids, labels = tokenize(
            example, encoder if example.messages else tokenizer, template, sc.train_on_prompt
        )
        if len(ids) > longest:
            longest, longest_at = len(ids), where
        if len(ids) > T + 1:
            ids, labels, cut = ids[: T + 1], labels[: T + 1], cut + 1
        if (labels[1:] == IGNORE_INDEX).all():
            dropped += 1  # nothing left to learn (the reply was cut off)
            continue
        examples[sc.val_fraction > 0 and _held_out((where, record), sc.val_fraction)].append((ids, labels))
    train, val = examples[False], examples[True]
    if not train:
        raise DataError(f"sft.path={sc.path}: no training examples left (all held out, cut or empty)")
    saved = (
        tokenizer
        if template.name == "tokenizer's own"
        else tokenizer.with_config({**tokenizer.config, "chat_template": template.source})
    )
    tokenizer_dir = run_dir / "tokenizer"
    if save_tokenizer:
        saved.save(tokenizer_dir)
    pad = tokenizer.eos_id
    rows = Rows(train, T, sc.packing, pad)
    tokens = {"train": sum(len(i) for i, _ in train), "val": sum(len(i) for i, _ in val)}
    learned = sum(rows.learned)
    manifest = {"vocab_size": tokenizer.vocab_size, "tokenizer": tokenizer.identity(), "tokens": tokens}
    val_sets = []
    if val:
        val_rows = ValRows(Rows(val, T, sc.packing, pad))
        val_sets.append(
            ValSet("sft-val", val_rows, list(range(min(len(val_rows.layout), tc.eval_windows))), 1.0)
        )
    per_epoch = len(rows.plan(range(len(train))))
    log(
        f"sft: {len(records):,} {fmt} records from {sc.path}, template {template.name}; {len(train):,} train / "
        f"{len(val):,} val examples; {per_epoch:,} rows of {T} per epoch "
        f"({tokens['train'] / (per_epoch * T):.0%} filled{', packed' if sc.packing else ''}); "
        f"{learned / max(1, tokens['train']):.0%} of tokens in the loss; {cut} cut short at train.seq_len {T}, "
        f"{dropped} dropped"  # (as the warning below says it: a row of seq_len predictions holds seq_len + 1 ids)
    )
    if cut > TRUNCATION_WARNING * len(records):  # the model then mostly learns replies that stop mid-way
        log(
            f"warning: {cut / len(records):.0%} of the examples were cut short at train.seq_len {T} (the longest, "
            f"{longest_at}, has {longest:,} tokens); raise --train.seq_len, or drop the long ones from {sc.path}"
        )
    return SFTData([Dataset("sft", tokenizer_dir, 1.0, manifest)], val_sets, rows, T, saved)
