"""`hopperlm prepare`: turn text corpora of any size into memory-mappable token shards plus a manifest.

Inputs are read as units (sources.py) and tokenized in worker processes (encoding.py); the results come back in
input order, so the shards do not depend on the number of workers. The main process decides, document by
document, the train/val side (`tail`: the last fraction of tokens, nanoGPT's split; `docs`: by a hash of the
document text), drops exact duplicates (`dedup`) and documents the filter rejects, and appends each document
in the document format (`--doc-format`: EOS after it, or the tokenizer's own BOS before it; encoding.py) and
the document-start index to the shards (shards.py).

Resumable: the work happens in `OUT.partial/`, and after every few seconds of work and after every finished
shard the position in the input and the shard sizes are saved to `progress.json` there. A prepare that is
killed and started again with the same inputs and options cuts the shards back to the saved sizes and goes on
from the saved position: finished shards are never redone, and the result is byte-identical to an
uninterrupted run. Only a complete `OUT.partial/` is renamed to OUT, so nothing truncated ever looks valid.
"""

from __future__ import annotations

import json
import shutil
import time
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

from hopperlm.data import prepare_folder
from hopperlm.data.encoding import (
    Encoded,
    EncodeOptions,
    UnitEncoder,
    describe_format,
    document_format,
    encode_in_pool,
    start_pool,
)
from hopperlm.data.prepare_options import PrepareOptions
from hopperlm.data.shards import (  # noqa: F401 - read_manifest/shard_dtype are imported from here
    FORMAT,
    INDEX_DTYPE,
    MANIFEST,
    DocumentFormat,
    ShardWriter,
    index_name,
    read_manifest,
    shard_dtype,
)
from hopperlm.data.sources import decode_unit, find_sources, iter_units, source_bytes
from hopperlm.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from hopperlm.data.tokenizer_train import train_bpe
from hopperlm.errors import DataError, HopperError
from hopperlm.files import file_sha256
from hopperlm.folder_lock import hold_folder

COPY_TOKENS = 4 << 20  # tokens per memmap copy when moving the tail of train into val
SAVE_SECONDS = 2.0
MAX_REPORTS = 100  # bad-UTF-8 reports kept in the manifest (all are counted)


BYTES_PER_WORKER = (
    4_000_000  # below this much input per process, starting the process costs more than it saves
)


def choose_workers(nbytes: int, byte_tokenizer: bool, cores: int) -> tuple[int, str]:
    """Tokenizer processes for `nbytes` of input, with the reason: one for the byte tokenizer (faster than
    shipping text to a process) and below 2 x BYTES_PER_WORKER (one 1 MB file took 6x longer with one process
    per core: start-up dominated), then one per BYTES_PER_WORKER up to one per core."""
    if byte_tokenizer:
        return 1, "byte tokenizer: faster in this process than shipping text to others"
    n = max(1, min(cores, nbytes // BYTES_PER_WORKER))
    if n == 1:
        return 1, f"{nbytes / 1e6:,.1f} MB of input: starting more processes would cost more than they save"
    capped = f", the {cores} cores" if n == cores else ""
    return n, f"{nbytes / 1e6:,.1f} MB of input: one per {BYTES_PER_WORKER // 1_000_000} MB{capped}"


def _progress_bar(enabled: bool) -> Progress:
    """Bytes read, MB/s and ETA; rich falls back to plain output when stdout is not a terminal."""
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    return Progress(*columns, TimeRemainingColumn(), disable=not enabled)


# ---- the pipeline ------------------------------------------------------------------------------------------


def prepare(
    inputs: list,
    out_dir: Path,
    options: PrepareOptions | None = None,
    *,
    workers: int | None = 1,
    progress: bool = True,
    overwrite: bool = False,
    log=print,
) -> dict:
    """Tokenize inputs into train/val shards in out_dir, as `options` say, and return the manifest written
    there. workers=None: chosen by input size (choose_workers), named in a log line. `workers`, `progress`
    and `overwrite` change how the work is done, never the result. No options: PrepareOptions' defaults
    (bytes, the last 10% of tokens held out)."""
    options = options or PrepareOptions()
    if workers is not None and workers < 1:
        raise DataError(f"--workers {workers} must be at least 1")
    tokenizer, val_fraction, split = options.tokenizer, options.val_fraction, options.split
    sources = find_sources(inputs)
    out_dir = Path(out_dir)
    prepare_folder.check_out_dir(out_dir, overwrite)
    total_bytes = sum(source_bytes(s) for s in sources)
    tok_identity = "bpe" if tokenizer == "bpe" else load_tokenizer(tokenizer).identity()
    fingerprint = prepare_folder.fingerprint(sources, options.fingerprint(tok_identity))
    work = out_dir.parent / f"{out_dir.name}.partial"
    prepare_folder.check_room_for(out_dir, work, total_bytes=total_bytes, options=options, log=log)
    # one writer: a second prepare writing the same OUT.partial would corrupt it (folder_lock.py)
    with hold_folder(out_dir, what="--out", beside=True, log=log):
        try:
            state = prepare_folder.load_state(work, fingerprint, log)
            bytes_before = 0 if state is None else state["bytes"]
            t0 = time.perf_counter()  # the first byte read (BPE training or tokenizing) to the published OUT
            try:
                with _progress_bar(progress) as bar:
                    tok, state = _tokenizer_and_state(
                        work,
                        state,
                        sources,
                        options,
                        fingerprint=fingerprint,
                        total_bytes=total_bytes,
                        bar=bar,
                        log=log,
                    )
                    train, val = _write_shards(
                        work,
                        state,
                        sources,
                        options,
                        tok=tok,
                        workers=workers,
                        total_bytes=total_bytes,
                        bar=bar,
                        log=log,
                    )
                manifest = _finish(work, state, tok, sources, split, val_fraction, train, val, inputs)
                prepare_folder.publish(work, out_dir, overwrite)
            except HopperError:
                shutil.rmtree(work, ignore_errors=True)  # bad input or options: nothing worth resuming
                raise
        except KeyboardInterrupt:
            log(f"prepare: interrupted; run the same command again to continue from {work}")
            raise
        except Exception as e:  # a full disk, a quota: the work so far is kept, the same command continues it
            full = prepare_folder.disk_full(e, work, out_dir)
            if full is None:
                raise
            raise full from e
    if progress:
        read = total_bytes - bytes_before  # input bytes this run tokenized (a resumed run: the rest only)
        seconds, bpe = time.perf_counter() - t0, tokenizer == "bpe"
        log(_summary(out_dir, manifest, state, tok, train, val, read=read, seconds=seconds, trained_bpe=bpe))
    dropped = _dropped(manifest["filters"])
    if dropped:
        log(f"prepare: {dropped}")
    return manifest


def _tokenizer_and_state(
    work: Path,
    state: dict | None,
    sources,
    options: PrepareOptions,
    *,
    fingerprint: dict,
    total_bytes: int,
    bar,
    log,
) -> tuple[Tokenizer, dict]:
    """The tokenizer and the state to go on from. A fresh start makes `work`, trains (BPE) or loads the
    tokenizer, saves it there and resolves the document format once; a resumed prepare reads both back."""
    if state is not None:
        tok = load_tokenizer(work)
        done = sum(s["tokens"] for side in state["shards"].values() for s in side)
        log(
            f"prepare: resuming the interrupted run in {work} at {state['bytes'] / 1e6:,.1f} MB "
            f"of {total_bytes / 1e6:,.1f} MB ({done:,} tokens kept)"
        )
        return tok, state
    work.mkdir(parents=True)
    if options.tokenizer == "bpe":
        task = bar.add_task("training BPE", total=total_bytes)
        texts = _all_texts(sources, options.text_field, options.bad_utf8, bar, task)
        tok = train_bpe(texts, options.vocab_size)
    else:
        tok = load_tokenizer(options.tokenizer)
    tok.save(work)
    fmt = document_format(options.doc_format, tok, log)
    state = {
        "fingerprint": fingerprint,
        "phase": "encode",
        "cursor": [0, 0],
        "bytes": 0,
        "documents": 0,
        "duplicates": 0,
        "filtered": 0,
        "skipped": [],
        "skipped_count": 0,
        "seen": 0,
        "open_doc": None,  # the text file being read: kept? which side?
        "doc_format": fmt.to_json(),  # resolved once: a resumed run keeps it
        "marker_inside": False,  # did any document's own text encode to the format's marker?
        "dtype": shard_dtype(tok.vocab_size).name,
        "tokenizer": tok.identity(),  # as named by the user, not by the partial dir it is saved in
    }
    return tok, state


def _write_shards(
    work: Path,
    state: dict,
    sources,
    options: PrepareOptions,
    *,
    tok: Tokenizer,
    workers: int | None,
    total_bytes: int,
    bar,
    log,
) -> tuple[ShardWriter, ShardWriter]:
    """Tokenize the inputs, from the saved position on, into the train and val shards in `work`, then move the
    tail of train into val (`--split tail`); returns the closed writers. workers=None: chosen by the input
    left (choose_workers), named in a log line."""
    if workers is None:
        from hopperlm.hardware import cpu_cores

        left = total_bytes - state["bytes"]
        workers, why = choose_workers(left, isinstance(tok, ByteTokenizer), cpu_cores())
        log(f"prepare: {workers} tokenizer process{'es' if workers > 1 else ''} ({why}; --workers N sets it)")
    dtype = np.dtype(state["dtype"])
    train = ShardWriter(work, "train", dtype, options.shard_tokens)
    val = ShardWriter(work, "val", dtype, options.shard_tokens)
    if "shards" in state:
        train.reopen(state["shards"]["train"])
        val.reopen(state["shards"]["val"])
    if state["phase"] == "encode":
        task = bar.add_task("tokenizing", total=total_bytes, completed=state["bytes"])
        fmt = DocumentFormat.from_json(state["doc_format"])
        encode_options = EncodeOptions(
            str(work), options.text_field, options.bad_utf8, options.filter, doc_format=fmt
        )
        _encode_all(
            work, sources, encode_options, workers, state, train, val, lambda n: bar.advance(task, n), log
        )
        state["phase"] = "encoded"
        prepare_folder.save_state(work, state, train, val, [])
    if options.split == "tail" and options.val_fraction > 0:
        _move_tail(work, state, train, val, int(train.tokens * (1 - options.val_fraction)))
    train.close()
    val.close()
    return train, val


def _summary(
    out_dir: Path,
    manifest: dict,
    state: dict,
    tok: Tokenizer,
    train: ShardWriter,
    val: ShardWriter,
    *,
    read: int,
    seconds: float,
    trained_bpe: bool,
) -> str:
    """The line a finished prepare prints: what was written, and the input read per second (`read` bytes in
    `seconds`, from the first byte read to the published folder, BPE training included when there was one)."""
    bpe = ", BPE training included" if trained_bpe else ""
    return (
        f"prepared {out_dir}: {manifest['documents']:,} documents, "
        f"{train.tokens:,} train / {val.tokens:,} val tokens, {train.dtype.name}, "
        f"{len(train.shards)} train + {len(val.shards)} val shards, "
        f"documents {describe_format(DocumentFormat.from_json(state['doc_format']), tok)}, "
        f"{read / 1e6:,.1f} MB of input in {seconds:.1f} s = {read / 1e6 / max(seconds, 1e-9):.1f} MB/s "
        f"(first byte read to finished folder{bpe})"
    )


def _dropped(filters: dict) -> str:
    """What the filters left out, for the console (the manifest's "filters" has the same numbers)."""
    parts = []
    if filters["dedup"]:
        parts.append(f"{filters['duplicates_removed']:,} exact duplicate documents dropped (--dedup)")
    if filters["filter"]:
        parts.append(f"{filters['filtered_out']:,} documents dropped by --filter {filters['filter']}")
    if filters["bad_utf8_skipped"]:
        parts.append(f"{filters['bad_utf8_skipped']:,} lines/records with invalid UTF-8 left out")
    return "; ".join(parts)


def _all_texts(sources, text_field, bad_utf8, bar, task):
    """Every document's text (text files in pieces), for training a tokenizer on the inputs."""
    for unit in iter_units(sources):
        bar.advance(task, unit.size)
        yield from (t for t in decode_unit(unit, sources[unit.source], text_field, bad_utf8).texts if t)


def _encode_all(work, sources, options, workers, state, train, val, advance, log) -> None:
    """Encode every unit from the saved cursor on and append it to the shards, saving progress as we go."""
    opts = state["fingerprint"]["options"]
    # whole text files are hashed (one extra read) only when the docs split or dedup needs it
    need_digest = opts["dedup"] or (opts["split"] == "docs" and opts["val_fraction"] > 0)
    digests: dict[int, str] = {}

    def units():
        for unit in iter_units(sources, tuple(state["cursor"])):
            if sources[unit.source].kind == "text" and need_digest:
                if unit.source not in digests:
                    digests.clear()
                    digests[unit.source] = file_sha256(Path(sources[unit.source].path))
                unit.digest = digests[unit.source]
            yield unit

    seen: set[int] = set()
    if opts["dedup"] and state["seen"]:
        raw = np.fromfile(work / prepare_folder.SEEN_FILE, dtype="<u8", count=state["seen"])
        seen.update(raw.tolist())
    new_seen: list[int] = []
    pool = start_pool(workers, sources, options) if workers > 1 else None
    try:
        stream = (
            encode_in_pool(pool, units(), 2 * workers + 2)
            if pool
            else map(UnitEncoder(sources, options), units())
        )
        last_save, shards_before = time.monotonic(), len(train.shards) + len(val.shards)
        for encoded in stream:
            _append(encoded, sources, state, seen, new_seen, train, val, log)
            state["cursor"] = [encoded.unit.source, encoded.unit.end]
            state["bytes"] += encoded.unit.size
            advance(encoded.unit.size)
            shards_now = len(train.shards) + len(val.shards)
            if shards_now != shards_before or time.monotonic() - last_save > SAVE_SECONDS:
                prepare_folder.save_state(work, state, train, val, new_seen)
                last_save, shards_before = time.monotonic(), shards_now
    finally:
        if pool is not None:
            pool.terminate()
    prepare_folder.save_state(work, state, train, val, new_seen)


def _append(encoded: Encoded, sources, state, seen, new_seen, train, val, log) -> None:
    """Decide side, duplicate and filter for each document of a unit, then append the kept ones."""
    unit, fraction = encoded.unit, state["fingerprint"]["options"]["val_fraction"]
    by_docs = state["fingerprint"]["options"]["split"] == "docs" and fraction > 0
    dedup = state["fingerprint"]["options"]["dedup"]
    is_text = sources[unit.source].kind == "text"
    state["marker_inside"] = state["marker_inside"] or encoded.marker_inside
    for report in encoded.skipped:
        state["skipped_count"] += 1
        if len(state["skipped"]) < MAX_REPORTS:
            state["skipped"].append(report)
            log(f"prepare: {report}")
    out = {0: ([], []), 1: ([], [])}  # side -> (token arrays, document starts), 0 = train, 1 = val
    sizes = {0: 0, 1: 0}
    offset = 0
    for i, length in enumerate(encoded.lengths.tolist()):
        tokens = encoded.tokens[offset : offset + length]
        offset += length
        starts = not is_text or unit.first
        if starts:
            keep, digest = encoded.kept[i], encoded.digests[i]
            if not keep:
                state["filtered"] += 1
            elif dedup:
                key = int(digest[:16], 16)
                if key in seen:
                    keep = False
                    state["duplicates"] += 1
                else:
                    seen.add(key)
                    new_seen.append(key)
            side = int(by_docs and int(digest[:8], 16) / 2**32 < fraction)
            if is_text:
                state["open_doc"] = {"keep": keep, "side": side}
            if keep:
                state["documents"] += 1
        else:
            keep, side = state["open_doc"]["keep"], state["open_doc"]["side"]
        if not keep:
            continue
        arrays, doc_starts = out[side]
        if starts:
            doc_starts.append(sizes[side])
        arrays.append(tokens)
        sizes[side] += len(tokens)
    for side, writer in ((0, train), (1, val)):
        arrays, doc_starts = out[side]
        if arrays:
            writer.write(np.concatenate(arrays), np.array(doc_starts, dtype=np.int64))


def _move_tail(work: Path, state: dict, train: ShardWriter, val: ShardWriter, boundary: int) -> None:
    """Move tokens [boundary, N) of train into val, then cut the train shards back. Each phase is saved, so a
    kill in the middle resumes: the copy is redone from intact train shards, the cut is idempotent."""
    if state["phase"] == "encoded":
        val.reopen([])
        kept, start = [], 0
        for shard in train.shards:
            path, end = work / shard["file"], start + shard["tokens"]
            if end > boundary:
                cut = max(boundary - start, 0)
                mm = np.memmap(path, dtype=train.dtype, mode="r")
                idx = np.fromfile(work / index_name(shard["file"]), dtype=INDEX_DTYPE)
                for i in range(cut, shard["tokens"], COPY_TOKENS):
                    chunk = np.array(mm[i : i + COPY_TOKENS])
                    local = idx[(idx >= i) & (idx < i + len(chunk))] - i
                    val.write(chunk, local)
                del mm  # release the mapping before the file is truncated
                if cut > 0:
                    kept.append({**shard, "tokens": cut, "docs": int(np.searchsorted(idx, cut))})
            else:
                kept.append(shard)
            start = end
        state["phase"], state["train_after_tail"] = "tail-copied", kept
        prepare_folder.save_state(work, state, train, val, [])
    if state["phase"] == "tail-copied":
        train.reopen(state["train_after_tail"])
        state["phase"] = "tail-done"
        prepare_folder.save_state(work, state, train, val, [])


def _finish(work, state, tok, sources, split, val_fraction, train, val, inputs) -> dict:
    """Check the result and write manifest.json (the last file: its presence marks a complete directory)."""
    documents = state["documents"]
    if documents == 0:
        raise DataError(f"the inputs ({', '.join(map(str, inputs))}) hold no text; check the paths")
    if split == "docs" and val_fraction > 0 and (train.tokens == 0 or val.tokens == 0):
        empty = "train" if train.tokens == 0 else "val"
        raise DataError(
            f"--split docs put all {documents} documents on one side ({empty} is empty); "
            "use --split tail or add more documents"
        )
    if train.tokens == 0:
        raise DataError("the corpus is too small: no tokens left for train; add text or lower --val-fraction")
    for name in (
        prepare_folder.PROGRESS_FILE,
        prepare_folder.SEEN_FILE,
        f"{prepare_folder.PROGRESS_FILE}.tmp",
    ):
        (work / name).unlink(missing_ok=True)
    options = state["fingerprint"]["options"]
    fmt = DocumentFormat.from_json(state["doc_format"])
    # the format's one separator id (EOS after, or BOS before, each document) occurs nowhere else: packing may
    # then find documents from the tokens alone, vectorised; otherwise from the .idx document index
    marks = fmt.marker() is not None and not state["marker_inside"]
    manifest = {
        "format": FORMAT,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "sources": [str(Path(p).resolve()) if not str(p).startswith("hf:") else str(p) for p in inputs],
        "tokenizer": state["tokenizer"],
        "dtype": state["dtype"],
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "documents": documents,
        "document_format": {**fmt.to_json(), "requested": options["doc_format"], "marks_documents": marks},
        # true: EOS ids appear only after documents (kept for readers that predate document_format)
        "eos_marks_documents": marks and fmt.marker() == (tok.eos_id, 1),
        "split": {"method": split, "val_fraction": val_fraction},
        "tokens": {"train": train.tokens, "val": val.tokens},
        "filters": {
            "dedup": options["dedup"],
            "duplicates_removed": state["duplicates"],
            "filter": options["filter"],
            "filtered_out": state["filtered"],
            "bad_utf8": options["bad_utf8"],
            "bad_utf8_skipped": state["skipped_count"],
            "bad_utf8_reports": state["skipped"],
        },
        "shards": {
            name: [
                {
                    **s,
                    "sha256": file_sha256(work / s["file"]),
                    "index_sha256": file_sha256(work / index_name(s["file"])),
                }
                for s in writer.shards
            ]
            for name, writer in (("train", train), ("val", val))
        },
    }
    (work / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest
