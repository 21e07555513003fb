"""prepare at scale: killed and resumed runs are byte-identical, worker count does not matter, the document
index, bad UTF-8, duplicates, filters, and the other input formats. Real text from ../shared/data."""

import gzip
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from shared_data import DATA_DIR

import hopperlm.data.prepare_folder as prepare_folder
import hopperlm.data.sources as sources
from hopperlm.data.prepare import PrepareOptions, prepare
from hopperlm.data.shards import index_name
from hopperlm.data.tokenizer import load_tokenizer
from hopperlm.errors import DataError, FolderBusy
from hopperlm.folder_lock import hold_folder

REPO = Path(__file__).resolve().parent.parent
TINYLLAMA = DATA_DIR / "tokenizers" / "tinyllama-1.1b-chat-v1.0" / "tokenizer.json"
TIR, ENG = DATA_DIR / "hornmt" / "tir.txt", DATA_DIR / "hornmt" / "eng.txt"


def books(folder: Path, count: int) -> Path:
    folder.mkdir(parents=True)
    for book in sorted((DATA_DIR / "gutenberg").glob("pg0*.txt"))[:count]:
        (folder / book.name).symlink_to(book)
    return folder


def lines_jsonl(path: Path, *sources: Path, repeat: int = 1) -> list[str]:
    texts = [line for src in sources for line in src.read_text(encoding="utf-8").splitlines() if line.strip()]
    texts = texts * repeat
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return texts


def shard_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix in (".bin", ".idx")}


def comparable(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k != "created"}


# `hopperlm prepare` in a child process that SIGKILLs itself when it is about to write its n-th saved state:
# a real kill -9 mid-run (the work since the last save is lost), at the same point on a fast or a slow machine
KILLED_AT_SAVE = """
import os, signal, sys
import hopperlm.data.prepare_folder as prepare_folder
from hopperlm.cli import main
save, calls, kill_at = prepare_folder.save_state, [0], int(sys.argv[1])
def save_or_die(*args):
    calls[0] += 1
    if calls[0] == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    save(*args)
prepare_folder.save_state = save_or_die
main(sys.argv[2:])
"""


@pytest.mark.slow
def test_killed_prepare_resumes_to_identical_shards(tmp_path):
    """SIGKILL a real `hopperlm prepare` mid-run, twice; the resumed result equals an uninterrupted run."""
    folder = books(tmp_path / "books", 14)
    args = [
        str(folder),
        "--tokenizer",
        str(TINYLLAMA),
        "--shard-tokens",
        "150000",
        "--workers",
        "1",
        "--split",
        "tail",
    ]
    out = tmp_path / "out"
    partial = tmp_path / "out.partial"
    cmd = [sys.executable, "-m", "hopperlm", "prepare", *args, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    progress = []
    for kill_at in (3, 3):  # the first run dies before its 3rd save, the resumed one before its 3rd
        killed = subprocess.run(
            [sys.executable, "-c", KILLED_AT_SAVE, str(kill_at), "prepare", *args, "--out", str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
        assert not (out / "manifest.json").exists()
        progress.append(json.loads((partial / "progress.json").read_text())["bytes"])
    assert 0 < progress[0] < progress[1]  # the second run resumed from the first's last save, and went on
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resuming the interrupted run" in done.stdout
    assert not partial.exists()

    reference = tmp_path / "reference"
    manifest = prepare(
        [folder],
        reference,
        PrepareOptions(tokenizer=str(TINYLLAMA), shard_tokens=150_000),
        workers=1,
        progress=False,
    )
    assert len(manifest["shards"]["train"]) > 5
    resumed = json.loads((out / "manifest.json").read_text())
    assert comparable(resumed) == comparable(manifest)
    assert shard_files(out) == shard_files(reference)


@pytest.mark.parametrize("split", ["tail", "docs"])
def test_crash_after_any_save_resumes_identically(tmp_path, monkeypatch, split):
    """Interrupt after the n-th saved state, for every n (tail moving included), and resume each time."""
    data = tmp_path / "docs.jsonl"
    lines_jsonl(data, TIR, ENG)
    (tmp_path / "story.txt").symlink_to(sorted((DATA_DIR / "gutenberg").glob("*.txt"))[0])
    inputs = [data, tmp_path / "story.txt"]
    monkeypatch.setattr(sources, "UNIT_BYTES", 60_000)
    options = PrepareOptions(shard_tokens=70_000, split=split, val_fraction=0.2, dedup=True)
    reference = prepare(inputs, tmp_path / "reference", options, progress=False)
    real_save, saves = prepare_folder.save_state, []

    def counting_save(*args):
        real_save(*args)
        saves.append(1)
        if len(saves) == crash_at:
            raise KeyboardInterrupt

    monkeypatch.setattr(prepare_folder, "save_state", counting_save)
    crash_at, out = 1, tmp_path / "out"
    while True:
        saves.clear()
        try:
            manifest = prepare(inputs, out, options, progress=False)
            break
        except KeyboardInterrupt:
            assert (tmp_path / "out.partial" / "progress.json").is_file()
            crash_at += 1
    assert crash_at > 5  # there were that many states to resume from
    assert comparable(manifest) == comparable(reference)
    assert shard_files(out) == shard_files(tmp_path / "reference")


def test_a_second_prepare_on_the_same_output_is_refused(tmp_path):
    with (
        hold_folder(tmp_path / "out", what="--out", beside=True),
        pytest.raises(FolderBusy, match=rf"out is being written by another hopperlm \(pid {os.getpid()} on "),
    ):
        prepare([ENG], tmp_path / "out", progress=False)
    prepare([ENG], tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no lock, partial or temporary left


def test_worker_processes_give_the_same_shards(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "UNIT_BYTES", 100_000)
    inputs = [TIR, DATA_DIR / "travis-tigrinya-parallel" / "TI_volunteers.txt"]
    one = prepare(
        inputs, tmp_path / "one", PrepareOptions(tokenizer=str(TINYLLAMA)), workers=1, progress=False
    )
    two = prepare(
        inputs, tmp_path / "two", PrepareOptions(tokenizer=str(TINYLLAMA)), workers=2, progress=False
    )
    assert comparable(one) == comparable(two)
    assert shard_files(tmp_path / "one") == shard_files(tmp_path / "two")
    tok = load_tokenizer(TINYLLAMA)
    for path, shard in ((TIR, "train_000000.bin"),):
        # thousands of 4K-character pieces, yet exactly the ids of the whole text encoded at once, BOS first
        # (TinyLlama's document format: `<s> text`, as transformers' tokenizer(text))
        want = tok.encode_for_model(path.read_text(encoding="utf-8"))
        got = np.fromfile(tmp_path / "one" / shard, dtype=np.uint16)[: len(want)]
        assert got.tolist() == want


def test_document_index_marks_every_document_start(tmp_path):
    texts = lines_jsonl(tmp_path / "docs.jsonl", ENG)
    manifest = prepare(
        [tmp_path / "docs.jsonl"], tmp_path / "out", PrepareOptions(shard_tokens=50_000), progress=False
    )
    tokens = np.concatenate(
        [np.fromfile(tmp_path / "out" / s["file"], dtype=np.uint16) for s in manifest["shards"]["train"]]
        + [np.fromfile(tmp_path / "out" / s["file"], dtype=np.uint16) for s in manifest["shards"]["val"]]
    )
    lengths = [len(t.encode("utf-8")) + 1 for t in texts]
    want = np.cumsum([0, *lengths[:-1]])
    starts, base = [], 0
    for split in ("train", "val"):
        for s in manifest["shards"][split]:
            idx = np.fromfile(tmp_path / "out" / index_name(s["file"]), dtype="<i8")
            assert len(idx) == s["docs"]
            starts.extend((idx + base).tolist())
            base += s["tokens"]
    # the tail split cuts one document in two: its second half starts val without being a document start
    assert starts == want.tolist()
    assert (tokens[want[1:] - 1] == 256).all()  # every start follows an EOS


def test_bad_utf8_is_reported_and_skipped_or_rejected(tmp_path):
    good = ENG.read_bytes().splitlines(keepends=True)[:50]
    bad_line = b"caf\xe9 au lait\n"  # latin-1, not UTF-8
    offset = sum(map(len, good[:20]))
    (tmp_path / "mixed.txt").write_bytes(b"".join(good[:20]) + bad_line + b"".join(good[20:]))
    records = [json.dumps({"text": line.decode().strip()}).encode() + b"\n" for line in good[:5]]
    records.insert(2, b'{"text": "na\xefve"}\n')
    (tmp_path / "mixed.jsonl").write_bytes(b"".join(records))
    inputs = [tmp_path / "mixed.txt", tmp_path / "mixed.jsonl"]
    with pytest.raises(DataError, match=rf"mixed.txt: byte {offset + 3} is not valid UTF-8"):
        prepare(inputs, tmp_path / "out", progress=False)
    assert not (tmp_path / "out.partial").exists()
    logged = []
    manifest = prepare(
        inputs,
        tmp_path / "out",
        PrepareOptions(bad_utf8="skip", val_fraction=0),
        progress=False,
        log=logged.append,
    )
    record_offset = sum(map(len, records[:2]))
    assert manifest["filters"]["bad_utf8_skipped"] == 2
    reports = manifest["filters"]["bad_utf8_reports"]
    assert reports[0].endswith(
        f"mixed.txt: byte {offset + 3}: invalid UTF-8 (invalid continuation byte), line skipped"
    )
    assert f"mixed.jsonl: byte {record_offset + 12}" in reports[1] and reports[1].endswith("record skipped")
    assert any("line skipped" in line for line in logged)
    tokens = np.fromfile(tmp_path / "out" / "train_000000.bin", dtype=np.uint16)
    text_doc = np.frombuffer(b"".join(good), dtype=np.uint8)
    assert np.array_equal(tokens[: len(text_doc)], text_doc) and tokens[len(text_doc)] == 256
    assert manifest["documents"] == 1 + 5


def test_dedup_and_script_filter(tmp_path):
    texts = lines_jsonl(tmp_path / "both.jsonl", TIR, ENG, repeat=2)
    unique = len(set(texts))
    manifest = prepare(
        [tmp_path / "both.jsonl"], tmp_path / "dedup", PrepareOptions(dedup=True), progress=False
    )
    assert manifest["documents"] == unique
    assert manifest["filters"]["duplicates_removed"] == len(texts) - unique
    tigrinya = prepare(
        [tmp_path / "both.jsonl"],
        tmp_path / "tir",
        PrepareOptions(dedup=True, filter="script:ethiopic:0.5"),
        progress=False,
    )
    tir_lines = {line for line in TIR.read_text(encoding="utf-8").splitlines() if line.strip()}
    assert tigrinya["documents"] == len(tir_lines)
    assert (
        tigrinya["filters"]["filtered_out"]
        == len(texts) - len(tir_lines) - tigrinya["filters"]["duplicates_removed"]
    )
    with pytest.raises(DataError, match="script:NAME:FRACTION"):
        prepare(
            [tmp_path / "both.jsonl"],
            tmp_path / "x",
            PrepareOptions(filter="script:klingon:0.5"),
            progress=False,
        )


def test_jsonl_gz_parquet_and_datasets_dir_match_plain_jsonl(tmp_path):
    texts = lines_jsonl(tmp_path / "plain.jsonl", TIR)[:300]
    lines_jsonl(tmp_path / "plain.jsonl", TIR)
    with gzip.open(tmp_path / "packed.jsonl.gz", "wb") as f:
        f.write((tmp_path / "plain.jsonl").read_bytes())
    want = prepare([tmp_path / "plain.jsonl"], tmp_path / "a", progress=False)
    got = prepare([tmp_path / "packed.jsonl.gz"], tmp_path / "b", progress=False)
    assert want["tokens"] == got["tokens"] and shard_files(tmp_path / "a") == shard_files(tmp_path / "b")
    assert texts
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    all_texts = [json.loads(line)["text"] for line in (tmp_path / "plain.jsonl").read_text().splitlines()]
    pq.write_table(
        pa.table({"id": list(range(len(all_texts))), "text": all_texts}),
        tmp_path / "t.parquet",
        row_group_size=500,
    )
    got = prepare([tmp_path / "t.parquet"], tmp_path / "c", progress=False)
    assert shard_files(tmp_path / "a") == shard_files(tmp_path / "c")
    try:
        import datasets

        datasets.Dataset.from_dict({"text": all_texts}).save_to_disk(str(tmp_path / "hf"))
    except ImportError:  # the same layout save_to_disk writes: an Arrow stream and state.json naming it
        (tmp_path / "hf").mkdir()
        table = pa.table({"text": all_texts})
        with pa.ipc.new_stream(str(tmp_path / "hf" / "data-00000-of-00001.arrow"), table.schema) as writer:
            writer.write_table(table, max_chunksize=400)
        state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}
        (tmp_path / "hf" / "state.json").write_text(json.dumps(state))
    got = prepare([tmp_path / "hf"], tmp_path / "d", progress=False)
    assert shard_files(tmp_path / "a") == shard_files(tmp_path / "d")
