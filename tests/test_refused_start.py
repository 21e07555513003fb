"""A refused start leaves the disk as it found it: the mistakes a user makes in the first minutes (a data path that
does not exist, the text itself given as data.path, a data folder never prepared, a mistyped config key, a
tokenizer that does not match the data) each stop `hopperlm train` with one line and exit code 2, and leave no
run folder, no `runs/` above it and no lock file; a run folder that was there before, with content, stays as it
was. (The failed k-quant export's output folder: tests/test_gguf_export.py.)"""

from pathlib import Path

import pytest

from hopperlm.cli import main

REPO = Path(__file__).resolve().parents[1]
DEBUG = REPO / "configs" / "debug.yaml"

MISTAKES = {
    "missing data path": (lambda data, tmp: ["--data.path", str(tmp / "no-such-data")], "does not exist"),
    "text file as data.path": (
        lambda data, tmp: ["--data.path", str(data / "tinyshakespeare" / "input.txt")],
        "is a file, not a prepared data dir",
    ),
    "data folder without manifest": (
        lambda data, tmp: ["--data.path", str(tmp / "unprepared")],
        "has no manifest.json",
    ),
    "mistyped config key": (lambda data, tmp: ["--train.max_step", "20"], "max_step"),
    "tokenizer not the data's": (
        lambda data, tmp: [
            "--data.tokenizer",
            str(data / "tokenizers" / "tinyllama-1.1b-chat-v1.0" / "tokenizer.json"),
        ],
        "does not match the tokenizer",
    ),
}


def refused(args: list[str], capsys) -> str:
    """The one `error:` line of a command that exits with code 2."""
    with pytest.raises(SystemExit) as exit_:
        main(args)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exit_.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    return lines[0]


@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_refused_start_leaves_no_run_folder(mistake, shakespeare_bytes, data_dir, tmp_path, capsys):
    extra, message = MISTAKES[mistake]
    (tmp_path / "unprepared").mkdir()
    (tmp_path / "unprepared" / "README").write_text("not a prepared data dir\n")
    data = ["--data.path", str(shakespeare_bytes)]
    run = tmp_path / "runs" / "debug"
    line = refused(
        ["train", str(DEBUG), *data, "--run.out_dir", str(run), *extra(data_dir, tmp_path)], capsys
    )
    assert message in line, line
    assert not (tmp_path / "runs").exists()  # neither runs/debug nor runs/ (nor a lock in them) is left

    kept = tmp_path / "kept"  # a run folder that was there before: as it was, and no lock left in it
    kept.mkdir()
    (kept / "notes.txt").write_text("mine\n")
    line = refused(
        ["train", str(DEBUG), *data, "--run.out_dir", str(kept), *extra(data_dir, tmp_path)], capsys
    )
    assert message in line, line
    assert [p.name for p in kept.iterdir()] == ["notes.txt"] and (kept / "notes.txt").read_text() == "mine\n"


def test_a_folder_the_holder_did_not_make_or_that_holds_anything_stays(tmp_path):
    """hold_folder removes only the empty folders it made itself: one written into stays, as do its parents."""
    from hopperlm.folder_lock import LOCK_NAME, hold_folder

    with hold_folder(tmp_path / "a" / "b", what="--out"):
        assert (tmp_path / "a" / "b" / LOCK_NAME).is_file()
    assert not (tmp_path / "a").exists()
    with hold_folder(tmp_path / "a" / "b", what="--out"):
        (tmp_path / "a" / "b" / "written").write_text("x")
    assert [p.name for p in (tmp_path / "a" / "b").iterdir()] == ["written"]
    with hold_folder(tmp_path / "c" / "out", what="OUT", beside=True):
        pass  # an export whose OUT never appeared: the parent made for its lock goes too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
