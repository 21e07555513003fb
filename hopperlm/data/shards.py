"""The on-disk format of prepared data: token shards, their document index, and manifest.json.

A split ("train" / "val") is a list of shards `<split>_000000.bin`, ... of raw little-endian token ids (uint16 while
the vocabulary fits, else uint32). Beside each shard `<split>_000000.idx` holds the int64 offsets, within that
shard, where a document starts (a document that continues from the previous shard has no entry), so packing
knows where documents begin without trusting EOS ids that a tokenizer may also emit for literal text.
manifest.json lists every shard with its token count, document-start count and sha256, and the document
format: the special ids around every document (`eos`: text then EOS; `tokenizer`: as the tokenizer's own
`tokenizer(text)` writes it, `<s> text` for Llama/TinyLlama).
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hopperlm.data.sources import FILE_SUFFIXES  # what prepare reads (never what it writes)
from hopperlm.errors import DataError

FORMAT = "hopperlm-shards-v2"  # v2 adds the per-shard document index (.idx)
READABLE_FORMATS = ("hopperlm-shards-v1", FORMAT)
MANIFEST = "manifest.json"
MANIFEST_KEYS = ("tokenizer", "dtype", "vocab_size", "eos_id", "tokens", "shards")  # what readers rely on
INDEX_DTYPE = np.dtype("<i8")
REPREPARE = "re-run `hopperlm prepare --overwrite`"


@dataclass(frozen=True)
class DocumentFormat:
    """How every document sits in the token stream: prefix_ids, the document's own ids, suffix_ids."""

    name: str
    """`eos` (the text, then EOS) or `tokenizer` (the special ids the tokenizer's `tokenizer(text)` adds)."""
    prefix_ids: tuple[int, ...] = ()
    suffix_ids: tuple[int, ...] = ()

    def marker(self) -> tuple[int, int] | None:
        """(id, shift) of the one special id that separates documents: a document starts at the position of
        the id plus shift (0: a prefix such as BOS, 1: a suffix such as EOS); None without a single one."""
        if len(self.prefix_ids) == 1 and not self.suffix_ids:
            return self.prefix_ids[0], 0
        if len(self.suffix_ids) == 1 and not self.prefix_ids:
            return self.suffix_ids[0], 1
        return None

    def to_json(self) -> dict:
        return {"name": self.name, "prefix_ids": list(self.prefix_ids), "suffix_ids": list(self.suffix_ids)}

    @classmethod
    def from_json(cls, data: dict) -> DocumentFormat:
        return cls(data["name"], tuple(data["prefix_ids"]), tuple(data["suffix_ids"]))

    @classmethod
    def of_manifest(cls, manifest: dict) -> tuple[DocumentFormat, bool]:
        """(the format, whether its marker id occurs only between documents, so packing may find documents
        from the tokens alone). Manifests written before the format was recorded hold the eos format."""
        recorded = manifest.get("document_format")
        if recorded is None:
            return cls("eos", (), (manifest["eos_id"],)), bool(manifest.get("eos_marks_documents"))
        return cls.from_json(recorded), bool(recorded.get("marks_documents"))


def shard_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocab <= 65536): half the disk and page-cache of uint32."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def index_name(shard_file: str) -> str:
    return shard_file[: -len(".bin")] + ".idx"


class ShardWriter:
    """Appends tokens (and where documents start) to `<split>_000000.bin/.idx`, ... of at most shard_tokens
    each. `shards` describes what is written: {"file", "tokens", "docs"}; `state()` / `reopen()` let an
    interrupted prepare continue from exactly that point."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.directory, self.split, self.dtype, self.shard_tokens = (
            Path(directory),
            split,
            dtype,
            shard_tokens,
        )
        self.shards: list[dict] = []
        self._bin = self._idx = None

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards)

    def write(self, tokens: np.ndarray, doc_starts: np.ndarray | None = None) -> None:
        """Append tokens; doc_starts are offsets into `tokens` where a document begins (sorted)."""
        tokens = tokens.astype(self.dtype, copy=False)
        starts = np.zeros(0, dtype=np.int64) if doc_starts is None else np.asarray(doc_starts, dtype=np.int64)
        done = 0
        while done < len(tokens):
            if not self.shards or self.shards[-1]["tokens"] == self.shard_tokens:
                self._next_shard()
            shard = self.shards[-1]
            take = min(len(tokens) - done, self.shard_tokens - shard["tokens"])
            self._bin.write(tokens[done : done + take].tobytes())
            lo, hi = np.searchsorted(starts, [done, done + take])
            if hi > lo:
                local = starts[lo:hi] - done + shard["tokens"]
                self._idx.write(local.astype(INDEX_DTYPE).tobytes())
                shard["docs"] += int(hi - lo)
            shard["tokens"] += take
            done += take

    def _open_last(self, mode: str) -> None:
        name = self.shards[-1]["file"]
        # closed in close(); 1 MB buffers: shards are written in large appends
        self._bin = open(self.directory / name, mode, buffering=1 << 20)  # noqa: SIM115
        self._idx = open(self.directory / index_name(name), mode, buffering=1 << 16)  # noqa: SIM115

    def _next_shard(self) -> None:
        self.close()
        self.shards.append({"file": f"{self.split}_{len(self.shards):06d}.bin", "tokens": 0, "docs": 0})
        self._open_last("wb")

    def flush(self) -> None:
        for f in (self._bin, self._idx):
            if f is not None:
                f.flush()

    def close(self) -> None:
        for f in (self._bin, self._idx):
            if f is not None:
                f.close()
        self._bin = self._idx = None

    def state(self) -> list[dict]:
        self.flush()
        return [dict(s) for s in self.shards]

    def reopen(self, shards: list[dict]) -> None:
        """Continue after `shards` (a state()): cut anything written after it, append from there."""
        self.close()
        for path in self.directory.glob(f"{self.split}_*"):
            if path.stem not in {Path(s["file"]).stem for s in shards}:
                path.unlink()  # a shard started after the last saved state
        self.shards = [dict(s) for s in shards]
        for s in self.shards:
            for name, size in (
                (s["file"], s["tokens"] * self.dtype.itemsize),
                (index_name(s["file"]), s["docs"] * 8),
            ):
                path = self.directory / name
                if not path.is_file() or path.stat().st_size < size:
                    raise DataError(
                        f"{path} is shorter than the saved prepare state; delete {self.directory}"
                    )
                os.truncate(path, size)
        if self.shards:
            self._open_last("ab")


# ---- reading the manifest ----------------------------------------------------------------------------------


def _nearest_dir(data_dir: Path) -> str:
    """What to do about a data dir that does not exist: the prepared folder beside it with the closest name, if
    any, else the prepare command that makes it (TEXT: the text to train on)."""
    parent = data_dir.parent  # (Path("name").parent is ".")
    siblings = [p.name for p in parent.iterdir() if (p / MANIFEST).is_file()] if parent.is_dir() else []
    close = difflib.get_close_matches(data_dir.name, siblings, n=1)
    if close:
        return f"did you mean {parent / close[0]}? (prepared, beside it)"
    return f"prepare it first: hopperlm prepare TEXT --out {data_dir} (TEXT: {', '.join(FILE_SUFFIXES)} files or folders)"


def read_manifest(data_dir: Path) -> dict:
    """The manifest of a prepared data dir, with a DataError that says how to fix whatever is wrong."""
    data_dir = Path(data_dir)
    path = data_dir / MANIFEST
    text_inside = (
        data_dir.is_dir()
        and not path.is_file()
        and any(p.name.endswith(FILE_SUFFIXES) for p in data_dir.iterdir() if p.is_file())
    )
    if data_dir.is_file() or text_inside:  # the text itself, given where its prepared folder belongs
        what = "a file" if data_dir.is_file() else "a folder of text"
        raise DataError(
            f"{data_dir} is {what}, not a prepared data dir; prepare it first: hopperlm prepare {data_dir} --out "
            f"data/{data_dir.stem}, then pass --data.path data/{data_dir.stem}"
        )
    if not data_dir.is_dir():
        raise DataError(f"data dir {data_dir} does not exist; {_nearest_dir(data_dir)}")
    if not path.is_file():
        raise DataError(
            f"data dir {data_dir} has no {MANIFEST}; prepare it: hopperlm prepare TEXT --out {data_dir} (an "
            "interrupted prepare resumes when run again with the same inputs)"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is unreadable ({e}); {REPREPARE}") from e
    if not isinstance(manifest, dict) or manifest.get("format") not in READABLE_FORMATS:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise DataError(f"{path} is not a {FORMAT} manifest (format={found!r}); re-run `hopperlm prepare`")
    missing = [k for k in MANIFEST_KEYS if k not in manifest]
    if missing:
        raise DataError(f"{path} lacks {', '.join(missing)}; {REPREPARE}")
    _check_document_format(manifest, path)
    _check_manifest_shape(manifest, path)
    return manifest


def _check_manifest_shape(manifest: dict, path: Path) -> None:
    """The counts must add up and every shard entry must be well-formed: a hand-edited or mismatched manifest
    is caught here, naming the file, rather than as an IndexError deep in training."""
    try:
        np.dtype(manifest["dtype"])
    except TypeError:
        raise DataError(f"{path}: dtype {manifest['dtype']!r} is not a numpy dtype; {REPREPARE}") from None
    shards, tokens = manifest["shards"], manifest["tokens"]
    if not isinstance(shards, dict) or not isinstance(tokens, dict):
        raise DataError(f"{path}: 'shards' and 'tokens' must be mappings by split; {REPREPARE}")
    for split, entries in shards.items():
        if not isinstance(entries, list) or not all(
            isinstance(e, dict) and isinstance(e.get("file"), str) and isinstance(e.get("tokens"), int)
            for e in entries
        ):
            raise DataError(f"{path}: shard list of split {split!r} is malformed; {REPREPARE}")
        total = sum(e["tokens"] for e in entries)
        if tokens.get(split) != total:
            raise DataError(
                f"{path}: split {split!r} says {tokens.get(split)} tokens but its shards hold {total}; "
                f"the manifest does not match its shards, {REPREPARE}"
            )


def _check_document_format(manifest: dict, path: Path) -> None:
    fmt = manifest.get("document_format")
    if fmt is None:
        return
    ok = isinstance(fmt, dict) and isinstance(fmt.get("name"), str)
    ok = ok and all(
        isinstance(fmt.get(k), list) and all(isinstance(i, int) for i in fmt[k])
        for k in ("prefix_ids", "suffix_ids")
    )
    if not ok:
        raise DataError(f"{path}: document_format {fmt!r} is malformed; {REPREPARE}")
