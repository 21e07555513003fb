"""Files and folders that are whole or absent: the atomic writes, staged folders, fsync, whole-line appends,
the free space they need (and the sha256 of bytes or of a file, which names or checks what is written), on the
lowest floor so every package uses them.

A result file rewritten after every row of a benchmark, a cache shared by the ranks of a node, a manifest: each
is written to a temporary name in the same folder and renamed over the target, so a reader (or a kill half-way)
never sees a half-written file, and what was there before stays until the new one is complete.

A checkpoint, an export, a conversion or a tokenizer is a folder written under a temporary name next to where it
goes, fsynced, and renamed: a kill or a full disk half-way leaves the previous folder as it was and no partial
one. Every file in it gets the process's usual permissions (0644 under umask 022), safetensors files included.
The one-line wording of a full disk lives a floor beside this one, in diskspace.py.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hopperlm.errors import CheckpointError

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
        usual_permissions(Path(tmp))  # mkstemp makes 0600; the file gets open()'s usual mode
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


def usual_permissions(path: Path) -> None:
    """Give a file the mode open() would have: 0o666 less the umask (safetensors writes 0600, which other users
    of a shared cluster cannot read, while every other file of a checkpoint is 0644 under umask 022)."""
    os.chmod(path, 0o666 & ~current_umask())


def save_safetensors(tensors: dict, path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors.torch.save_file with the process's usual file permissions (see usual_permissions)."""
    from safetensors.torch import save_file  # (imported here: the rest of this floor needs no torch)

    save_file(tensors, str(path), metadata=metadata)
    usual_permissions(Path(path))


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's entries: a rename survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file under `path`, then `path` itself."""
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_path(path)


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


@contextmanager
def staged_dir(out_dir: Path, overwrite: bool) -> Iterator[Path]:
    """Build an output folder beside OUT_DIR and move it into place only when the block completes: a failure
    or Ctrl-C half-way leaves no partial folder and whatever OUT_DIR held before untouched. (diskspace's
    staged_output adds the free-space check first and a full disk half-way as one DiskError.)"""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise CheckpointError(
            f"{out_dir} exists and is not empty; pass --overwrite or choose another directory"
        )
    tmp = out_dir.parent / f"{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        yield tmp
        swap_in(tmp, out_dir)  # (only when the block completed)
    except BaseException:  # the block failed, or the swap: the partial folder goes
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def append_line(path: str | Path, line: str) -> None:
    """Append one line to a log (metrics.jsonl, events.jsonl) whole or not at all: a write that fails half-way
    is cut back off, so the file stops growing on a full disk rather than ending in a torn record."""
    with open(path, "ab") as f:
        size = f.tell()
        try:
            f.write(line.encode() + b"\n")
            f.flush()
        except BaseException as e:
            f.truncate(size)  # (cutting frees space: it succeeds where the write did not)
            if isinstance(e, OSError) and e.filename is None:  # a failed write names no file: name the log
                e.filename = str(path)
            raise


def free_bytes(path: str | Path) -> int | None:
    """Bytes an unprivileged writer may still use on the filesystem that holds `path` (or would hold it: the
    nearest existing folder above it); None where the OS cannot say."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def tree_bytes(path: str | Path) -> int:
    """Bytes of the files under `path` (a file: its size; missing: 0)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


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
