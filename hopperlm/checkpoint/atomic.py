"""Folders that are complete or absent: fsync, build beside the target, then rename into place.

A checkpoint, an export or a conversion is written under a temporary name next to where it goes, fsynced,
and renamed: a kill or a full disk half-way leaves the previous folder as it was and no partial one.
Every file in it gets the process's usual permissions (0644 under umask 022), safetensors files included.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from hopperlm.diskspace import check_room, disk_error
from hopperlm.errors import CheckpointError
from hopperlm.files import current_umask, swap_in

if TYPE_CHECKING:
    import torch


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


def usual_permissions(path: Path) -> None:
    """Give a file the mode open() would have: 0o666 less the umask (safetensors writes 0600, which other users
    of a shared cluster cannot read, while every other file of a checkpoint is 0644 under umask 022)."""
    os.chmod(path, 0o666 & ~current_umask())


def save_safetensors(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> None:
    """safetensors.torch.save_file with the process's usual file permissions (see usual_permissions)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    usual_permissions(Path(path))


@contextmanager
def staged_dir(out_dir: Path, overwrite: bool, *, what: str = "", needed: int = 0) -> Iterator[Path]:
    """Build an output folder beside OUT_DIR and move it into place only when the block completes: a failure
    or Ctrl-C half-way leaves no partial folder and whatever OUT_DIR held before untouched. `needed`: about
    how many bytes the block writes (the tensors), checked against the free space first; a full disk (or a
    quota, a read-only folder) half-way is one DiskError naming `what` (default: OUT_DIR's name)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise CheckpointError(
            f"{out_dir} exists and is not empty; pass --overwrite or choose another directory"
        )
    what = what or out_dir.name
    fix = "free space there or choose another output folder; nothing was changed"
    check_room(what=what, where=out_dir.parent, needed=needed, fix=fix)
    tmp = out_dir.parent / f"{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        yield tmp
        swap_in(tmp, out_dir)  # (only when the block completed)
    except BaseException as e:  # the block failed, or the swap: the partial folder goes
        shutil.rmtree(tmp, ignore_errors=True)
        full = disk_error(e, what=what, where=out_dir.parent, needed=needed, fix=fix)
        if full is None:
            raise
        raise full from e
