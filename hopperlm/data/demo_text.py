"""Find text for the demo run: Tiny Shakespeare if it can be had, otherwise text that ships with Python.

The order: `--data PATH`, `$HOPPERLM_DATA_DIR/tinyshakespeare/input.txt`, `../shared/data/tinyshakespeare`
beside a checkout of hopperlm (where the README's commands find it), the user cache, a download checked
against its sha256, and last a corpus that is always present, so the demo works on a fresh machine with no
network: the language-reference topics bundled with the standard library (pydoc_data.topics, ~0.5 MB of
English), whose loss is not comparable to Tiny Shakespeare's. `describe_text` names what was chosen, for the
run's report.
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
FALLBACK_NAME = "pydoc-topics.txt"
# ../shared/data beside a checkout of hopperlm (None in an installed wheel: no pyproject.toml above the package)
_REPO = Path(__file__).resolve().parents[2]
CHECKOUT_DATA = _REPO.parent / "shared" / "data" if (_REPO / "pyproject.toml").is_file() else None


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

    beside = CHECKOUT_DATA / "tinyshakespeare" / "input.txt" if CHECKOUT_DATA is not None else None
    if beside is not None and beside.is_file():
        log(f"demo data: Tiny Shakespeare from the shared data beside this checkout ({beside})")
        return beside

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

    fallback = cache_dir() / FALLBACK_NAME
    _write_atomic(fallback, pydoc_topics_text().encode("utf-8"))
    why = "no network" if body is None else "no verified download"
    log(
        f"demo data: {why} and no local Tiny Shakespeare; training on Python's own language-reference "
        f"text (pydoc_data.topics) instead ({fallback}); its loss is not comparable to Tiny Shakespeare's. "
        "Give the text with --data PATH, or set $HOPPERLM_DATA_DIR to a folder holding tinyshakespeare/input.txt"
    )
    return fallback


def describe_text(path: Path) -> dict[str, str]:
    """What the demo trained on, for its report: a name, the path and the sha256 of the text (a folder's:
    none, its files are named by the data's manifest)."""
    path = Path(path)
    digest = sha256_hex(path.read_bytes()) if path.is_file() else ""
    if digest == TINY_SHAKESPEARE_SHA256:
        name = "Tiny Shakespeare"
    elif path.name == FALLBACK_NAME:
        name = "Python's language reference (pydoc_data.topics): the offline fallback, not comparable to Tiny Shakespeare"
    else:
        name = f"{path.name} (given)"
    return {"name": name, "path": str(path), "sha256": digest}
