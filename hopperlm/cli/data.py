"""Data verbs: `prepare` (text -> token shards) and `tokenizer` (train one, or extend one for a new language)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hopperlm.cli.common import StatesDefaults, add_verb, log
from hopperlm.errors import ConfigError


def cmd_prepare(args: argparse.Namespace) -> None:
    from hopperlm.data.prepare import PrepareOptions, prepare

    prepare(
        [p if p.startswith("hf:") else Path(p) for p in args.inputs],
        Path(args.out),
        PrepareOptions(
            tokenizer=args.tokenizer,
            vocab_size=args.vocab_size,
            val_fraction=args.val_fraction,
            split=args.split,
            text_field=args.text_field,
            shard_tokens=args.shard_tokens,
            dedup=args.dedup,
            bad_utf8=args.bad_utf8,
            filter=args.filter,
            doc_format=args.doc_format,
        ),
        overwrite=args.overwrite,
        workers=args.workers,
    )


def cmd_tokenizer(args: argparse.Namespace) -> None:
    """`tokenizer train`: a new tokenizer from a corpus; `tokenizer extend`: BASE plus pieces for a new language.
    One writer per output, like export: OUT appears whole at the end, so its lock is OUT.lock beside it."""
    from hopperlm.folder_lock import hold_folder

    with hold_folder(Path(args.out), what="--out", beside=True, log=log):
        _tokenizer(args)


def _tokenizer(args: argparse.Namespace) -> None:
    import json

    from hopperlm.data import tokenizer_train as tt
    from hopperlm.diskspace import staged_output

    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise ConfigError(
            f"--out {out} exists and is not empty; choose another directory or pass --overwrite"
        )
    texts = tt.corpus_texts(args.corpus, args.text_field)
    if args.action == "train":
        tok = tt.train_tokenizer(texts, args.kind, args.vocab_size)
        with staged_output(out, args.overwrite, what="the tokenizer") as tmp:  # whole, or --out as it was
            tok.save(tmp)
        log(
            f"trained {args.kind} tokenizer, {tok.vocab_size:,} pieces, eos id {tok.eos_id}: {out / 'tokenizer.json'}"
        )
        return
    base = tt.load_base(args.base)
    protect = "".join(Path(f).read_text(encoding="utf-8") for f in args.protect)
    ext = tt.extend_tokenizer(base, texts, args.add, protect=[protect])
    heldout = {
        Path(f).parent.name + "/" + Path(f).name: Path(f).read_text(encoding="utf-8") for f in args.heldout
    }
    rows = tt.compare(base, ext.tokenizer, heldout, protect)
    with staged_output(out, args.overwrite, what="the extended tokenizer") as tmp:
        tt.save_extension(ext, tmp, rows)
    for line in tt.format_report(rows, len(ext.added), base.name):
        log(line)
    grown = " + tokenizer.model, the same pieces and ids," if (out / "tokenizer.model").is_file() else ""
    log(f"saved {out / 'tokenizer.json'}{grown} (+ extension.json: the added pieces and this report)")
    if args.json:
        print(json.dumps(rows, indent=1))


def add_parsers(verbs, common: argparse.ArgumentParser) -> None:
    p = add_verb(
        verbs,
        common,
        "prepare",
        cmd_prepare,
        "text/JSONL/TSV/CSV/Parquet -> token shards + manifest.json (resumable)",
        description="An interrupted prepare resumes when run again with the same inputs and options.",
    )
    p.add_argument(
        "inputs",
        nargs="+",
        help=".txt, .tokens (WikiText), .jsonl, .jsonl.gz, .tsv, .csv (a header row; one document per row), "
        ".parquet files, folders of them, a datasets save_to_disk folder, hf:NAME (a Hub dataset)",
    )
    p.add_argument("--out", required=True, help="output directory for shards and manifest.json")
    p.add_argument(
        "--tokenizer",
        default="byte",
        help="byte | bpe | path to tokenizer.json / tokenizer.model (default: byte, one token per byte)",
    )
    p.add_argument("--vocab-size", type=int, help="vocabulary size when training a BPE tokenizer")
    p.add_argument("--val-fraction", type=float, default=0.1, help="share of tokens held out for validation")
    p.add_argument(
        "--split",
        choices=["tail", "docs"],
        default="tail",
        help="tail: last tokens are validation; docs: whole documents by hash",
    )
    p.add_argument(
        "--text-field",
        default="text",
        help="the JSONL field, or the TSV/CSV/Parquet column (by its header name), holding the document text "
        "(default text)",
    )
    p.add_argument(
        "--shard-tokens",
        type=int,
        default=100_000_000,
        help="most tokens per shard file (default: 100,000,000)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing prepared directory")
    p.add_argument(
        "--workers",
        type=int,
        help="tokenizer processes (default: by input size: 1 below 8 MB or for byte, then one per 4 MB "
        "up to one per core)",
    )
    p.add_argument("--dedup", action="store_true", help="drop exact duplicate documents (by sha256)")
    p.add_argument(
        "--bad-utf8",
        choices=["reject", "skip"],
        default="reject",
        help="invalid UTF-8: stop with file and byte offset (reject), or leave the line/record out and report it",
    )
    p.add_argument(
        "--filter",
        help="keep documents that pass: script:NAME:FRACTION (e.g. script:ethiopic:0.5) or module:function",
    )
    p.add_argument(
        "--doc-format",
        choices=["auto", "tokenizer", "eos"],
        default="auto",
        help="tokenizer: each document as the tokenizer's own tokenizer(text) gives it (BOS first for Llama/"
        "TinyLlama: their pretraining format); eos: the text, then EOS (from-scratch runs); auto (default): "
        "tokenizer when the tokenizer adds special tokens of its own, else eos",
    )

    add_tokenizer_parser(verbs, common)


def add_tokenizer_parser(verbs, common: argparse.ArgumentParser) -> None:
    """`tokenizer train` and `tokenizer extend`."""
    p = add_verb(
        verbs, common, "tokenizer", cmd_tokenizer, "train a tokenizer, or extend one for a new language"
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    t = actions.add_parser(
        "train",
        parents=[common],
        help="learn a BPE or Unigram tokenizer on a corpus",
        formatter_class=StatesDefaults,
    )
    t.add_argument("corpus", nargs="+", help="text/JSONL/TSV/Parquet files or folders (as for prepare)")
    t.add_argument("--kind", choices=["bpe", "unigram"], default="bpe", help="byte-level BPE or Unigram")
    t.add_argument(
        "--vocab-size",
        type=int,
        required=True,
        help="most pieces the tokenizer holds, special tokens included (bpe: 258 or more: "
        "the 256 bytes, EOS and its merges; a small corpus may give fewer)",
    )
    e = actions.add_parser(
        "extend",
        parents=[common],
        help="add pieces learned on a new language to BASE; old ids and protected text stay unchanged",
        formatter_class=StatesDefaults,
    )
    e.add_argument(
        "base",
        help="BPE tokenizer.json (or its folder), e.g. TinyLlama's (the Llama-2 vocabulary), or a SentencePiece "
        "tokenizer.model; its tokenizer.model (BASE itself or beside it) is extended too",
    )
    e.add_argument("corpus", nargs="+", help="text of the new language (files or folders, as for prepare)")
    e.add_argument("--add", type=int, required=True, help="most pieces to add")
    e.add_argument(
        "--heldout", action="append", default=[], help="held-out sample to report fertility on (repeat)"
    )
    e.add_argument(
        "--protect", action="append", default=[], help="text whose tokenization must not change (repeat)"
    )
    e.add_argument("--json", action="store_true", help="also print the report as JSON")
    for q in (t, e):
        q.add_argument("--out", required=True, help="output directory for tokenizer.json")
        q.add_argument(
            "--text-field",
            default="text",
            help="the JSONL field, or TSV/CSV/Parquet column, holding the text",
        )
        q.add_argument(
            "--overwrite",
            action="store_true",
            help="replace a non-empty --out (the new tokenizer is written beside it and swapped in whole)",
        )
