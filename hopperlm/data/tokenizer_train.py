"""`hopperlm tokenizer train` and `hopperlm tokenizer extend`: tokenizers for a new language.

train: a BPE (byte-level, GPT-2 style) or Unigram (SentencePiece style) tokenizer learned on a corpus with the
Rust `tokenizers` library, saved as tokenizer.json.

extend: grow an existing BPE tokenizer.json (Llama-2 / TinyLlama style: SentencePiece vocabulary with byte
fallback) for a new language without touching what it already does:
1. learn BPE merges on the new corpus with the base tokenizer's own normalizer (so pieces look like the base's,
   "▁word"), splitting at word starts as SentencePiece does;
2. walk the learned merges in order and keep the first N whose result is not in the base vocabulary and
   contains a character outside the protected set (ASCII, Latin, general punctuation, and every character
   of the `--protect` texts). New characters come first, then the pieces;
3. append them after the last base id (every existing id keeps its meaning, so a model's embedding rows stay
   valid: continued pretraining with the extended tokenizer only adds rows, train/resize.py) and append their
   merges after the base merges (lowest priority): every split of each new piece into two pieces, in the order
   the pieces were added, as a tokenizer.json converted from SentencePiece holds them (sp_convert.py);
4. with the base's SentencePiece model (tokenizer.model beside its tokenizer.json, or BASE itself), write the
   same pieces into it, scored below every base piece in the same order (sp_convert.extend_sentencepiece):
   SentencePiece, transformers' slow and fast tokenizers and llama.cpp then give the same ids.
Text made only of protected characters cannot form any new piece, so its tokenization is unchanged by
construction; the fertility report checks it on held-out text anyway (identical ids, not just counts).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from hopperlm.data.sources import decode_unit, find_sources, iter_units
from hopperlm.data.sp_convert import extend_sentencepiece, sentencepiece_to_hf, splits
from hopperlm.data.tokenizer import (
    BPE_EOS,
    HF_FILE,
    SP_FILE,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    load_tokenizer,
)
from hopperlm.errors import DataError

PROTECTED_RANGES = "\u0000-\u024f\u2000-\u206f"  # ASCII, Latin-1, Latin Extended-A/B, general punctuation
SPACE_MARK = "\u2581"  # SentencePiece's "▁"
MAX_VOCAB = 1_000_000
TRAIN_HEADROOM = 4000  # learn this many more merges than asked: some are already in the base vocabulary


def corpus_texts(inputs: list, text_field: str = "text") -> Iterator[str]:
    """Every document (text files: in pieces) of the inputs, in the formats prepare reads."""
    sources = find_sources(inputs)
    for unit in iter_units(sources):
        yield from (t for t in decode_unit(unit, sources[unit.source], text_field, "reject").texts if t)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style) from an iterator, so the corpus is streamed, never held in memory.

    The vocabulary starts from all 256 byte symbols, so any text encodes losslessly; "<|endoftext|>" is EOS.
    """
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if not 258 <= vocab_size <= MAX_VOCAB:
        raise DataError(
            f"--vocab-size {vocab_size} is out of range; byte-level BPE needs 258..{MAX_VOCAB:,} "
            "(256 bytes + EOS + at least one merge)"
        )
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok.to_str().encode("utf-8"), name=f"bpe-{vocab_size}")


def train_tokenizer(texts: Iterable[str], kind: str, vocab_size: int) -> HFTokenizer:
    """A new tokenizer learned on texts: 'bpe' (byte-level) or 'unigram' (SentencePiece-style, '▁' words)."""
    if kind == "bpe":
        return train_bpe(texts, vocab_size)
    if kind != "unigram":
        raise DataError(f"--kind {kind!r} is unknown; use bpe or unigram")
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    special = ["<unk>", "<s>", "</s>"]
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=special, unk_token="<unk>", show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok.to_str().encode("utf-8"), name=f"unigram-{vocab_size}")


# ---- extension ---------------------------------------------------------------------------------------------


@dataclass
class Extension:
    tokenizer: HFTokenizer
    added: list[str]  # new pieces in id order (first new id = base vocab size)
    base_size: int


def _base_json(base: Tokenizer) -> dict:
    if not isinstance(base, HFTokenizer):
        raise DataError(
            f"tokenizer extend needs a BPE tokenizer.json (or a Llama-style SentencePiece model) as BASE, got a "
            f"{base.kind} tokenizer; for Llama-2 pass its tokenizer.model or TinyLlama-1.1B's tokenizer.json"
        )
    data = json.loads(base._raw)
    model = data.get("model", {})
    kind = model.get("type") or ("BPE" if "merges" in model else "unknown")  # old files omit the type
    if kind != "BPE":
        raise DataError(f"tokenizer extend supports BPE models; {base.name} is a {kind} model")
    if "ByteLevel" in json.dumps(data.get("pre_tokenizer")):
        raise DataError(
            f"{base.name} is a byte-level BPE (GPT-2 style); tokenizer extend supports SentencePiece-style BPE "
            "(Llama-2, TinyLlama, Mistral: '▁' words with byte fallback)"
        )
    return data


def _protected_pattern(protect: str) -> re.Pattern:
    """Characters no new piece may consist of only: PROTECTED_RANGES, '▁' and every character of `protect`."""
    extra = "".join(sorted(set(protect)))
    return re.compile(f"[{PROTECTED_RANGES}{SPACE_MARK}{re.escape(extra)}]")


def _merge_pair(merge) -> tuple[str, str]:
    return tuple(merge.split(" ", 1)) if isinstance(merge, str) else tuple(merge)


def _learn_merges(
    base_data: dict, texts: Iterable[str], count: int
) -> tuple[list[str], list[tuple[str, str]]]:
    """Alphabet and merges (in order) of a BPE learned on texts with the base's normalizer."""
    from tokenizers import Regex, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as RustTokenizer

    tok = RustTokenizer.from_str(json.dumps(base_data))
    tok.model = models.BPE(byte_fallback=bool(base_data["model"].get("byte_fallback")))
    # split before every word start, like SentencePiece: no piece spans two words
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(f"{SPACE_MARK}"), behavior="merged_with_next")
    trainer = trainers.BpeTrainer(vocab_size=count, show_progress=False, special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    learned = json.loads(tok.to_str())["model"]
    merges = [_merge_pair(m) for m in learned["merges"]]
    merged = {a + b for a, b in merges}
    alphabet = [piece for piece in learned["vocab"] if piece not in merged]
    return alphabet, merges


def extend_tokenizer(
    base: Tokenizer, texts: Iterable[str], add: int, protect: Iterable[str] = (), name: str | None = None
) -> Extension:
    """BASE plus at most `add` pieces learned on texts; see the module doc for what stays unchanged."""
    if add < 1:
        raise DataError(f"--add {add} must be at least 1")
    data = _base_json(base)
    vocab: dict[str, int] = data["model"]["vocab"]
    taken = set(vocab) | {t["content"] for t in data.get("added_tokens", [])}
    protected = _protected_pattern("".join(protect))
    eligible = lambda piece: protected.sub("", piece) != ""  # noqa: E731 - holds a character outside the set

    alphabet, merges = _learn_merges(data, texts, add + TRAIN_HEADROOM)
    added: list[str] = [c for c in alphabet if c not in taken and eligible(c)][:add]
    known = taken | set(added)
    for a, b in merges:
        if len(added) >= add:
            break
        piece = a + b
        if piece in known or a not in known or b not in known or not eligible(piece):
            continue
        added.append(piece)
        known.add(piece)
    next_id = max([*vocab.values(), *(t["id"] for t in data.get("added_tokens", []))]) + 1
    for offset, piece in enumerate(added):
        vocab[piece] = next_id + offset
    # all the ways SentencePiece can form each new piece, not just the learned one: the two then agree
    new_merges = [m for piece in added for m in splits(piece, vocab)]
    string_merges = bool(data["model"]["merges"]) and isinstance(data["model"]["merges"][0], str)
    data["model"]["merges"] += [f"{a} {b}" if string_merges else [a, b] for a, b in new_merges]
    raw = json.dumps(data, ensure_ascii=False).encode("utf-8")
    files = dict(base._files)
    if SP_FILE in files:
        where = f"{base.name}'s {SP_FILE}"
        files[SP_FILE] = extend_sentencepiece(files[SP_FILE], added, first_id=next_id, where=where)
    extended = HFTokenizer(raw, name or f"{base.name}+{len(added)}", files)
    return Extension(extended, added, next_id)


# ---- fertility ---------------------------------------------------------------------------------------------


def fertility(tokenizer: Tokenizer, text: str) -> dict:
    """Tokens per word (whitespace-separated) and per character (non-space) of text."""
    lines = [line for line in text.splitlines() if line.strip()]
    tokens = sum(len(ids) for ids in tokenizer.encode_batch(lines))
    words = sum(len(line.split()) for line in lines)
    chars = sum(len(line) - line.count(" ") for line in lines)
    return {
        "tokens": tokens,
        "words": words,
        "chars": chars,
        "tokens_per_word": tokens / max(words, 1),
        "tokens_per_char": tokens / max(chars, 1),
    }


def compare(base: Tokenizer, extended: Tokenizer, heldout: dict[str, str], protect: str = "") -> list[dict]:
    """Base vs extended on each held-out sample: fertility, and which lines got different token ids (only
    lines holding a character outside the protected set may: anything else would be a bug)."""
    rows = []
    protected = _protected_pattern(protect)
    for label, text in heldout.items():
        lines = [line for line in text.splitlines() if line.strip()]
        pairs = zip(lines, base.encode_batch(lines), extended.encode_batch(lines), strict=True)
        changed = [line for line, a, b in pairs if a != b]
        rows.append(
            {
                "sample": label,
                "base": fertility(base, text),
                "extended": fertility(extended, text),
                "lines": len(lines),
                "lines_changed": len(changed),
                "changed_without_new_characters": sum(protected.sub("", line) == "" for line in changed),
            }
        )
    return rows


def format_report(rows: list[dict], added: int, base_name: str) -> list[str]:
    w = max([len("held-out sample"), *(len(r["sample"]) for r in rows)]) + 2
    lines = [
        f"{'held-out sample':<{w}}{'words':>9}{'base tok/word':>15}{'ext tok/word':>14}{'base tok/char':>15}"
        f"{'ext tok/char':>14}  token ids",
    ]
    for r in rows:
        b, e = r["base"], r["extended"]
        if r["lines_changed"] == 0:
            ids = "unchanged"
        else:
            bad = r["changed_without_new_characters"]
            ids = f"{r['lines_changed']:,}/{r['lines']:,} lines differ" + (
                f" ({bad} WITHOUT new characters)" if bad else ", each holding new-script characters"
            )
        lines.append(
            f"{r['sample']:<{w}}{b['words']:>9,}{b['tokens_per_word']:>15.2f}{e['tokens_per_word']:>14.2f}"
            f"{b['tokens_per_char']:>15.3f}{e['tokens_per_char']:>14.3f}  {ids}"
        )
    lines.append(
        f"{added:,} pieces added to {base_name} (ids from the old vocabulary size on; old ids unchanged)"
    )
    return lines


def save_extension(ext: Extension, out_dir: Path, report: list[dict]) -> None:
    """tokenizer.json (+ the base's files: configs, the extended tokenizer.model) and extension.json."""
    out_dir = Path(out_dir)
    ext.tokenizer.save(out_dir)
    info = {"base_vocab_size": ext.base_size, "added": len(ext.added), "pieces": ext.added, "report": report}
    (out_dir / "extension.json").write_text(
        json.dumps(info, ensure_ascii=False, indent=1) + "\n", encoding="utf-8"
    )


def load_base(spec: str) -> Tokenizer:
    """The BASE of `tokenizer extend`: a tokenizer.json or a directory holding one (HF configs come along), or a
    Llama-style SentencePiece tokenizer.model, converted to the equivalent tokenizer.json (sp_convert.py)."""
    path = Path(spec)
    if path.is_dir() and (path / HF_FILE).is_file():
        return load_tokenizer(path / HF_FILE)
    base = load_tokenizer(spec)
    if isinstance(base, SentencePieceTokenizer):
        raw, configs = sentencepiece_to_hf(base._raw, str(spec))
        return HFTokenizer(raw, base.name, {**configs, SP_FILE: base._raw}, where=str(spec))
    return base
