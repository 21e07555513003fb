"""One writer per folder: a run folder, an export's output and prepare's shards are written by one hopperlm process
at a time, and a second one is refused at once in one line rather than interleaving its files with the first's.

The writer holds an exclusive `flock` on a lock file for its life: FOLDER/.hopperlm.lock inside a folder written
in place (a run), OUT.lock beside one that appears whole only at the end (prepare's shards, an export: OUT does
not exist while it is written, and is renamed into place). The holder writes its pid, host, command and start
time into the file, so the one it refuses can say who holds it. The kernel drops a flock with its process: a
killed writer (kill -9, an OOM kill) leaves a lock file that holds nobody back, nothing to clean up. A filesystem
without flock (some NFS and Lustre mounts: ENOLCK, EOPNOTSUPP, ENOSYS) gets one log line and no lock.

A command leaves the disk as it found it when it writes nothing: the folders the holder made to hold the lock (the
run folder and its missing parents, or OUT's missing parents) are removed as it lets go if they are still empty,
so a refused start (a mistyped data path, a k-quant export without llama-quantize) leaves no empty `runs/NAME/`
or output folder behind. Only empty folders it made itself go: a folder that was there before, or that holds
anything, stays as it is.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hopperlm.errors import FolderBusy

LOCK_NAME = ".hopperlm.lock"  # inside a folder written in place
# set by a holder for the processes it starts (`hopperlm launch` for its ranks): the pid whose lock they write under
HELD_FOR_CHILDREN_ENV = "HOPPERLM_FOLDER_HELD_BY"
NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}  # (EOPNOTSUPP is ENOTSUP on Linux)
_said_no_flock = False  # the fallback is said once per process, not once per folder


def lock_path(folder: str | Path, *, beside: bool = False) -> Path:
    """Where the lock of `folder` lives: inside it, or `FOLDER.lock` beside it (`beside`)."""
    folder = Path(folder)
    return folder.parent / f"{folder.name}.lock" if beside else folder / LOCK_NAME


@contextmanager
def hold_folder(
    folder: str | Path, *, what: str, beside: bool = False, log: Callable[[str], None] = print
) -> Iterator[Path]:
    """Hold the lock of `folder` while the block runs (the folder is made when the lock lives inside it, the
    parent when `beside`); yields the lock file, removed at the end. Another holder, in this process or any
    other, makes it raise FolderBusy naming the holder and `what` (how the user picks another folder, e.g.
    `--run.out_dir`). An OSError making the folder or the lock file (read-only, not a directory) is raised as
    it is, for the caller to word. The folders it made are removed as it lets go if still empty (see above)."""
    path = lock_path(folder, beside=beside)
    made = _missing_folders(path.parent)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = _take(path, Path(folder), what=what, log=log)
        except FolderBusy:
            if not _held_by_our_launcher(path):
                raise
            yield path  # the launcher that started this process holds it for the whole job: write under its lock
            return
        try:
            yield path
        finally:
            if fd is not None:
                path.unlink(missing_ok=True)  # while still held: the next writer makes a new file (see _take)
                os.close(fd)
    finally:
        _remove_if_empty(made)


def _missing_folders(folder: Path) -> list[Path]:
    """`folder` and those of its parents that do not exist yet, deepest first: what mkdir(parents=True) makes."""
    missing = []
    for candidate in (folder, *folder.parents):
        if candidate.exists() or candidate.is_symlink():
            break
        missing.append(candidate)
    return missing


def _remove_if_empty(folders: list[Path]) -> None:
    """rmdir each folder, deepest first, up to the first that is not empty (or not removable): rmdir removes an
    empty folder only, so anything written into one (by this command or another) keeps it."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _take(path: Path, folder: Path, *, what: str, log: Callable[[str], None]) -> int | None:
    """The held lock's file descriptor, the holder's line written into it; None where there is no flock."""
    global _said_no_flock
    while True:
        # (not truncated on open: a refused writer must not erase the holder's line before reading it)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in NO_FLOCK:
                os.close(fd)
                path.unlink(missing_ok=True)  # a lock file that holds nothing is not left behind
                if not _said_no_flock:
                    log(
                        f"{folder}: no flock on this filesystem ({e.strerror}); a second writer is not refused"
                    )
                    _said_no_flock = True
                return None
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise FolderBusy(
                f"{folder} is being written by another hopperlm ({holder}); wait for it to end or choose "
                f"another {what}"
            ) from None
        try:  # the holder before us may have removed the file between our open and our lock: take the new one
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    mine = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "command": _command()}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(mine).encode(), 0)
    except OSError as e:
        # a full disk: the flock holds without the holder's line, and the writer's own first write says so
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            os.close(fd)
            raise
    return fd


def _held_by_our_launcher(path: Path) -> bool:
    """Whether the lock's holder is the process that started this one and said so ($HOPPERLM_FOLDER_HELD_BY:
    `hopperlm launch`, which holds the run folder before its first write and its ranks write under it)."""
    said = os.environ.get(HELD_FOR_CHILDREN_ENV)
    if not said:
        return False
    try:
        holder = json.loads(path.read_text())
        return str(holder["pid"]) == said and holder["host"] == socket.gethostname()
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _command() -> str:
    """This process's command line as typed: `hopperlm train debug`, not `.../hopperlm/__main__.py train debug`."""
    argv = sys.argv
    if Path(argv[0]).name in ("hopperlm", "__main__.py"):
        argv = ["hopperlm", *argv[1:]]
    return shlex.join(argv)


def _read_holder(fd: int) -> str:
    """The holder as the message names it: `pid 1234 on host, `hopperlm train debug`, since 08:01:02`."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0))
        since = time.localtime(holder["since"])
        when = time.strftime("%H:%M:%S" if since[:3] == time.localtime()[:3] else "%Y-%m-%d %H:%M", since)
        command = holder["command"] if len(holder["command"]) <= 120 else holder["command"][:117] + "..."
        return f"pid {holder['pid']} on {holder['host']}, `{command}`, since {when}"
    except (OSError, ValueError, KeyError, TypeError):  # it has not written its line yet
        return "its pid not written yet"
