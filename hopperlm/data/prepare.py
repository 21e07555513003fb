"""`hopperlm prepare`: turn text corpora into memory-mappable token shards plus a manifest.

The corpus is streamed (text files in ~4 MB chunks cut at newlines, JSONL line by line) and tokenized in
batches through the tokenizer's native multi-threaded batch encoder, so a corpus far larger than RAM is fine.
Output goes to a temporary directory that is renamed into place only when complete: an interrupted prepare
never leaves a directory that looks valid, and `--overwrite` replaces old data only once the new data exists.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from hopperlm.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer, train_bpe
from hopperlm.errors import DataError

FORMAT = "hopperlm-shards-v1"
MANIFEST = "manifest.json"
MANIFEST_KEYS = ("tokenizer", "dtype", "vocab_size", "eos_id", "tokens", "shards")  # what readers rely on
SPLIT_METHODS = ("tail", "docs")
READ_BYTES = 4 << 20  # text file chunk, extended to the next newline
PIECE_CHARS = 128 << 10  # one encode_batch item: small enough that a 4 MB chunk keeps all cores busy
BATCH_CHARS = 4 << 20  # text per encode_batch call
COPY_TOKENS = 4 << 20  # tokens per memmap copy when moving the tail of train into val
HASH_BLOCK = 8 << 20

Advance = Callable[[int], None]


def shard_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocab <= 65536): half the disk and page-cache of uint32."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


@dataclass
class Piece:
    """A run of text from one document; EOS goes after the piece that ends its document."""

    text: str
    doc_end: bool
    digest: str | None = None  # sha256 of the whole document's text, only when split="docs" needs it


# ---- reading inputs ----------------------------------------------------------------------------------------


def find_input_files(inputs: list[Path]) -> list[Path]:
    """Expand folders (all *.txt and *.jsonl inside, recursively, sorted) and check every input exists."""
    files: list[Path] = []
    for path in map(Path, inputs):
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (".txt", ".jsonl"))
            if not found:
                raise DataError(
                    f"input folder {path} holds no .txt or .jsonl files; point at the text itself"
                )
            files.extend(found)
        elif path.is_file():
            if path.suffix == ".json":
                raise DataError(
                    f"input {path} is a .json file; prepare reads plain text or .jsonl "
                    "(one JSON object per line)"
                )
            files.append(path)
        else:
            raise DataError(f"input {path} does not exist; pass a .txt file, a .jsonl file or a folder")
    if not files:
        raise DataError("no inputs given; pass at least one .txt file, .jsonl file or folder")
    return files


def file_sha256(path: Path) -> str:
    """sha256 of a file, streamed (shards can be GBs)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def _split_text(text: str, size: int) -> Iterator[str]:
    """Cut text into pieces of about `size` chars, at a newline where there is one (tokenizers rarely merge
    across a newline, so the tokens barely differ from encoding the text whole)."""
    start = 0
    while len(text) - start > size:
        cut = text.rfind("\n", start, start + size)
        end = cut + 1 if cut > start else start + size
        yield text[start:end]
        start = end
    if start < len(text):
        yield text[start:]


def _text_pieces(path: Path, need_digest: bool, advance: Advance) -> Iterator[Piece]:
    """One text file = one document, read in chunks so it never has to fit in memory."""
    digest = file_sha256(path) if need_digest else None  # file bytes == UTF-8 of its text (decoded strictly)
    decoder = codecs.getincrementaldecoder("utf-8")()  # holds a character split across two chunks
    offset = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(READ_BYTES)
            if block and not block.endswith(b"\n"):
                block += f.readline(READ_BYTES)  # bounded: a file with no newlines is still read in chunks
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path} is not UTF-8 text (bad byte near offset {offset + e.start}); convert it to UTF-8"
                ) from e
            if not block:
                break
            offset += len(block)
            advance(len(block))
            for piece in _split_text(text, PIECE_CHARS):
                yield Piece(piece, False, digest)
    if offset:
        yield Piece("", True, digest)  # an empty closing piece carries the document's EOS


def _jsonl_pieces(path: Path, text_field: str, need_digest: bool, advance: Advance) -> Iterator[Piece]:
    """One JSON object per line, document = obj[text_field]; blank lines and empty texts are skipped."""
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            advance(len(line))
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise DataError(
                    f"{path}:{lineno} is not valid JSON ({e}); .jsonl inputs need one JSON object per line"
                ) from e
            if not isinstance(obj, dict) or text_field not in obj:
                fields = ", ".join(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
                raise DataError(
                    f'{path}:{lineno} has no "{text_field}" field (it has: {fields}); '
                    "pass --text-field with the field that holds the text"
                )
            text = obj[text_field]
            if not isinstance(text, str):
                raise DataError(
                    f'{path}:{lineno} field "{text_field}" is a {type(text).__name__}, not a string; '
                    "pass --text-field with the field that holds the text"
                )
            if text:
                digest = hashlib.sha256(text.encode("utf-8")).hexdigest() if need_digest else None
                yield Piece(text, True, digest)


def iter_pieces(files: list[Path], text_field: str, need_digest: bool, advance: Advance) -> Iterator[Piece]:
    for path in files:
        if path.suffix == ".jsonl":
            yield from _jsonl_pieces(path, text_field, need_digest, advance)
        else:
            yield from _text_pieces(path, need_digest, advance)


def _batches(pieces: Iterator[Piece], limit: int = BATCH_CHARS) -> Iterator[list[Piece]]:
    batch: list[Piece] = []
    size = 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece.text)
        if size >= limit:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encode(tokenizer: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    if isinstance(tokenizer, ByteTokenizer):
        return [tokenizer.encode_to_array(t) for t in texts]
    return [np.asarray(ids, dtype=np.int64) for ids in tokenizer.encode_batch(texts)]


# ---- writing shards ----------------------------------------------------------------------------------------


class ShardWriter:
    """Appends tokens to `<split>_000000.bin`, `<split>_000001.bin`, ... of at most shard_tokens each."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards: list[dict] = []  # {"file", "tokens"}, in order
        self._file = None
        self._room = 0

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards)

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype, copy=False)
        while len(tokens):
            if self._room == 0:
                self._next_shard()
            take = tokens[: self._room]
            self._file.write(take.tobytes())
            self.shards[-1]["tokens"] += len(take)
            self._room -= len(take)
            tokens = tokens[len(take) :]

    def _next_shard(self) -> None:
        self.close()
        name = f"{self.split}_{len(self.shards):06d}.bin"
        self._file = open(self.directory / name, "wb", buffering=1 << 20)  # noqa: SIM115 - closed in close()
        self.shards.append({"file": name, "tokens": 0})
        self._room = self.shard_tokens

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _move_tail(directory: Path, train: ShardWriter, val: ShardWriter, boundary: int) -> None:
    """Move tokens [boundary, N) of the train shards into val shards, chunk by chunk via memmap, then
    truncate (or delete) the train shards they came from. Only the trailing shards are touched, so the
    train shard names stay contiguous."""
    kept, start = [], 0
    for shard in train.shards:
        path, end = directory / shard["file"], start + shard["tokens"]
        if end > boundary:
            cut = max(boundary - start, 0)
            mm = np.memmap(path, dtype=train.dtype, mode="r")
            for i in range(cut, shard["tokens"], COPY_TOKENS):
                val.write(np.array(mm[i : i + COPY_TOKENS]))
            del mm  # release the mapping before truncating the file under it
            if cut == 0:
                path.unlink()
                start = end
                continue
            os.truncate(path, cut * train.dtype.itemsize)
            shard = {**shard, "tokens": cut}
        kept.append(shard)
        start = end
    train.shards = kept


# ---- the output directory ----------------------------------------------------------------------------------


def _check_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"--out {out_dir} is a file; choose a directory path")
    if not out_dir.is_dir():
        return
    if (out_dir / MANIFEST).is_file():
        if not overwrite:
            raise DataError(
                f"{out_dir} already holds prepared data; pass --overwrite or choose another --out"
            )
    elif any(out_dir.iterdir()):
        raise DataError(
            f"{out_dir} exists, is not empty and holds no prepared data (no {MANIFEST}); "
            "choose another --out (prepare never deletes files it did not write)"
        )


def _publish(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    """Swap the finished tmp dir into place; the old data (if any) goes only after the new is in place."""
    _check_out_dir(out_dir, overwrite)  # again: something may have appeared while we worked
    if out_dir.is_dir() and (out_dir / MANIFEST).is_file():
        old = out_dir.parent / f"{out_dir.name}.old-{os.getpid()}"
        out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old)
        return
    if out_dir.is_dir():
        out_dir.rmdir()  # empty, checked above
    tmp.rename(out_dir)


def read_manifest(data_dir: Path) -> dict:
    """The manifest of a prepared data dir, with a DataError that says how to fix whatever is wrong."""
    data_dir = Path(data_dir)
    path = data_dir / MANIFEST
    if not data_dir.is_dir():
        raise DataError(f"data dir {data_dir} does not exist; run `hopperlm prepare --out {data_dir}` first")
    if not path.is_file():
        raise DataError(f"data dir {data_dir} has no {MANIFEST}; run `hopperlm prepare` first")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is unreadable ({e}); re-run `hopperlm prepare --overwrite`") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise DataError(f"{path} is not a {FORMAT} manifest (format={found!r}); re-run `hopperlm prepare`")
    missing = [k for k in MANIFEST_KEYS if k not in manifest]
    if missing:
        raise DataError(f"{path} lacks {', '.join(missing)}; re-run `hopperlm prepare --overwrite`")
    return manifest


# ---- the pipeline ------------------------------------------------------------------------------------------


def _progress_bar(enabled: bool) -> Progress:
    """Bytes read, MB/s and ETA; rich falls back to plain output when stdout is not a terminal."""
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    return Progress(*columns, TimeRemainingColumn(), disable=not enabled)


def _check_options(
    tokenizer: str, vocab_size: int | None, val_fraction: float, split: str, shard_tokens: int
):
    if not 0 <= val_fraction <= 0.5:
        raise DataError(f"--val-fraction {val_fraction} is outside [0, 0.5]; 0.1 is the usual choice")
    if split not in SPLIT_METHODS:
        raise DataError(f"--split {split!r} is unknown; use 'tail' (last fraction of tokens) or 'docs'")
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens {shard_tokens} must be a positive token count")
    if tokenizer == "bpe" and vocab_size is None:
        raise DataError("--vocab-size is required with --tokenizer bpe")
    if tokenizer != "bpe" and vocab_size is not None:
        raise DataError(f"--vocab-size only applies to --tokenizer bpe (this run uses {tokenizer}); drop it")


def prepare(
    inputs: list[Path],
    out_dir: Path,
    tokenizer: str = "byte",
    vocab_size: int | None = None,
    val_fraction: float = 0.1,
    split: str = "tail",
    text_field: str = "text",
    shard_tokens: int = 100_000_000,
    progress: bool = True,
    overwrite: bool = False,
) -> dict:
    """Tokenize inputs into train/val shards in out_dir and return the manifest written there."""
    t0 = time.perf_counter()
    tokenizer = str(tokenizer)
    _check_options(tokenizer, vocab_size, val_fraction, split, shard_tokens)
    files = find_input_files(inputs)
    out_dir = Path(out_dir)
    _check_out_dir(out_dir, overwrite)
    total_bytes = sum(f.stat().st_size for f in files)

    tmp = out_dir.parent / f"{out_dir.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)  # left by an earlier, interrupted prepare of ours with the same pid
    tmp.mkdir(parents=True)
    train = val = None
    try:
        with _progress_bar(progress) as bar:
            if tokenizer == "bpe":
                task = bar.add_task("training BPE", total=total_bytes)
                texts = (
                    p.text for p in iter_pieces(files, text_field, False, lambda n: bar.advance(task, n))
                )
                tok = train_bpe((t for t in texts if t), vocab_size)
            else:
                tok = load_tokenizer(tokenizer)
            task = bar.add_task("tokenizing", total=total_bytes)
            dtype = shard_dtype(tok.vocab_size)
            train = ShardWriter(tmp, "train", dtype, shard_tokens)
            val = ShardWriter(tmp, "val", dtype, shard_tokens)
            by_docs = split == "docs" and val_fraction > 0
            pieces = iter_pieces(files, text_field, by_docs, lambda n: bar.advance(task, n))
            documents = _tokenize_into(pieces, tok, train, val, val_fraction if by_docs else 0.0)
            train.close()
        if documents == 0:
            raise DataError(f"the inputs ({', '.join(map(str, inputs))}) hold no text; check the paths")
        if split == "tail" and val_fraction > 0:
            _move_tail(tmp, train, val, int(train.tokens * (1 - val_fraction)))
        val.close()
        if by_docs and (train.tokens == 0 or val.tokens == 0):
            empty = "train" if train.tokens == 0 else "val"
            raise DataError(
                f"--split docs put all {documents} documents on one side ({empty} is empty); "
                "use --split tail or add more documents"
            )
        if train.tokens == 0:
            raise DataError(
                "the corpus is too small: no tokens left for train; add text or lower --val-fraction"
            )
        tok.save(tmp)
        manifest = {
            "format": FORMAT,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "sources": [str(Path(p).resolve()) for p in inputs],
            "tokenizer": tok.identity(),
            "dtype": dtype.name,
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            "documents": documents,
            "split": {"method": split, "val_fraction": val_fraction},
            "tokens": {"train": train.tokens, "val": val.tokens},
            "shards": {
                name: [{**s, "sha256": file_sha256(tmp / s["file"])} for s in writer.shards]
                for name, writer in (("train", train), ("val", val))
            },
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        _publish(tmp, out_dir, overwrite)
    except BaseException:
        for writer in (train, val):
            if writer is not None:
                writer.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if progress:
        elapsed = time.perf_counter() - t0
        print(
            f"prepared {out_dir}: {documents:,} documents, "
            f"{train.tokens:,} train / {val.tokens:,} val tokens, {dtype.name}, "
            f"{len(train.shards)} train + {len(val.shards)} val shards, "
            f"{total_bytes / 1e6 / max(elapsed, 1e-9):.1f} MB/s"
        )
    return manifest


def _tokenize_into(
    pieces: Iterator[Piece], tok: Tokenizer, train: ShardWriter, val: ShardWriter, doc_val_fraction: float
) -> int:
    """Encode pieces batch by batch and append them (EOS after each document) to train, or to val for the
    documents whose text hash falls under doc_val_fraction. Returns the number of documents."""
    eos = np.array([tok.eos_id], dtype=np.int64)
    documents = 0
    for batch in _batches(pieces):
        out: dict[int, list[np.ndarray]] = {0: [], 1: []}  # 0 = train, 1 = val
        for piece, ids in zip(batch, _encode(tok, [p.text for p in batch]), strict=True):
            side = int(piece.digest is not None and int(piece.digest[:8], 16) / 2**32 < doc_val_fraction)
            out[side].append(ids)
            if piece.doc_end:
                out[side].append(eos)
                documents += 1
        for side, writer in ((0, train), (1, val)):
            if out[side]:
                tokens = np.concatenate(out[side])
                if len(tokens) and int(tokens.max()) >= tok.vocab_size:
                    raise DataError(
                        f"tokenizer {tok.name} produced id {int(tokens.max())} >= its vocab_size "
                        f"{tok.vocab_size}; the tokenizer file is inconsistent, use another one"
                    )
                writer.write(tokens)
    return documents
