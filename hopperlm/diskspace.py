"""Room on disk: whether a planned write fits (the free space itself is measured by files.py), and one line
when a write fails for want of it.

Every writer (checkpoints, prepared shards, exports, metrics) asks here, so a full disk, a quota, a read-only
or failing filesystem reads the same from every command: what could not be written, where, how much was
needed and is free, and what to do. torch's zip writer reports ENOSPC as a RuntimeError without an errno
(`basic_ios::clear: iostream error`, `unexpected pos N vs M` from inline_container.cc): those count too.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hopperlm.errors import HopperError
from hopperlm.files import free_bytes, staged_dir

# the errors a write meets when the filesystem, not the data, is at fault
DISK_ERRNOS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only filesystem",
    errno.EACCES: "permission denied",
    errno.EIO: "input/output error",
}
# what torch's C++ writers (torch.save's zip container) say instead of an errno
TORCH_WRITE_FAILURES = ("basic_ios::clear", "iostream error", "unexpected pos", "PytorchStreamWriter failed")
# and what Rust's writers (safetensors) say: "I/O error: No space left on device (os error 28)"
RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
TIGHT = 1.25  # free space below this multiple of what a run needs is worth a warning (logs, metrics, others)


class DiskError(HopperError):
    """A file could not be written, or will not fit: the disk is full, over quota, read-only or failing."""


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def write_failure(exc: BaseException | None) -> str | None:
    """Why a write failed, when the filesystem is at fault (the exception or one it was raised from): an
    OSError with a DISK_ERRNOS errno, or torch's RuntimeError for the same. None for any other error."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
            return DISK_ERRNOS[e.errno]
        if isinstance(e, RuntimeError) and any(m in str(e) for m in TORCH_WRITE_FAILURES):
            return "write failed (torch: " + str(e).strip().splitlines()[0][:80] + ")"
        code = RUST_OS_ERROR.search(str(e))
        if code and int(code.group(1)) in DISK_ERRNOS:
            return DISK_ERRNOS[int(code.group(1))]
    return None


def room(where: str | Path, needed: int | None = None) -> str:
    """`1.2 MB free, about 1.7 MB needed` for the filesystem of `where` (what is known of it)."""
    free = free_bytes(where)
    parts = [f"{human_bytes(free)} free" if free is not None else "free space unknown"]
    if needed:
        parts.append(f"about {human_bytes(needed)} needed")
    return ", ".join(parts)


def disk_error(
    exc: BaseException, *, what: str, where: str | Path, needed: int | None = None, fix: str = ""
) -> DiskError | None:
    """The one-line DiskError for a failed write of `what` into `where`, or None when `exc` is not one."""
    why = write_failure(exc)
    if why is None:
        return None
    fix = fix or "free space there or choose another folder, then run the same command again"
    return DiskError(f"could not write {what} in {where} ({why}: {room(where, needed)}); {fix}")


@contextmanager
def disk_errors_as_one_line(
    *, what: str, where: str | Path, needed: int | None = None, fix: str = ""
) -> Iterator[None]:
    """A write block whose disk failures leave as one DiskError (the cause kept for --debug)."""
    try:
        yield
    except Exception as e:
        error = disk_error(e, what=what, where=where, needed=needed, fix=fix)
        if error is None:
            raise
        raise error from e


def unwritten(exc: BaseException, fix: str = "") -> DiskError | None:
    """For a write no caller described (a log, a plot, a --json file): the one line for the file the OSError
    names, or None when `exc` is no disk failure. `fix`: what to do (default: free space, run it again)."""
    if write_failure(exc) is None:
        return None
    filename = next((e.filename for e in _chain(exc) if isinstance(e, OSError) and e.filename), None)
    if filename is None:
        return disk_error(exc, what="a file", where=Path.cwd(), fix=fix)
    path = Path(os.fsdecode(filename))  # (TensorBoard names its files in bytes)
    return disk_error(exc, what=path.name, where=path.parent, fix=fix)


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc`, what it was raised from, and what it gathers (torch.distributed.checkpoint's CheckpointException
    holds each rank's error in `failures`, wrapped with its traceback in `.exc`)."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, BaseException):
            yield e
            todo.append(e.__cause__ or e.__context__)
            failures = getattr(e, "failures", None)
            if isinstance(failures, dict):
                todo.extend(failures.values())
        todo.append(getattr(e, "exc", None))  # a wrapped error


def check_room(
    *, what: str, where: str | Path, needed: int, fix: str, warn: Callable[[str], None] | None = None
) -> None:
    """Before the work: DiskError when `needed` bytes do not fit the free space of `where`'s filesystem; a
    warning through `warn` when they fit with less than TIGHT times to spare."""
    free = free_bytes(where)
    if free is None or needed <= 0:
        return
    if free < needed:
        raise DiskError(
            f"not enough room for {what} in {where}: about {human_bytes(needed)} needed, {human_bytes(free)} "
            f"free; {fix}"
        )
    if warn is not None and free < TIGHT * needed:
        warn(
            f"warning: little room to spare for {what} in {where}: about {human_bytes(needed)} needed, "
            f"{human_bytes(free)} free; {fix}"
        )


@contextmanager
def staged_output(out_dir: Path, overwrite: bool, *, what: str = "", needed: int = 0) -> Iterator[Path]:
    """files.staged_dir with room on disk: `needed`, about how many bytes the block writes (the tensors), is
    checked against the free space first; a full disk (or a quota, a read-only folder) half-way is one
    DiskError naming `what` (default: OUT_DIR's name)."""
    out_dir = Path(out_dir)
    what = what or out_dir.name
    fix = "free space there or choose another output folder; nothing was changed"
    with (
        disk_errors_as_one_line(what=what, where=out_dir.parent, needed=needed, fix=fix),
        staged_dir(out_dir, overwrite) as tmp,  # (refuses a non-empty OUT_DIR before the room check)
    ):
        check_room(what=what, where=out_dir.parent, needed=needed, fix=fix)
        yield tmp
