"""`prepare` on real corpora: exact token streams, splits, sharding, manifests and every user error."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from shared_data import DATA_DIR

import hopperlm.data.sources as sources
from hopperlm.data.prepare import PrepareOptions, prepare, read_manifest, shard_dtype
from hopperlm.data.tokenizer import ByteTokenizer, load_tokenizer
from hopperlm.errors import DataError

SHAKESPEARE = DATA_DIR / "tinyshakespeare" / "input.txt"
GPT2 = DATA_DIR / "tokenizers" / "gpt2" / "tokenizer.json"
EOS = 256  # byte tokenizer


def split_tokens(out: Path, split: str) -> np.ndarray:
    """All tokens of a split, straight from the shard files named in the manifest."""
    manifest = json.loads((out / "manifest.json").read_text())
    dtype = np.dtype(manifest["dtype"])
    parts = [np.fromfile(out / s["file"], dtype=dtype) for s in manifest["shards"][split]]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def byte_doc(data: bytes) -> np.ndarray:
    return np.append(np.frombuffer(data, dtype=np.uint8).astype(np.int64), EOS)


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_shakespeare_byte_tail_split(tmp_path):
    out = tmp_path / "ts"
    manifest = prepare([SHAKESPEARE], out, progress=False)
    assert manifest["format"] == "hopperlm-shards-v2"
    assert manifest["tokens"] == {"train": 1003855, "val": 111540}  # nanoGPT's split: last 10% is val
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == 257 and manifest["eos_id"] == 256
    assert manifest["documents"] == 1
    assert manifest["split"] == {"method": "tail", "val_fraction": 0.1}
    assert manifest["tokenizer"] == ByteTokenizer().identity()
    assert manifest["sources"] == [str(SHAKESPEARE.resolve())]
    stream = np.concatenate([split_tokens(out, "train"), split_tokens(out, "val")])
    assert np.array_equal(stream, byte_doc(SHAKESPEARE.read_bytes()))
    for split in ("train", "val"):
        for shard in manifest["shards"][split]:
            assert hashlib.sha256((out / shard["file"]).read_bytes()).hexdigest() == shard["sha256"]
    assert read_manifest(out) == manifest
    assert load_tokenizer(out).identity() == manifest["tokenizer"]
    assert leftovers(tmp_path) == []


def test_gutenberg_folder_docs_split_many_shards(tmp_path):
    books = sorted((DATA_DIR / "gutenberg").glob("*.txt"), key=lambda p: p.stat().st_size)[:8]
    folder = tmp_path / "books"
    (folder / "more").mkdir(parents=True)
    # Names fix the reading order: a_* files, then the subfolder (recursion), then z_* files.
    names = [f"a_{i}.txt" for i in range(3)] + [f"more/b_{i}.txt" for i in range(3)] + ["z_0.txt", "z_1.txt"]
    for name, book in zip(names, books, strict=True):
        (folder / name).symlink_to(book)
    (folder / "README.md").write_text("not a corpus file")  # ignored: only *.txt / *.jsonl are read

    manifest = prepare(
        [folder],
        tmp_path / "out",
        PrepareOptions(split="docs", val_fraction=0.3, shard_tokens=50_000),
        progress=False,
    )
    expected = {"train": [], "val": []}
    for name in names:
        data = (folder / name).read_bytes()
        to_val = int(hashlib.sha256(data).hexdigest()[:8], 16) / 2**32 < 0.3
        expected["val" if to_val else "train"].append(byte_doc(data))
    assert expected["train"] and expected["val"]  # this book choice really exercises both sides
    assert manifest["documents"] == 8
    for split in ("train", "val"):
        want = np.concatenate(expected[split])
        assert manifest["tokens"][split] == len(want)
        assert np.array_equal(split_tokens(tmp_path / "out", split), want)
        sizes = [s["tokens"] for s in manifest["shards"][split]]
        assert all(n == 50_000 for n in sizes[:-1]) and 0 < sizes[-1] <= 50_000
        assert [s["file"] for s in manifest["shards"][split]] == [
            f"{split}_{i:06d}.bin" for i in range(len(sizes))
        ]
    assert len(manifest["shards"]["train"]) > 2


def test_tail_split_across_many_shards(tmp_path):
    manifest = prepare([SHAKESPEARE], tmp_path / "out", PrepareOptions(shard_tokens=300_000), progress=False)
    assert [s["tokens"] for s in manifest["shards"]["train"]] == [300_000, 300_000, 300_000, 103_855]
    assert [s["tokens"] for s in manifest["shards"]["val"]] == [111_540]
    assert sorted(p.name for p in (tmp_path / "out").glob("*.bin")) == [
        "train_000000.bin",
        "train_000001.bin",
        "train_000002.bin",
        "train_000003.bin",
        "val_000000.bin",
    ]
    stream = np.concatenate([split_tokens(tmp_path / "out", "train"), split_tokens(tmp_path / "out", "val")])
    assert np.array_equal(stream, byte_doc(SHAKESPEARE.read_bytes()))


def test_small_chunks_keep_multibyte_text_exact(tmp_path, monkeypatch):
    """Chunk and piece boundaries (forced tiny here) must never change the bytes, even mid-character."""
    monkeypatch.setattr(sources, "UNIT_BYTES", 1000)
    monkeypatch.setattr(sources, "PIECE_CHARS", 300)
    tir = (DATA_DIR / "hornmt" / "tir.txt").read_bytes()[:200_000]
    tir = tir[: tir.rindex(b"\n") + 1]
    one_line = tir.replace(b"\n", b" ")  # no newline at all: chunks are cut inside characters
    (tmp_path / "lines.txt").write_bytes(tir)
    (tmp_path / "one_line.txt").write_bytes(one_line)
    inputs = [tmp_path / "lines.txt", tmp_path / "one_line.txt"]
    prepare(inputs, tmp_path / "out", PrepareOptions(val_fraction=0.0), progress=False)
    assert np.array_equal(
        split_tokens(tmp_path / "out", "train"), np.concatenate([byte_doc(tir), byte_doc(one_line)])
    )
    assert read_manifest(tmp_path / "out")["shards"]["val"] == []


def test_text_is_cut_at_newlines(monkeypatch):
    """Units and tokenizer pieces end at a newline when a line is shorter than the unit, so tokenizers see
    whole lines (a cut inside a word would change its tokens)."""
    monkeypatch.setattr(sources, "UNIT_BYTES", 2000)
    monkeypatch.setattr(sources, "PIECE_CHARS", 700)
    eng = DATA_DIR / "hornmt" / "eng.txt"  # lines of at most 466 characters
    src = sources.find_sources([eng])
    units = list(sources.iter_units(src))
    texts = [sources.decode_unit(u, src[0], "text", "reject").texts[0] for u in units]
    assert "".join(texts) == eng.read_text(encoding="utf-8")
    assert all(u.payload.endswith(b"\n") for u in units) and len(units) > 100
    assert [u.first for u in units].count(True) == 1 and units[0].first and units[-1].last
    assert [u.last for u in units].count(True) == 1
    assert sum(u.size for u in units) == eng.stat().st_size  # progress advances by exactly the file's bytes
    pieces = [p for t in texts for p in sources.split_text(t)]
    assert "".join(pieces) == eng.read_text(encoding="utf-8")
    assert all(p.endswith("\n") for p in pieces) and len(pieces) > len(units)
    # A unit starting mid-file (a resumed prepare) is cut exactly as in the full pass.
    later = list(sources.iter_units(src, (0, units[5].start)))
    assert [(u.start, u.end) for u in later] == [(u.start, u.end) for u in units[5:]]


def write_gsm8k(path: Path, n: int = 200) -> list[str]:
    lines = (DATA_DIR / "gsm8k" / "test.jsonl").read_text(encoding="utf-8").splitlines()[:n]
    path.write_text("\n".join(lines) + "\n\n", encoding="utf-8")  # trailing blank line is skipped
    return [json.loads(line)["question"] for line in lines]


def test_jsonl_with_text_field_and_hf_tokenizer(tmp_path):
    questions = write_gsm8k(tmp_path / "gsm8k.jsonl")
    tok = load_tokenizer(GPT2)
    manifest = prepare(
        [tmp_path / "gsm8k.jsonl"],
        tmp_path / "out",
        PrepareOptions(tokenizer=str(GPT2), text_field="question"),
        progress=False,
    )
    want = np.concatenate([np.array([*tok.encode(q), tok.eos_id]) for q in questions])
    assert manifest["documents"] == 200
    assert manifest["tokens"]["train"] + manifest["tokens"]["val"] == len(want)
    assert manifest["tokens"]["train"] == int(len(want) * 0.9)
    got = np.concatenate([split_tokens(tmp_path / "out", "train"), split_tokens(tmp_path / "out", "val")])
    assert np.array_equal(got, want)
    assert manifest["tokenizer"]["sha256"] == hashlib.sha256(GPT2.read_bytes()).hexdigest()
    assert manifest["eos_id"] == 50256 and manifest["vocab_size"] == 50257
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == GPT2.read_bytes()


def test_jsonl_errors_name_the_line_and_leave_nothing(tmp_path):
    write_gsm8k(tmp_path / "gsm8k.jsonl", n=5)
    with pytest.raises(
        DataError, match=r'gsm8k.jsonl \(byte 0\) has no "text" field .*question.*--text-field'
    ):
        prepare([tmp_path / "gsm8k.jsonl"], tmp_path / "out", progress=False)
    with open(tmp_path / "gsm8k.jsonl", "a") as f:
        f.write('{"question": "fine"}\n{"question": oops}\n')
    with pytest.raises(DataError, match=r"gsm8k.jsonl \(byte \d+\) is not valid JSON"):
        prepare(
            [SHAKESPEARE, tmp_path / "gsm8k.jsonl"],
            tmp_path / "out",
            PrepareOptions(text_field="question"),
            progress=False,
        )
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path) == []


def test_existing_output_is_protected(tmp_path):
    out = tmp_path / "out"
    prepare([SHAKESPEARE], out, progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(DataError, match="already holds prepared data; pass --overwrite"):
        prepare([SHAKESPEARE], out, PrepareOptions(val_fraction=0.2), progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    manifest = prepare([SHAKESPEARE], out, PrepareOptions(val_fraction=0.2), progress=False, overwrite=True)
    assert read_manifest(out)["tokens"] == manifest["tokens"] == {"train": 892316, "val": 223079}
    assert leftovers(tmp_path) == []

    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match="not empty and holds no prepared data"):
        prepare([SHAKESPEARE], user, progress=False, overwrite=True)
    assert [p.name for p in user.iterdir()] == ["notes.txt"]

    empty = tmp_path / "empty"
    empty.mkdir()
    assert prepare([SHAKESPEARE], empty, progress=False)["documents"] == 1


def test_shard_dtype_boundary():
    assert shard_dtype(257) == np.uint16
    assert shard_dtype(65536) == np.uint16
    assert shard_dtype(65537) == np.uint32


def test_uint32_shards_for_a_large_vocabulary(tmp_path):
    """GPT-2 grown past 65,536 ids: ids above 65,535 must survive the trip through the shards."""
    from tokenizers import Tokenizer

    rust = Tokenizer.from_file(str(GPT2))
    rust.add_tokens([f"<extra_{i}>" for i in range(15_300)])
    (tmp_path / "big").mkdir()
    rust.save(str(tmp_path / "big" / "tokenizer.json"))
    text = (
        SHAKESPEARE.read_text()[:20_000]
        .replace("MENENIUS", "<extra_15299>")
        .replace("Citizen", "<extra_9000>")
    )
    (tmp_path / "in.txt").write_text(text)
    tok = load_tokenizer(tmp_path / "big")
    assert tok.vocab_size == 50257 + 15_300
    manifest = prepare(
        [tmp_path / "in.txt"],
        tmp_path / "out",
        PrepareOptions(tokenizer=str(tmp_path / "big")),
        progress=False,
    )
    assert manifest["dtype"] == "uint32"
    got = np.concatenate([split_tokens(tmp_path / "out", "train"), split_tokens(tmp_path / "out", "val")])
    assert np.array_equal(got, [*tok.encode(text), tok.eos_id])
    assert got.max() == 50257 + 15_299


def test_bpe_tokenizer_trained_on_the_inputs(tmp_path):
    eng = DATA_DIR / "hornmt" / "eng.txt"
    with pytest.raises(DataError, match="--vocab-size is required with --tokenizer bpe"):
        prepare([eng], tmp_path / "out", PrepareOptions(tokenizer="bpe"), progress=False)
    manifest = prepare(
        [eng], tmp_path / "out", PrepareOptions(tokenizer="bpe", vocab_size=400), progress=False
    )
    tok = load_tokenizer(tmp_path / "out")
    assert manifest["tokenizer"]["sha256"] == tok.identity()["sha256"]
    assert tok.vocab_size == manifest["vocab_size"] <= 400
    train = split_tokens(tmp_path / "out", "train").tolist()
    text = eng.read_text(encoding="utf-8")
    assert text.startswith(
        tok.decode(train)[:-2]
    )  # the train split is the head of the text (last char may split)
    assert len(train) + manifest["tokens"]["val"] < len(text.encode()) * 0.8  # real merges, not bytes


def test_option_and_input_errors(tmp_path):
    out = tmp_path / "out"
    cases = [  # (inputs, options, the error)
        ([SHAKESPEARE], dict(val_fraction=0.6), "--val-fraction 0.6"),
        ([SHAKESPEARE], dict(split="random"), "--split 'random'"),
        ([SHAKESPEARE], dict(shard_tokens=0), "--shard-tokens"),
        ([SHAKESPEARE], dict(vocab_size=300), "--vocab-size only applies"),
        ([tmp_path / "nope.txt"], {}, "nope.txt does not exist"),
        ([SHAKESPEARE], dict(split="docs"), "--split docs put all 1 documents on one side"),
        ([SHAKESPEARE], dict(tokenizer=str(tmp_path / "nope.json")), "tokenizer .*nope.json not found"),
    ]
    for inputs, options, message in cases:
        with pytest.raises(DataError, match=message):
            prepare(inputs, out, PrepareOptions(**options), progress=False)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="hold no text"):
        prepare([tmp_path / "empty.txt"], out, progress=False)
    (tmp_path / "data.json").write_text("[]")
    with pytest.raises(DataError, match="is a .json file"):
        prepare([tmp_path / "data.json"], out, progress=False)
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9\n".encode("latin-1"))
    with pytest.raises(DataError, match="latin1.txt: byte 3 is not valid UTF-8.*--bad-utf8 skip"):
        prepare([tmp_path / "latin1.txt"], out, progress=False)
    assert not out.exists() and leftovers(tmp_path) == []


def test_progress_prints_one_summary_line(tmp_path, capsys):
    prepare([DATA_DIR / "hornmt" / "tir.txt"], tmp_path / "out", progress=True)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("prepared ")]
    assert len(lines) == 1
    assert "1 documents" in lines[0] and "uint16" in lines[0] and "MB/s" in lines[0]


def test_read_manifest_errors(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(DataError) as e:
        read_manifest(missing)
    assert f"prepare it first: hopperlm prepare TEXT --out {missing} (TEXT: " in str(e.value)
    with pytest.raises(DataError) as e:
        read_manifest(tmp_path)
    assert f"has no manifest.json; prepare it: hopperlm prepare TEXT --out {tmp_path} (" in str(e.value)
    (tmp_path / "manifest.json").write_text("{broken")
    with pytest.raises(DataError, match="unreadable"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(DataError, match="not a hopperlm-shards-v2 manifest"):
        read_manifest(tmp_path)


def test_default_workers_follow_the_input_size(tmp_path):
    from hopperlm.data.prepare import BYTES_PER_WORKER, PrepareOptions, choose_workers

    assert choose_workers(1_100_000, False, 16)[0] == 1  # a 1 MB file: process start-up would dominate
    assert choose_workers(2 * BYTES_PER_WORKER - 1, False, 16)[0] == 1
    assert choose_workers(3 * BYTES_PER_WORKER, False, 16)[0] == 3
    assert choose_workers(10**12, False, 16) == (16, "1,000,000.0 MB of input: one per 4 MB, the 16 cores")
    assert choose_workers(10**12, True, 16)[0] == 1  # the byte tokenizer never ships text to processes
    lines = []
    prepare(
        [SHAKESPEARE],
        tmp_path / "out",
        PrepareOptions(tokenizer=str(GPT2)),
        workers=None,
        progress=False,
        log=lines.append,
    )
    assert lines[0].startswith("prepare: 1 tokenizer process (1.1 MB of input") and "--workers N" in lines[0]


def test_dropped_documents_are_counted_on_the_console(tmp_path, capsys):
    docs = ["the same line", "another line", "the same line", "\u1200\u1208\u1210 \u1218\u1220", "last line"]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    manifest = prepare(
        [tmp_path / "docs.jsonl"],
        tmp_path / "out",
        PrepareOptions(val_fraction=0.0, dedup=True, filter="script:latin:0.5"),
        progress=True,
    )
    assert manifest["documents"] == 3
    out = capsys.readouterr().out.splitlines()
    summary = next(line for line in out if line.startswith("prepared "))
    assert " MB of input in " in summary and "(first byte read to finished folder)" in summary
    assert (
        "prepare: 1 exact duplicate documents dropped (--dedup); 1 documents dropped by --filter " in out[-1]
    )


def test_a_mistyped_data_dir_offers_the_prepared_one_beside_it(tmp_path):
    prepared = tmp_path / "data" / "shakespeare-byte"
    prepared.mkdir(parents=True)
    (prepared / "manifest.json").write_text("{}")
    (tmp_path / "data" / "shakespeare-bytes-unprepared").mkdir()  # no manifest: not offered
    with pytest.raises(DataError) as e:
        read_manifest(tmp_path / "data" / "shakespear-byte")
    assert str(e.value).endswith(f"did you mean {prepared}? (prepared, beside it)")


def test_a_text_file_given_as_the_data_dir_gets_its_prepare_command(tmp_path):
    text = tmp_path / "input.txt"
    text.write_text("hello\n")
    with pytest.raises(DataError) as e:
        read_manifest(text)
    assert str(e.value) == (
        f"{text} is a file, not a prepared data dir; prepare it first: hopperlm prepare {text} --out data/input, "
        "then pass --data.path data/input"
    )
    with pytest.raises(DataError) as e:
        read_manifest(tmp_path)  # a folder of text (input.txt), no manifest
    assert str(e.value).startswith(
        f"{tmp_path} is a folder of text, not a prepared data dir; prepare it first: "
    )
