"""Files and folders that are whole or absent: the atomic writes (and the sha256 of bytes or of a file, which
names or checks what is written), on the lowest floor so every package uses them.

A result file rewritten after every row of a benchmark, a cache shared by the ranks of a node, a manifest: each
is written to a temporary name in the same folder and renamed over the target, so a reader (or a kill half-way)
never sees a half-written file, and what was there before stays until the new one is complete.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

HASH_BLOCK = 8 << 20  # bytes read at a time by file_sha256


def write_atomic(path: str | Path, data: bytes | str) -> Path:
    """Write `data` (text is UTF-8) to `path` through a temporary file beside it and a rename; the folder is
    made if missing. On any failure the temporary file is removed and the previous `path`, if any, is kept
    (an OSError that named no file names `path`: a full disk reads as where it happened)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes 0600; the file gets open()'s usual mode
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None:  # a failed write names no file: name the target
            e.filename = str(path)
        raise
    return path


def current_umask() -> int:
    """The process's umask, read from /proc where Linux shows it (no set-and-restore race between threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def swap_in(tmp: str | Path, final: str | Path) -> Path:
    """Move a complete folder `tmp` into place at `final` (beside it, so a rename); a folder already there is
    removed only once the new one is in place: a crash leaves the old folder or the new, never neither."""
    tmp, final = Path(tmp), Path(final)
    if final.exists():
        old = final.parent / f"{final.name}.old-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    return final


def sha256_hex(data: bytes) -> str:
    """The sha256 of `data` as 64 lowercase hex digits (what checksum files and manifests record)."""
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes, as `sha256_hex` gives it, read in blocks (shards can be GBs)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            h.update(block)
    return h.hexdigest()
