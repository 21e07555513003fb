"""Where `hopperlm prepare` writes (data/prepare.py is the pipeline): OUT is checked before any work and swapped in
only when complete; the work happens in OUT.partial, whose saved position (progress.json, and seen.u64 for
dedup) lets a killed prepare go on exactly where it was; and the room the shards need is checked first, a full
disk mid-way leaving the work so far for the same command to continue."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from hopperlm.data.prepare_options import PrepareOptions
from hopperlm.data.shards import MANIFEST, ShardWriter
from hopperlm.diskspace import DiskError, check_room, disk_error
from hopperlm.errors import DataError
from hopperlm.files import swap_in, tree_bytes

PROGRESS_FILE = "progress.json"
SEEN_FILE = "seen.u64"  # 64-bit document hashes for dedup, appended at each save
# input bytes per token, to size the shards before the work: the byte tokenizer's is 1; subword tokenizers
# average about 4 on English (GPT-2, Llama), less on other scripts, so 2 leaves room for those
BYTES_PER_TOKEN = {"byte": 1.0, "other": 2.0}


def check_out_dir(out_dir: Path, overwrite: bool) -> None:
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


def publish(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    """Swap the finished dir into place; the old data (if any) goes only after the new is in place."""
    check_out_dir(out_dir, overwrite)  # again: something may have appeared while we worked
    swap_in(tmp, out_dir)  # (an existing out_dir is empty or holds prepared data: checked just above)


def fingerprint(sources, options: dict) -> dict:
    """What must be unchanged for a saved partial prepare to be continued."""
    files = []
    for s in sources:
        st = os.stat(s.path) if s.kind != "hub" else None
        files.append(
            [s.kind, str(Path(s.path).resolve()) if st else s.path, st and st.st_size, st and st.st_mtime_ns]
        )
    return {"sources": files, "options": options}


def save_state(work: Path, state: dict, train: ShardWriter, val: ShardWriter, new_seen: list[int]) -> None:
    state["shards"] = {"train": train.state(), "val": val.state()}
    if new_seen:
        with open(work / SEEN_FILE, "ab") as f:
            f.write(np.array(new_seen, dtype="<u8").tobytes())
        state["seen"] += len(new_seen)
        new_seen.clear()
    tmp = work / f"{PROGRESS_FILE}.tmp"
    tmp.write_text(json.dumps(state))
    tmp.replace(work / PROGRESS_FILE)  # atomic: a kill leaves the previous state or this one


def load_state(work: Path, fingerprint: dict, log) -> dict | None:
    """The saved state of an interrupted prepare of the same inputs and options, else None (and a clean dir)."""
    path = work / PROGRESS_FILE
    if not work.is_dir():
        return None
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        state = None
    if state is not None and state.get("fingerprint") == fingerprint:
        return state
    log(f"prepare: {work} holds an interrupted prepare of other inputs or options; starting afresh")
    shutil.rmtree(work)
    return None


def check_room_for(out_dir: Path, work: Path, *, total_bytes: int, options: PrepareOptions, log) -> None:
    """Before any work: a DiskError when the shards will not fit on out_dir's disk, a warning when they only
    just fit (a resumed prepare needs only what `work` does not hold yet)."""
    needed = shard_bytes_estimate(total_bytes, options.tokenizer, options) - tree_bytes(work)
    check_room(
        what=f"the shards of {total_bytes / 1e6:,.1f} MB of input",
        where=out_dir.parent,
        needed=needed,
        fix="free space there or choose another --out",
        warn=log,
    )


def disk_full(e: Exception, work: Path, out_dir: Path) -> DiskError | None:
    """A DiskError for a prepare stopped by a full disk or a quota, saying that the work so far is kept in
    `work` and how to continue; None for any other error."""
    return disk_error(
        e,
        what="prepared shards",
        where=work,
        fix=f"the work so far is kept in {work}; free space (or move {out_dir.parent} to a larger disk) "
        "and run the same command again to continue",
    )


def shard_bytes_estimate(total_bytes: int, tokenizer: str, options: PrepareOptions) -> int:
    """About how many bytes the shards of `total_bytes` of input take (uint16 ids; a vocabulary above 65,536
    would double it), with their document index and room for the tail moved into val."""
    per_token = BYTES_PER_TOKEN["byte" if tokenizer == "byte" else "other"]
    tokens = total_bytes / per_token
    return int(tokens * 2 * (1 + options.val_fraction) + (1 << 20))
