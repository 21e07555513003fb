"""What a measured result needs to be reproduced: the command, the commit (and whether the tree was dirty),
the date, the machine and the library versions. Every benchmark writes this beside its numbers."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def provenance(command: str | None = None) -> dict:
    """command defaults to how this process was started."""
    versions = {}
    for package in ("torch", "transformers", "torchao", "triton"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "command": command or " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": _git("rev-parse", "--short", "HEAD"),
        "dirty": bool(status) if status is not None else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "versions": versions,
    }


def save_result(result: dict, path: str | Path) -> None:
    """Write a benchmark's `result` as indented JSON to `path` (its folder made), with this process's
    provenance under "provenance" unless the result carries its own."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({**result, "provenance": result.get("provenance") or provenance()}, indent=2) + "\n"
    )
