"""What a measured result needs to be reproduced: the command, the commit (and whether the tree was dirty),
the date, the machine and the library versions. Every benchmark writes this beside its numbers.

On the GPU machine git cannot be trusted: the device tool copies the working tree, and a `.git` found there
may be an older one (2026-11-27: bench.json said aa8ce2d, dirty, for a run of 6d8fe72). So before each device
call `scripts/gpu_carry.sh --stamp` writes gpu-carry/stamp.json: the commit, the dirty flag and a digest of the
files that run (`tree_digest`). Where the stamp's digest equals this tree's, the stamp's commit is the truth;
a stale stamp is reported as such and git's answer is used, marked unverified."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAMP = REPO / "gpu-carry" / "stamp.json"
# the files whose contents decide what a benchmark runs (bench/results/ holds outputs, not code)
DIGESTED = ("hopperlm", "bench", "scripts", "configs", "tests", "pyproject.toml")
SUFFIXES = (".py", ".sh", ".yaml", ".yml", ".toml", ".jinja")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def tree_digest(root: Path = REPO) -> str:
    """sha256 over the relative path and contents of every code file under DIGESTED (git not needed): equal
    on two machines exactly when they run the same code."""
    h = hashlib.sha256()
    for top in DIGESTED:
        base = root / top
        files = [base] if base.is_file() else sorted(base.rglob("*")) if base.is_dir() else []
        for f in files:
            rel = f.relative_to(root).as_posix()
            if (
                f.is_file()
                and f.suffix in SUFFIXES
                and "__pycache__" not in rel
                and not rel.startswith("bench/results/")
            ):
                h.update(rel.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


def git_commit() -> tuple[str | None, bool | None]:
    """(short commit, the code differs from it), from git here; (None, None) without it. Dirty counts
    untracked files under DIGESTED too: a new module not yet committed runs all the same."""
    status = _git("status", "--porcelain", "--", *DIGESTED)
    return _git("rev-parse", "--short", "HEAD"), bool(status) if status is not None else None


def write_stamp(path: Path = STAMP) -> dict:
    """What scripts/gpu_carry.sh --stamp writes before a device call: this checkout's commit and digest."""
    commit, dirty = git_commit()
    stamp = {
        "commit": commit,
        "dirty": dirty,
        "tree": tree_digest(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stamp, indent=1) + "\n")
    return stamp


def commit_of_this_tree() -> dict:
    """{"commit", "dirty", "commit_source"}: the stamp's where it matches this tree, else git's (marked)."""
    try:
        stamp = json.loads(STAMP.read_text())
    except (OSError, ValueError):
        stamp = None
    commit, dirty = git_commit()
    if stamp is None:
        return {"commit": commit, "dirty": dirty, "commit_source": "git"}
    if stamp.get("tree") == tree_digest():
        return {"commit": stamp["commit"], "dirty": stamp["dirty"], "commit_source": "stamp, tree verified"}
    return {
        "commit": commit,
        "dirty": dirty,
        "commit_source": f"git, unverified: {STAMP.relative_to(REPO)} (commit {stamp.get('commit')}) is "
        "stale for this tree; run scripts/gpu_carry.sh --stamp before the device call",
    }


def provenance(command: str | None = None) -> dict:
    """command defaults to how this process was started."""
    versions = {}
    for package in ("torch", "transformers", "torchao", "triton", "liger-kernel", "bitsandbytes", "peft"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "command": command or " ".join([Path(sys.executable).name, *sys.argv]),
        **commit_of_this_tree(),
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
