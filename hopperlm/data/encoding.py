"""Turning one unit of input into tokens, in a worker process: decode, filter, hash, tokenize.

`prepare` hands units to a pool of worker processes (each loads the tokenizer once) and takes the results back
in order, so the shards are the same for any number of workers. A worker returns every document of its unit
as tokens in the document format (the format's prefix before each document that starts in the unit, its
suffix after each that ends there), the document's sha256 (used for the hash-based train/val split and for
exact-duplicate removal, both decided in order by the main process) and whether the document passed the
filter.

Document formats (`--doc-format`): `eos` writes the text, then EOS (GPT-2's and nanoGPT's pretraining data:
right for a model trained from scratch). `tokenizer` writes each document as the tokenizer's own
`tokenizer(text)` gives it (transformers' run_clm.py): `<s> text` for Llama-2/TinyLlama, BOS the only
separator, exactly TinyLlama's pretraining data (its prepare_slimpajama.py packs `tokenizer.encode(text)`),
so continued pretraining feeds a base the documents it was trained on. A tokenizer that adds nothing
(GPT-2, byte, trained ones) gets the eos format instead: a document needs a separator the model can learn,
and EOS after each is what GPT-2's own pretraining used. `auto` (the default) is the same choice, made
without a message.

Filters (`--filter`): `script:NAME:FRACTION` keeps documents whose letters are at least FRACTION in that
script (ethiopic, latin, arabic, cyrillic), or `module:function` for your own `function(text) -> bool`.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from hopperlm.data.shards import DocumentFormat
from hopperlm.data.sources import Source, Unit, decode_unit, split_text
from hopperlm.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from hopperlm.errors import DataError

DOC_FORMATS = ("auto", "tokenizer", "eos")
HF_PIECE_CHARS = 4096  # short pieces encode ~2x faster than 128K ones (BPE on long words), and stay exact

SCRIPTS = {
    "ethiopic": "\u1200-\u139f\u2d80-\u2ddf\uab00-\uab2f",
    "latin": "A-Za-z\u00c0-\u024f",
    "arabic": "\u0600-\u06ff\u0750-\u077f",
    "cyrillic": "\u0400-\u04ff",
}


@dataclass
class EncodeOptions:
    tokenizer: str  # what the worker loads (a saved tokenizer file or "byte")
    text_field: str = "text"
    bad_utf8: str = "reject"
    filter: str | None = None
    threads: int | None = None  # tokenizer threads inside one worker; None = the tokenizer's default
    doc_format: DocumentFormat | None = None  # None: the eos format of the tokenizer


@dataclass
class Encoded:
    """Documents of one unit. A text unit has one entry, a part of its file's document."""

    unit: Unit  # payload dropped
    tokens: np.ndarray  # int64, every document's tokens back to back, in the document format
    lengths: np.ndarray  # int64 tokens per document (the format's special ids included)
    digests: list[str] = field(default_factory=list)  # sha256 hex of each document's text
    kept: list[bool] = field(default_factory=list)  # passed the filter
    skipped: list[str] = field(default_factory=list)
    marker_inside: bool = False  # a document's own text encoded to the format's marker id (a literal "</s>")


def document_format(
    requested: str, tokenizer: Tokenizer, log: Callable[[str], None] | None = None
) -> DocumentFormat:
    """--doc-format (auto, tokenizer, eos) for this tokenizer as a DocumentFormat (the rules: module docstring)."""
    if requested not in DOC_FORMATS:
        raise DataError(f"--doc-format {requested!r} is unknown; use {', '.join(DOC_FORMATS)}")
    prefix, suffix = tuple(tokenizer.special_prefix_ids), tuple(tokenizer.special_suffix_ids)
    if requested != "eos" and (prefix or suffix):
        return DocumentFormat("tokenizer", prefix, suffix)
    if requested == "tokenizer" and log is not None:
        log(
            f"prepare: tokenizer {tokenizer.name} adds no special tokens of its own; documents end with EOS "
            "(--doc-format eos), as GPT-2's pretraining data did"
        )
    return DocumentFormat("eos", (), (tokenizer.eos_id,))


def describe_format(fmt: DocumentFormat, tokenizer: Tokenizer) -> str:
    """E.g. "<s> + text (tokenizer)" or "text + EOS (eos)"."""

    def pieces(ids):
        return [tokenizer.id_to_piece(i) or ("EOS" if i == tokenizer.eos_id else str(i)) for i in ids]

    return " + ".join([*pieces(fmt.prefix_ids), "text", *pieces(fmt.suffix_ids)]) + f" ({fmt.name})"


def load_filter(spec: str | None) -> Callable[[str], bool] | None:
    """The document filter named by --filter, or None."""
    if not spec:
        return None
    if spec.startswith("script:"):
        try:
            _, name, fraction = spec.split(":")
            low = float(fraction)
            letters = re.compile(f"[{SCRIPTS[name]}]")
        except (ValueError, KeyError):
            raise DataError(
                f"--filter {spec!r}: use script:NAME:FRACTION with NAME in {', '.join(SCRIPTS)}, "
                "e.g. script:ethiopic:0.5"
            ) from None
        alpha = re.compile(r"[^\W\d_]")

        def enough_of_script(text: str) -> bool:
            total = len(alpha.findall(text))
            return total > 0 and len(letters.findall(text)) / total >= low

        return enough_of_script
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise DataError(f"--filter {spec!r} is not an importable module:function ({e})") from None


class UnitEncoder:
    """Holds the tokenizer and filter; one per worker process (or one in the main process for workers=1)."""

    def __init__(self, sources: list[Source], options: EncodeOptions) -> None:
        self.sources, self.options = sources, options
        self.tokenizer: Tokenizer = load_tokenizer(options.tokenizer)
        if options.threads is not None:
            self.tokenizer.encode_threads = options.threads
        self.keep = load_filter(options.filter)
        fmt = options.doc_format or DocumentFormat("eos", (), (self.tokenizer.eos_id,))
        self.prefix = np.array(fmt.prefix_ids, dtype=np.int64)
        self.suffix = np.array(fmt.suffix_ids, dtype=np.int64)
        self.marker = fmt.marker()

    def _encode_texts(self, texts: list[str], starts_document: list[bool]) -> list[np.ndarray]:
        """Token ids of each text. Texts are cut into pieces at newlines so a batch keeps every core busy and
        no piece is a pathologically long BPE word; a piece that continues a document is encoded without the
        tokenizer's start-of-text "▁", so the ids equal those of the whole document (tokenizer.continuation).
        SentencePiece .model files have no such switch: they get large pieces (rare boundaries) instead."""
        tok = self.tokenizer
        if isinstance(tok, ByteTokenizer):
            return [tok.encode_to_array(t).astype(np.int64) for t in texts]
        continuation = tok.continuation() if isinstance(tok, HFTokenizer) else None
        exact = isinstance(tok, HFTokenizer)
        pieces: dict[bool, list[str]] = {True: [], False: []}  # first piece of a document?
        owner: dict[bool, list[int]] = {True: [], False: []}
        for i, (text, starts) in enumerate(zip(texts, starts_document, strict=True)):
            for j, piece in enumerate(split_text(text, HF_PIECE_CHARS if exact else None)):
                first = starts and j == 0
                first = first or continuation is None  # nothing to strip: one batch
                pieces[first].append(piece)
                owner[first].append(i)
        # a text's first piece (in the first batch) precedes its continuations (second batch, in order)
        out: list[list[np.ndarray]] = [[] for _ in texts]
        for first, encoder in ((True, tok), (False, continuation)):
            if pieces[first]:
                for i, ids in zip(owner[first], encoder.encode_batch(pieces[first]), strict=True):
                    out[i].append(np.asarray(ids, dtype=np.int64))
        return [np.concatenate(parts) if parts else np.zeros(0, np.int64) for parts in out]

    def __call__(self, unit: Unit) -> Encoded:
        source = self.sources[unit.source]
        decoded = decode_unit(unit, source, self.options.text_field, self.options.bad_utf8)
        texts = decoded.texts
        whole = source.kind != "text"
        ends = [True] * len(texts) if whole else [unit.last]
        if whole:
            digests = [hashlib.sha256(t.encode("utf-8")).hexdigest() for t in texts]
        else:
            digests = [unit.digest or ""]
        if self.keep is None:
            kept = [True] * len(texts)
        else:  # a text file is judged on its first unit (see prepare)
            kept = [bool(self.keep(t)) if whole or unit.first else True for t in texts]
        arrays, lengths = [], []
        starts = [True] * len(texts) if whole else [unit.first]
        marker_inside = False
        # the prefix goes once before a document's first piece, the suffix once after its last
        for ids, start, end in zip(self._encode_texts(texts, starts), starts, ends, strict=True):
            if self.marker is not None:
                marker_inside = marker_inside or bool((ids == self.marker[0]).any())
            parts = [self.prefix] * start + [ids] + [self.suffix] * end
            arrays.extend(parts)
            lengths.append(sum(len(p) for p in parts))
        tokens = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
        if len(tokens) and int(tokens.max()) >= self.tokenizer.vocab_size:
            raise DataError(
                f"tokenizer {self.tokenizer.name} produced id {int(tokens.max())} >= its vocab_size "
                f"{self.tokenizer.vocab_size}; the tokenizer file is inconsistent, use another one"
            )
        bare = Unit(unit.source, unit.start, unit.end, unit.size, b"", unit.first, unit.last, unit.digest)
        return Encoded(
            bare, tokens, np.array(lengths, dtype=np.int64), digests, kept, decoded.skipped, marker_inside
        )


# ---- the worker pool ---------------------------------------------------------------------------------------

_ENCODER: UnitEncoder | None = None


def _init_worker(sources: list[Source], options: EncodeOptions) -> None:
    global _ENCODER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # parallel across processes, not threads within each
    _ENCODER = UnitEncoder(sources, options)


def _encode_in_worker(unit: Unit) -> Encoded:
    return _ENCODER(unit)


def start_pool(workers: int, sources: list[Source], options: EncodeOptions):
    """A process pool whose workers each hold a UnitEncoder ('spawn': no forked copies of torch or threads)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    options = EncodeOptions(**{**options.__dict__, "threads": 1})
    return ctx.Pool(workers, initializer=_init_worker, initargs=(sources, options))


def encode_in_pool(pool, units: Iterator[Unit], in_flight: int) -> Iterator[Encoded]:
    """Encoded units in input order, with at most `in_flight` units read ahead (Pool.imap would read the whole
    corpus into memory ahead of the workers)."""
    pending: deque = deque()
    for unit in units:
        pending.append(pool.apply_async(_encode_in_worker, (unit,)))
        if len(pending) >= in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()
