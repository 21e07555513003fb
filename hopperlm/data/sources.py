"""Where `prepare` reads text from, cut into units that worker processes can decode on their own.

Inputs: .txt files (one document each), .jsonl / .jsonl.gz (one document per line, `--text-field`), .tsv/.csv
tables with a header row (one document per row, `--text-field` names the column), Parquet files, a local Hugging Face `datasets` directory (the Arrow files `save_to_disk` writes), folders of any of
these, and `hf:NAME` for a Hub dataset when online. Each source is read as a sequence of units (about 4 MB of
bytes, a Parquet row group, an Arrow record batch, 1,000 Hub rows); a unit has a position (byte offset or
row/batch number) from which reading can restart, which is what makes an interrupted prepare resumable.

Decoding is strict UTF-8. A bad byte is reported with its file and byte offset; with `bad_utf8="skip"` the
line (text) or record (JSONL) holding it is left out and the report goes to the manifest, with "reject"
(the default) prepare stops there. Text is never silently mangled.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hopperlm.errors import DataError

UNIT_BYTES = 4 << 20  # one text/JSONL unit, extended to the next newline
PIECE_CHARS = 128 << 10  # text is handed to the tokenizer in pieces of about this size, cut at newlines
HUB_ROWS = 1000
TABLE_ROWS = 1000
FILE_SUFFIXES = (".txt", ".tokens", ".jsonl", ".jsonl.gz", ".parquet", ".tsv", ".csv")  # .tokens: WikiText
BAD_UTF8 = ("reject", "skip")


@dataclass(frozen=True)
class Source:
    kind: str  # text | jsonl | table | parquet | arrow | hub
    path: str  # file path, or the Hub dataset name

    @property
    def name(self) -> str:
        return self.path


@dataclass
class Unit:
    """A piece of one source that a worker decodes alone. Text units are parts of one document (the file);
    every other unit holds whole documents."""

    source: int  # index into the source list
    start: int  # where it begins (byte offset or row-group/batch/row number)
    end: int  # where the next unit begins
    size: int  # bytes, for the progress bar
    payload: bytes | list = b""
    first: bool = True  # text: starts the file's document
    last: bool = True  # text: ends it
    digest: str | None = None  # text: sha256 of the whole file, set by the reader


@dataclass
class Decoded:
    """The documents of one unit: texts[i] is whole, except for a text unit (a piece of its file)."""

    texts: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # "FILE: byte N: why" for each line/record left out


def _suffix(path: Path) -> str:
    return ".jsonl.gz" if path.name.endswith(".jsonl.gz") else path.suffix


def _hf_dataset_dir(path: Path) -> list[Source] | None:
    """The Arrow files of a `datasets.Dataset.save_to_disk` directory, in its own order; None if it is not one."""
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise DataError(
            f"{path} is a DatasetDict with splits {', '.join(splits)}; pass one split's folder, e.g. {path}/train"
        )
    state = path / "state.json"
    if not state.is_file():
        return None
    try:
        files = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{state} is not a datasets state.json ({e}); save the dataset again") from e
    return [Source("arrow", str(path / f)) for f in files]


def find_sources(inputs: list) -> list[Source]:
    """Expand folders (recursively, sorted) and check every input exists and has a readable kind."""
    sources: list[Source] = []
    kinds = {
        ".txt": "text",
        ".tokens": "text",
        ".jsonl": "jsonl",
        ".jsonl.gz": "jsonl",
        ".parquet": "parquet",
        ".tsv": "table",
        ".csv": "table",
    }
    for item in inputs:
        if isinstance(item, str) and item.startswith("hf:"):
            sources.append(Source("hub", item[3:]))
            continue
        path = Path(item)
        if path.is_dir():
            hf = _hf_dataset_dir(path)
            if hf is not None:
                sources.extend(hf)
                continue
            found = sorted(p for p in path.rglob("*") if p.is_file() and _suffix(p) in FILE_SUFFIXES)
            if not found:
                raise DataError(
                    f"input folder {path} holds no {', '.join(FILE_SUFFIXES)} files; point at the text itself"
                )
            sources.extend(Source(kinds[_suffix(p)], str(p)) for p in found)
        elif path.is_file():
            if path.suffix == ".json":
                raise DataError(
                    f"input {path} is a .json file; prepare reads plain text or .jsonl "
                    "(one JSON object per line)"
                )
            sources.append(Source(kinds.get(_suffix(path), "text"), str(path)))
        else:
            raise DataError(
                f"input {path} does not exist; pass a {', '.join(FILE_SUFFIXES)} file, or a folder"
            )
    if not sources:
        raise DataError("no inputs given; pass at least one .txt file, .jsonl file or folder")
    return sources


def source_bytes(source: Source) -> int:
    return 0 if source.kind == "hub" else Path(source.path).stat().st_size


# ---- reading units (in the main process: I/O only) ---------------------------------------------------------


def _utf8_cut(block: bytes) -> int:
    """Length of the longest prefix of block that does not end inside a UTF-8 character."""
    end = len(block)
    back = 0  # continuation bytes (10xxxxxx) at the end
    while back < 3 and end - back > 0 and (block[end - back - 1] & 0xC0) == 0x80:
        back += 1
    if end - back == 0:
        return end
    lead = block[end - back - 1]
    need = 4 if lead >= 0xF0 else 3 if lead >= 0xE0 else 2 if lead >= 0xC0 else 1
    return end if need == 1 or back + 1 >= need else end - back - 1


def _byte_units(f, index: int, start: int, size: int, whole_lines: bool) -> Iterator[Unit]:
    """Blocks of about UNIT_BYTES ending at a newline (or, with no newline in sight, at a character boundary)."""
    pos = start
    while True:
        block = f.read(UNIT_BYTES)
        if not block:
            return
        if not block.endswith(b"\n"):
            block += f.readline() if whole_lines else f.readline(UNIT_BYTES)
            if not block.endswith(b"\n") and len(block) > UNIT_BYTES:
                cut = _utf8_cut(block)
                f.seek(cut - len(block), 1)
                block = block[:cut]
        end = pos + len(block)
        yield Unit(index, pos, end, len(block), block, first=pos == 0, last=end >= size)
        pos = end


def iter_units(sources: list[Source], cursor: tuple[int, int] = (0, 0)) -> Iterator[Unit]:
    """Every unit of every source in order, starting at cursor = (source index, position)."""
    for index in range(cursor[0], len(sources)):
        source = sources[index]
        start = cursor[1] if index == cursor[0] else 0
        if source.kind == "text":
            size = Path(source.path).stat().st_size
            with open(source.path, "rb") as f:
                f.seek(start)
                yield from _byte_units(f, index, start, size, whole_lines=False)
        elif source.kind == "jsonl":
            path = Path(source.path)
            opener = gzip.open if path.name.endswith(".gz") else open
            with opener(path, "rb") as f:
                f.seek(start)  # gzip: decompresses up to the offset (positions count decompressed bytes)
                yield from _byte_units(f, index, start, -1, whole_lines=True)
        elif source.kind == "table":
            yield from _table_units(source, index, start)
        elif source.kind == "parquet":
            yield from _parquet_units(source, index, start)
        elif source.kind == "arrow":
            yield from _arrow_units(source, index, start)
        else:
            yield from _hub_units(source, index, start)


def _table_units(source: Source, index: int, start: int) -> Iterator[Unit]:
    """Rows of a .tsv/.csv with a header, TABLE_ROWS at a time (position = row number; resuming re-reads)."""
    import csv
    import sys

    csv.field_size_limit(sys.maxsize)  # article-length cells
    with open(source.path, encoding="utf-8", newline="") as f:
        rows = csv.DictReader(f, delimiter="\t" if source.path.endswith(".tsv") else ",")
        batch, position = [], 0
        for number, row in enumerate(rows):
            if number < start:
                continue
            if not batch:
                position = number
            batch.append(row)
            if len(batch) == TABLE_ROWS:
                yield Unit(
                    index, position, number + 1, sum(len(v or "") for r in batch for v in r.values()), batch
                )
                batch = []
        if batch:
            yield Unit(
                index,
                position,
                position + len(batch),
                sum(len(v or "") for r in batch for v in r.values()),
                batch,
            )


def _import_pyarrow():
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise DataError("reading Parquet / datasets Arrow files needs pyarrow: pip install pyarrow") from None


def _parquet_units(source: Source, index: int, start: int) -> Iterator[Unit]:
    _import_pyarrow()
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(source.path)
    except Exception as e:  # pyarrow raises ArrowInvalid with the reason
        raise DataError(f"{source.path} is not a readable Parquet file ({e})") from e
    for group in range(start, pf.num_row_groups):
        table = pf.read_row_group(group)
        yield Unit(index, group, group + 1, table.nbytes, table.to_pylist())


def _arrow_units(source: Source, index: int, start: int) -> Iterator[Unit]:
    _import_pyarrow()
    import pyarrow as pa

    try:
        reader = pa.ipc.open_stream(pa.memory_map(source.path))  # what datasets writes
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(pa.memory_map(source.path))
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    else:
        batches = iter(reader)
    for number, batch in enumerate(batches):
        if number >= start:
            yield Unit(index, number, number + 1, batch.nbytes, batch.to_pylist())


def _hub_units(source: Source, index: int, start: int) -> Iterator[Unit]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"hf:{source.path} needs the datasets library: pip install datasets") from None
    stream = datasets.load_dataset(source.path, split="train", streaming=True).skip(start)
    rows, position = [], start
    for row in stream:
        rows.append(row)
        if len(rows) == HUB_ROWS:
            yield Unit(index, position, position + len(rows), 0, rows)
            rows, position = [], position + len(rows)
    if rows:
        yield Unit(index, position, position + len(rows), 0, rows)


# ---- decoding units (in worker processes) -----------------------------------------------------------------


def split_text(text: str, size: int | None = None) -> list[str]:
    """Cut text into pieces of about `size` (default PIECE_CHARS) chars, at a newline where there is one
    (tokenizers rarely merge across a newline, so the tokens barely differ from encoding the text whole)."""
    size = size or PIECE_CHARS
    pieces, start = [], 0
    while len(text) - start > size:
        cut = text.rfind("\n", start, start + size)
        end = cut + 1 if cut > start else start + size
        pieces.append(text[start:end])
        start = end
    if start < len(text):
        pieces.append(text[start:])
    return pieces


def _bad_utf8(path: str, offset: int, error: UnicodeDecodeError, what: str, bad_utf8: str) -> str:
    where = f"{path}: byte {offset + error.start}"
    if bad_utf8 == "reject":
        raise DataError(
            f"{where} is not valid UTF-8 ({error.reason}); convert the file to UTF-8, "
            f"or pass --bad-utf8 skip to leave out the {what} holding it"
        )
    return f"{where}: invalid UTF-8 ({error.reason}), {what} skipped"


def _decode_text(unit: Unit, path: str, bad_utf8: str) -> Decoded:
    try:
        return Decoded([unit.payload.decode("utf-8")])
    except UnicodeDecodeError:
        pass
    out = Decoded()
    kept, offset = [], unit.start
    for line in unit.payload.splitlines(keepends=True):
        try:
            kept.append(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            out.skipped.append(_bad_utf8(path, offset, e, "line", bad_utf8))
        offset += len(line)
    out.texts.append("".join(kept))
    return out


def _record_text(record, where: str, text_field: str) -> str:
    if not isinstance(record, dict) or text_field not in record:
        fields = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
        raise DataError(
            f'{where} has no "{text_field}" field (it has: {fields}); '
            "pass --text-field with the field that holds the text"
        )
    text = record[text_field]
    if not isinstance(text, str):
        raise DataError(
            f'{where} field "{text_field}" is a {type(text).__name__}, not a string; '
            "pass --text-field with the field that holds the text"
        )
    return text


def _decode_jsonl(unit: Unit, path: str, text_field: str, bad_utf8: str) -> Decoded:
    out, offset = Decoded(), unit.start
    for line in unit.payload.splitlines(keepends=True):
        here, offset = offset, offset + len(line)
        if not line.strip():
            continue
        try:
            line_text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            out.skipped.append(_bad_utf8(path, here, e, "record", bad_utf8))
            continue
        try:
            record = json.loads(line_text)
        except ValueError as e:
            raise DataError(
                f"{path} (byte {here}) is not valid JSON ({e}); .jsonl inputs need one JSON object per line"
            ) from e
        text = _record_text(record, f"{path} (byte {here})", text_field)
        if text:
            out.texts.append(text)
    return out


def decode_unit(unit: Unit, source: Source, text_field: str, bad_utf8: str) -> Decoded:
    if source.kind == "text":
        return _decode_text(unit, source.path, bad_utf8)
    if source.kind == "jsonl":
        return _decode_jsonl(unit, source.path, text_field, bad_utf8)
    rows = unit.payload
    where = f"{source.path} (row group/batch {unit.start})" if source.kind != "hub" else f"hf:{source.path}"
    texts = [_record_text(row, where, text_field) for row in rows]
    return Decoded([t for t in texts if t])
