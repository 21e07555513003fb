"""Find text for the demo run: Tiny Shakespeare if it can be had, otherwise text that ships with Python.

The demo must work on a fresh machine with no network, so the last resort is a corpus that is always present:
the language-reference topics bundled with the standard library (pydoc_data.topics, ~0.5 MB of English).
"""

from __future__ import annotations

import http.client
import os
import urllib.request
from collections.abc import Callable
from pathlib import Path

from hopperlm.errors import DataError
from hopperlm.files import sha256_hex, write_atomic

TINY_SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
DOWNLOAD_TIMEOUT_S = 10


def cache_dir() -> Path:
    """$HOPPERLM_CACHE_DIR, else $XDG_CACHE_HOME/hopperlm, else ~/.cache/hopperlm."""
    if os.environ.get("HOPPERLM_CACHE_DIR"):
        return Path(os.environ["HOPPERLM_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "hopperlm"


def _write_atomic(path: Path, data: bytes) -> None:
    """The cache file, whole or absent (hopperlm/files.py); an unwritable cache is one line naming the fix."""
    try:
        write_atomic(path, data)
    except OSError as e:
        raise DataError(
            f"cannot write the demo data cache {path} ({e}); set HOPPERLM_CACHE_DIR to a writable dir"
        ) from e


def _download() -> bytes | None:
    try:
        with urllib.request.urlopen(TINY_SHAKESPEARE_URL, timeout=DOWNLOAD_TIMEOUT_S) as response:
            return response.read()
    except (OSError, ValueError, http.client.HTTPException):  # URLError and timeouts are OSErrors
        return None


def pydoc_topics_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def resolve_demo_text(data: str | Path | None, log: Callable[[str], None] = print) -> Path:
    """Path of a text file to train the demo on; logs one line saying which source it chose."""
    if data is not None:
        path = Path(data)
        if not path.exists():
            raise DataError(
                f"demo data {path} does not exist; pass an existing text file or folder, or omit it"
            )
        log(f"demo data: {path} (given)")
        return path

    shared = os.environ.get("HOPPERLM_DATA_DIR")
    if shared and (Path(shared) / "tinyshakespeare" / "input.txt").is_file():
        path = Path(shared) / "tinyshakespeare" / "input.txt"
        log(f"demo data: Tiny Shakespeare from $HOPPERLM_DATA_DIR ({path})")
        return path

    cached = cache_dir() / "tinyshakespeare" / "input.txt"
    if cached.is_file() and sha256_hex(cached.read_bytes()) == TINY_SHAKESPEARE_SHA256:
        log(f"demo data: Tiny Shakespeare from the cache ({cached})")
        return cached

    body = _download()
    if body is not None:
        if sha256_hex(body) == TINY_SHAKESPEARE_SHA256:
            _write_atomic(cached, body)
            log(f"demo data: Tiny Shakespeare downloaded from {TINY_SHAKESPEARE_URL} into {cached}")
            return cached
        log(f"demo data: the download from {TINY_SHAKESPEARE_URL} has the wrong sha256; discarded it")

    fallback = cache_dir() / "pydoc-topics.txt"
    _write_atomic(fallback, pydoc_topics_text().encode("utf-8"))
    why = "no network" if body is None else "no verified download"
    log(
        f"demo data: {why} and no local Tiny Shakespeare; training on Python's own language-reference "
        f"text (pydoc_data.topics) instead ({fallback})"
    )
    return fallback
